"""The curvature operators' interface, the damping shared by one-slice operators, stacked slices,
and their lineax and spectral registrations."""

import abc
import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from ..spectral import eigenvalues, frobenius_norm, logdet, matpower, trace
from .layout import flatten_vector, unstack_block_diagonal


Vector = tuple[Float[Array, "..."], ...]


def _check_vector(operator: lx.AbstractLinearOperator, vector: Sequence[Array]) -> Vector:
    expected = tuple(s.shape for s in operator.in_structure())
    shapes = tuple(jnp.shape(v) for v in vector)
    if shapes != expected:
        raise ValueError(
            f"{type(operator).__name__}.mv expects a tuple of arrays of shapes {expected} (the "
            f"block's parameters), got {shapes}."
        )
    dtype = operator.in_structure()[0].dtype if expected else None
    return tuple(jnp.asarray(v, dtype) for v in vector)


class AbstractCurvatureOperator(lx.AbstractLinearOperator):
    """The damped curvature `C + λI` of one curvature block as a lineax operator (abstract).

    It acts on a tuple of arrays shaped like the block's parameters and is symmetric positive
    semi-definite (registered so with lineax). Its spectral functions and matrix powers keep the
    block's structure; `as_matrix()` forms the dense matrix (small blocks only).
    """

    def transpose(self) -> "AbstractCurvatureOperator":
        return self

    def out_structure(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        return self.in_structure()

    def logdet(self) -> Float[Array, ""]:
        """The log-determinant: the sum of the log-eigenvalues (`-inf` when singular).

        **Returns:**

        A scalar array.
        """
        return jnp.sum(jnp.log(self.eigenvalues()))

    @abc.abstractmethod
    def eigenvalues(self) -> Float[Array, " dim"]:
        """The eigenvalues, in the order of the block's `eigenvalues` (not sorted).

        **Returns:**

        A flat array with one eigenvalue per parameter element.
        """

    @abc.abstractmethod
    def trace(self) -> Float[Array, ""]:
        """The trace.

        **Returns:**

        A scalar array.
        """

    @abc.abstractmethod
    def frobenius_norm(self) -> Float[Array, ""]:
        """The Frobenius norm.

        **Returns:**

        A scalar array.
        """

    @abc.abstractmethod
    def diagonal(self) -> Vector:
        """The diagonal, shaped like the parameters.

        **Returns:**

        A tuple of arrays shaped like the operator's input.
        """

    @abc.abstractmethod
    def matpower(self, power: float | int, exact: bool = True) -> "AbstractCurvatureOperator":
        """The matrix power `(C + λI)^p`, with the same kind of structure.

        **Arguments:**

        - `power`: `p`, a Python number (`-1` is the damped inverse).
        - `exact`: `False` allows the structure's approximation (pi-adjusted factored damping
          for Kronecker operators, as the blocks' `exact_power=False`); the others are exact.

        **Returns:**

        A curvature operator with no damping of its own.
        """

    @abc.abstractmethod
    def scaled(self, factor: ArrayLike) -> "AbstractCurvatureOperator":
        """The operator times a positive `factor` (curvature and damping alike).

        **Arguments:**

        - `factor`: a positive scalar.

        **Returns:**

        A curvature operator of the same kind for `factor · (C + λI)`; a Kronecker operator
        scales its last factor.
        """


class AbstractSliceCurvatureOperator(AbstractCurvatureOperator):
    """The damped curvature of one ordinary layer (one slice), from its undamped parts (abstract).

    Subclasses hold the structure of `C` and implement it undamped: `_curvature_mv`,
    `_curvature_matrix`, `_curvature_eigenvalues`, `_curvature_trace`, `_curvature_frobenius`,
    `_curvature_diagonal`, and the powers of the damped operator `_exact_power` /
    `_approximate_power`, plus `scaled`. The damping is added here.

    **Fields:**

    - `damping`: `λ`, a scalar array in the statistics dtype.
    - `param_shapes`: the parameter shapes of the slice.
    """

    damping: eqx.AbstractVar[Float[Array, ""]]
    param_shapes: eqx.AbstractVar[tuple[tuple[int, ...], ...]]

    @abc.abstractmethod
    def _curvature_mv(self, vector: Vector) -> Vector:
        """`C v` (undamped)."""

    @abc.abstractmethod
    def _curvature_matrix(self) -> Float[Array, "dim dim"]:
        """The dense undamped `C`, in parameter order."""

    @abc.abstractmethod
    def _curvature_eigenvalues(self) -> Float[Array, " dim"]:
        """The eigenvalues of `C`."""

    @abc.abstractmethod
    def _curvature_trace(self) -> Float[Array, ""]:
        """`tr C`."""

    @abc.abstractmethod
    def _curvature_frobenius(self) -> Float[Array, ""]:
        """`‖C‖_F`."""

    @abc.abstractmethod
    def _curvature_diagonal(self) -> Vector:
        """The diagonal of `C`, shaped like the parameters."""

    @abc.abstractmethod
    def _exact_power(self, power: float | int) -> "AbstractSliceCurvatureOperator":
        """`(C + λI)^p`."""

    @abc.abstractmethod
    def _approximate_power(self, power: float | int) -> "AbstractSliceCurvatureOperator":
        """The structure's approximation of `(C + λI)^p`."""

    @property
    def dim(self) -> int:
        """The number of parameter elements."""
        return sum(math.prod(s) for s in self.param_shapes)

    def in_structure(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        return tuple(jax.ShapeDtypeStruct(s, self.damping.dtype) for s in self.param_shapes)

    def mv(self, vector: Vector) -> Vector:
        vector = _check_vector(self, vector)
        return tuple(c + self.damping * v for c, v in zip(self._curvature_mv(vector), vector))

    def as_matrix(self) -> Float[Array, "dim dim"]:
        eye = jnp.eye(self.dim, dtype=self.damping.dtype)
        return self._curvature_matrix() + self.damping * eye

    def eigenvalues(self) -> Float[Array, " dim"]:
        return self._curvature_eigenvalues() + self.damping

    def trace(self) -> Float[Array, ""]:
        return self._curvature_trace() + self.damping * self.dim

    def frobenius_norm(self) -> Float[Array, ""]:
        # ‖C + λI‖² = ‖C‖² + 2λ tr C + λ² dim for symmetric C.
        squared = (
            self._curvature_frobenius() ** 2
            + 2 * self.damping * self._curvature_trace()
            + self.damping**2 * self.dim
        )
        return jnp.sqrt(jnp.maximum(squared, 0.0))

    def diagonal(self) -> Vector:
        return tuple(d + self.damping for d in self._curvature_diagonal())

    def matpower(self, power: float | int, exact: bool = True) -> AbstractCurvatureOperator:
        if exact and power == 1:
            return self
        return self._exact_power(power) if exact else self._approximate_power(power)


class StackedCurvatureOperator(AbstractCurvatureOperator):
    """The curvature of a layer applied in `jax.lax.scan` over stacked parameters (final).

    `slices` is a slice operator whose every array leaf carries a leading stack axis (as
    `jax.vmap` returns it): one independent block per slice, so the operator is block diagonal
    over the slices and every function is the slices' (vmapped; eigendecompositions run one
    matrix at a time, see `eqx_kfac._core.linalg`). It acts on the stacked parameters, whose leaves
    carry the stack axis first.

    **Fields:**

    - `slices`: the per-slice operators, stacked along a leading axis of every leaf.
    """

    slices: AbstractSliceCurvatureOperator

    def __init__(self, slices: AbstractSliceCurvatureOperator):
        """**Arguments:**

        - `slices`: a slice curvature operator with a leading stack axis on every array leaf.
        """
        if not isinstance(slices, AbstractSliceCurvatureOperator) or jnp.ndim(slices.damping) != 1:
            raise ValueError(
                "StackedCurvatureOperator(slices=...) takes a slice curvature operator whose array "
                "leaves carry a leading stack axis, e.g. `jax.vmap(block_operator)(...)`; got "
                f"a {type(slices).__name__}."
            )
        self.slices = slices

    def _map(self, fn: Callable[..., Any], *args: Any) -> Any:
        return jax.vmap(fn)(self.slices, *args)

    def in_structure(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        stack = self.slices.damping.shape[0]
        dtype = self.slices.damping.dtype
        return tuple(jax.ShapeDtypeStruct((stack, *s), dtype) for s in self.slices.param_shapes)

    def mv(self, vector: Vector) -> Vector:
        return self._map(lambda op, v: op.mv(v), _check_vector(self, vector))

    def as_matrix(self) -> Float[Array, "dim dim"]:
        return unstack_block_diagonal(
            self._map(lambda op: op.as_matrix()), self.slices.param_shapes
        )

    def eigenvalues(self) -> Float[Array, " dim"]:
        return jnp.reshape(self._map(lambda op: op.eigenvalues()), (-1,))

    def trace(self) -> Float[Array, ""]:
        return jnp.sum(self._map(lambda op: op.trace()))

    def frobenius_norm(self) -> Float[Array, ""]:
        return jnp.linalg.norm(self._map(lambda op: op.frobenius_norm()))

    def diagonal(self) -> Vector:
        return self._map(lambda op: op.diagonal())

    def matpower(self, power: float | int, exact: bool = True) -> "StackedCurvatureOperator":
        return StackedCurvatureOperator(self._map(lambda op: op.matpower(power, exact)))

    def scaled(self, factor: ArrayLike) -> "StackedCurvatureOperator":
        return StackedCurvatureOperator(self._map(lambda op: op.scaled(factor)))


# Lineax's single-dispatch functions


@lx.linearise.register(AbstractCurvatureOperator)
@lx.materialise.register(AbstractCurvatureOperator)
@lx.conj.register(AbstractCurvatureOperator)
def _(operator):
    return operator


@lx.diagonal.register(AbstractCurvatureOperator)
def _(operator):
    return flatten_vector(operator.diagonal())


@lx.tridiagonal.register(AbstractCurvatureOperator)
def _(operator):
    # Only lineax.Tridiagonal asks; the dense matrix is the simple correct route.
    matrix = operator.as_matrix()
    return jnp.diagonal(matrix), jnp.diagonal(matrix, -1), jnp.diagonal(matrix, 1)


@lx.is_symmetric.register(AbstractCurvatureOperator)
@lx.is_positive_semidefinite.register(AbstractCurvatureOperator)
def _(operator):
    return True


@lx.is_negative_semidefinite.register(AbstractCurvatureOperator)
@lx.has_unit_diagonal.register(AbstractCurvatureOperator)
@lx.is_diagonal.register(AbstractCurvatureOperator)
def _(operator):
    return False


@lx.is_diagonal.register(StackedCurvatureOperator)
def _(operator):
    return lx.is_diagonal(operator.slices)


@lx.is_tridiagonal.register(AbstractCurvatureOperator)
@lx.is_lower_triangular.register(AbstractCurvatureOperator)
@lx.is_upper_triangular.register(AbstractCurvatureOperator)
def _(operator):
    return lx.is_diagonal(operator)


trace.register(AbstractCurvatureOperator)(lambda operator: operator.trace())
logdet.register(AbstractCurvatureOperator)(lambda operator: operator.logdet())
eigenvalues.register(AbstractCurvatureOperator)(lambda operator: operator.eigenvalues())
frobenius_norm.register(AbstractCurvatureOperator)(lambda operator: operator.frobenius_norm())


@matpower.register(AbstractCurvatureOperator)
def _(operator, power, exact=True):
    return operator.matpower(power, exact)
