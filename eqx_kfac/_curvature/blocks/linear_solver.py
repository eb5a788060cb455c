"""The linear solver a `Full` or `KroneckerFactored` block uses for its power -1.

Both families can be written as a PSD Kronecker product `K` (a `Full` block is one with a single
factor) acting on a canonical operand (the flat parameters, or the Kronecker block's canonical
array). With `solver=` set, `(C + λI)⁻¹ v` is `lineax.linear_solve(K + λ·I, v, solver)`:

- uncached, from the current statistics and the damping given to `multiply_matpower`;
- cached, from the solver state `solver.init(K + λ·I, {})` that `update_cache` stores, with the
  damping given to `update_cache` (as for cached approximate powers). Only the state's array
  leaves are stored (in the cache's `solver_state`, as zeros from `init`); its static parts are
  rebuilt by tracing `solver.init` abstractly, so the block state stays a PyTree of arrays.

A solve whose `result` is not `lineax.RESULTS.successful` (e.g. CG out of steps) gives NaNs, so
that a failed solve is visible: `Optimizer` skips a step whose update is not finite
(`skip_non_finite=True`), and `optax.apply_if_finite` does the same for `kfac_preconditioner`.
"""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jax.typing import ArrayLike
from jaxtyping import Array, PyTree

from ..._core.control_flow import select_changed
from ..._core.cpu_host import prepare_cpu_host
from ..operators.structured import KroneckerOperator
from ..._core.tree import all_finite
from .base import CurvatureBlock

SolverChoice = (
    lx.AbstractLinearSolver
    | Sequence[lx.AbstractLinearSolver | None]
    | Callable[[CurvatureBlock], lx.AbstractLinearSolver | None]
)

_PSD = (lx.symmetric_tag, lx.positive_semidefinite_tag)


def damped_kronecker_operator(
    factors: Sequence[Array], identity_weight: ArrayLike
) -> lx.AbstractLinearOperator:
    """The damped curvature `K + λ·I` in the form the Kronecker solvers recognise.

    **Arguments:**

    - `factors`: the square PSD Kronecker factors of `K` (one factor for a full matrix).
    - `identity_weight`: the damping `λ`, a scalar (cast to the factors' dtype).

    **Returns:**

    `K + λ·I` tagged symmetric and PSD, with `K` a PSD-tagged `KroneckerOperator` acting on arrays
    shaped `(n_1, ..., n_k)`.
    """
    kron = KroneckerOperator(factors, lx.positive_semidefinite_tag)
    structure = kron.in_structure()
    weight = jnp.asarray(identity_weight, structure.dtype)
    return lx.TaggedLinearOperator(kron + weight * lx.IdentityLinearOperator(structure), _PSD)


def solver_takes_inverse(
    solver: lx.AbstractLinearSolver | None,
    exact_powers: tuple[float, ...],
    approx_powers: tuple[float, ...],
) -> tuple[tuple[float, ...], tuple[float, ...], bool]:
    """Splits the powers to cache between the block's solver (power -1) and its own method.

    **Arguments:**

    - `solver`: the block's solver, or `None`.
    - `exact_powers`, `approx_powers`: normalised powers (sorted tuples of floats).

    **Returns:**

    `(exact_powers, approx_powers, inverse)`: the powers left to the block's own method, and
    whether the solver's state must be cached. Without a solver the powers are returned as they
    are and `inverse` is `False`.
    """
    if solver is None:
        return exact_powers, approx_powers, False
    inverse = -1.0 in exact_powers or -1.0 in approx_powers
    return (
        tuple(p for p in exact_powers if p != -1.0),
        tuple(p for p in approx_powers if p != -1.0),
        inverse,
    )


def _full_state(
    solver: lx.AbstractLinearSolver, factors: Sequence[Array], identity_weight: ArrayLike
) -> PyTree[Any]:
    prepare_cpu_host()  # the solver may factorise through LAPACK (see `eqx_kfac._core.cpu_host`)
    return solver.init(damped_kronecker_operator(factors, identity_weight), {})


def _is_struct(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _state_split(
    solver: lx.AbstractLinearSolver, dims: Sequence[int], dtype: Any
) -> tuple[PyTree[jax.ShapeDtypeStruct], PyTree[Any]]:
    """The shapes of the solver state's array leaves, and its static rest."""
    shapes = eqx.filter_eval_shape(
        _full_state,
        solver,
        tuple(jax.ShapeDtypeStruct((n, n), dtype) for n in dims),
        jax.ShapeDtypeStruct((), dtype),
    )
    return eqx.partition(shapes, _is_struct)


def zero_solver_state(
    solver: lx.AbstractLinearSolver, dims: Sequence[int], dtype: Any
) -> PyTree[Array]:
    """Zeros shaped like the array leaves of the solver's state for factors of sizes `dims`.

    **Arguments:**

    - `solver`: a lineax solver that accepts `damped_kronecker_operator(factors, λ)`.
    - `dims`: the factor sizes `(n_1, ..., n_k)`.
    - `dtype`: the statistics dtype.

    **Returns:**

    The state's array part (non-array leaves are `None`), all zeros.
    """
    shapes, _ = _state_split(solver, dims, dtype)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _require_solver_state(block: CurvatureBlock, solver_state: PyTree[Array] | None) -> PyTree[Array]:
    if solver_state is None:
        raise block._missing_cache(
            f"state of its solver {type(block.solver).__name__} (power -1)", "exact_powers_to_cache"
        )
    return solver_state


def refreshed_solver_state(
    block: CurvatureBlock,
    solver_state: PyTree[Array] | None,
    factors: Sequence[Array],
    identity_weight: ArrayLike,
) -> PyTree[Array]:
    """The array part of `block.solver.init(K + λ·I, {})`, for `update_cache`.

    **Arguments:**

    - `block`: a block with a `solver` field that is not `None` (named in errors).
    - `solver_state`: the cached state, which `init` must have declared (not `None`).
    - `factors`: the current Kronecker factors.
    - `identity_weight`: the damping `λ` frozen into the cache.

    **Returns:**

    The new state's array part, structured like `zero_solver_state`'s result. A factorisation
    that fails (a state that is not finite, e.g. Cholesky of an indefinite `K + λI`) keeps the
    previous state.
    """
    previous = _require_solver_state(block, solver_state)
    state = _full_state(block.solver, factors, identity_weight)
    new, _ = eqx.partition(state, eqx.is_array)
    return select_changed(all_finite(new), new, previous)


def solver_inverse(
    block: CurvatureBlock,
    solver_state: PyTree[Array] | None,
    factors: Sequence[Array],
    operand: Array,
    identity_weight: ArrayLike,
    use_cached: bool,
) -> Array:
    """`(K + λI)⁻¹ operand` with `block.solver`, NaN where the solve fails.

    **Arguments:**

    - `block`: a block with a `solver` field that is not `None` (named in errors).
    - `solver_state`: the slice's cached solver state (`None` when not declared at `init`).
    - `factors`: the current Kronecker factors of the slice.
    - `operand`: the canonical operand shaped `(n_1, ..., n_k)`.
    - `identity_weight`: the damping `λ` (ignored with `use_cached`: the cached state holds the
      damping given to `update_cache`).
    - `use_cached`: solve with the state stored by `update_cache`.

    **Returns:**

    An array shaped like `operand`, all NaN if the solver does not report success.
    """
    solver = block.solver
    operator = damped_kronecker_operator(factors, identity_weight)
    if use_cached:
        arrays = _require_solver_state(block, solver_state)
        _, static = _state_split(solver, [f.shape[0] for f in factors], factors[0].dtype)
        state = eqx.combine(arrays, static)
        solution = lx.linear_solve(operator, operand, solver, state=state, throw=False)
    else:
        solution = lx.linear_solve(operator, operand, solver, throw=False)
    return jnp.where(solution.result == lx.RESULTS.successful, solution.value, jnp.nan)


def check_solver_choice(choice: Any, where: str) -> SolverChoice | None:
    """Checks an `inverse_solver=` argument and makes it hashable (a sequence becomes a tuple).

    **Arguments:**

    - `choice`: `None`, a lineax solver, a sequence of solvers (or `None`s), one per block, or a
      callable from a block to a solver (or `None`).
    - `where`: the function or class taking the argument, for error messages.

    **Returns:**

    `choice`, with a sequence turned into a tuple.
    """
    if choice is None or isinstance(choice, lx.AbstractLinearSolver):
        return choice
    if isinstance(choice, Sequence) and not isinstance(choice, str):
        for i, entry in enumerate(choice):
            if entry is not None and not isinstance(entry, lx.AbstractLinearSolver):
                raise TypeError(
                    f"{where}: inverse_solver[{i}] is a {type(entry).__name__}; each entry must "
                    "be a lineax solver (e.g. lineax.Cholesky()) or None for the block's default."
                )
        return tuple(choice)
    if callable(choice):
        return choice
    raise TypeError(
        f"{where}: inverse_solver must be a lineax solver (e.g. lineax.Cholesky()), a sequence "
        "with one solver (or None) per block, or a function from a block to a solver (or None); "
        f"got a {type(choice).__name__}."
    )
