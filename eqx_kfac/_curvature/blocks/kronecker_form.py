"""`AbstractKroneckerFormBlock`: blocks whose curvature is a Kronecker product on one array.

`Full` (one factor, its matrix, acting on the flat parameters) and `KroneckerFactored` (its
factors, acting on the canonical array of its subclass) have this form. It gives them the lineax
solver for power `-1` (the `solver` field; the cached solver state is in `linear_solver.py`) and
their answers to `eqx_kfac.damped_block_operator` and `eqx_kfac.solve_block`: `K + λ·I` with `K`
a PSD-tagged `KroneckerOperator`, solved on the canonical array.
"""

import abc
from typing import ClassVar

import equinox as eqx
import lineax as lx
from jax.typing import ArrayLike
from jaxtyping import Array

from ..operators.block_operators import AbstractParameterLayout, KroneckerCurvatureOperator
from ..solvers.kronecker import KroneckerEigenSolver
from .linear_solver import damped_kronecker_operator, solver_inverse
from .base import CurvatureBlock, Power


class AbstractKroneckerFormBlock(CurvatureBlock):
    """A block whose slice curvature is a PSD Kronecker product `F_1 ⊗ ... ⊗ F_k` acting on a
    canonical array (abstract).

    **Fields:**

    - `solver`: the lineax solver for power `-1`, or `None` for the block's built-in methods
      (static, keyword-only; see `Full` and `KroneckerFactored`).

    **Subclasses** implement `_kronecker_factors(state)` (the slice's factors, square PSD
    matrices) and the property `_operand_layout` (the `AbstractParameterLayout` between one
    slice's parameters and the array the factors act on); their states keep the solver's cache
    in `state.cache.solver_state` (a `FactorCache`). The slice operator (`as_linear_operator`)
    and power `-1` with a `solver` are then shared.
    """

    solver: lx.AbstractLinearSolver | None = eqx.field(static=True, default=None, kw_only=True)
    takes_solver: ClassVar[bool] = True

    @abc.abstractmethod
    def _kronecker_factors(self, state: eqx.Module) -> tuple[Array, ...]:
        """The current Kronecker factors of one slice."""

    @property
    @abc.abstractmethod
    def _operand_layout(self) -> AbstractParameterLayout:
        """The arrangement of one slice's parameters into the array the factors act on."""

    def slice_operator(
        self, state: eqx.Module, identity_weight: ArrayLike
    ) -> KroneckerCurvatureOperator:
        return KroneckerCurvatureOperator(
            self._kronecker_factors(state), identity_weight, self._operand_layout
        )

    def _solver_inverse(
        self,
        state: eqx.Module,
        vector: tuple[Array, ...],
        identity_weight: ArrayLike,
        use_cached: bool,
    ) -> tuple[Array, ...]:
        """`(K + λI)⁻¹ v` for one slice with the block's `solver` (set), on the canonical array."""
        layout = self._operand_layout
        operand = layout.to_array(tuple(v.astype(self.dtype) for v in vector))
        factors = self._kronecker_factors(state)
        solver_state = state.cache.solver_state
        result = solver_inverse(self, solver_state, factors, operand, identity_weight, use_cached)
        return tuple(layout.from_array(result))

    def _factorises_with_solver(self, power: Power) -> bool:
        return power == -1 and self.solver is not None

    def _damped_operator(
        self, state: eqx.Module, identity_weight: ArrayLike
    ) -> lx.AbstractLinearOperator:
        if self.spec.stack_size is not None:
            raise ValueError(
                f"damped_block_operator: the {self.spec.describe} is stacked (applied in a "
                "`scan`); its operator is per slice. Use `solve_block`, which handles stacks."
            )
        return damped_kronecker_operator(self._kronecker_factors(state), identity_weight)

    def _solve(
        self,
        state: eqx.Module,
        vector: tuple[Array, ...],
        identity_weight: ArrayLike,
        solver: lx.AbstractLinearSolver | None,
    ) -> tuple[Array, ...]:
        """Solves slice by slice on the canonical array (default solver: the block's `solver`,
        else `KroneckerEigenSolver()`)."""
        if solver is None:
            solver = KroneckerEigenSolver() if self.solver is None else self.solver
        layout = self._operand_layout

        def one_slice(state: eqx.Module, vector: tuple[Array, ...]) -> tuple[Array, ...]:
            operand = layout.to_array(tuple(v.astype(self.dtype) for v in vector))
            operator = damped_kronecker_operator(self._kronecker_factors(state), identity_weight)
            return tuple(layout.from_array(lx.linear_solve(operator, operand, solver).value))

        return self._stacked(one_slice, state, vector)
