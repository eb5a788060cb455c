"""Pluggable linear algebra: damped curvature solves `(C + λI)⁻¹ v` with a solver of your choice.

The blocks' own `multiply_inverse` picks its method (eigendecomposition or pi-adjusted damping for
Kronecker blocks, Cholesky with an eigendecomposition fallback for full blocks). These functions
let the caller choose instead, with any `lineax.AbstractLinearSolver`:

- `eqx_kfac.KroneckerEigenSolver()`: exact, from the factors' eigendecompositions;
- `eqx_kfac.KroneckerPiAdjustedSolver()`: K-FAC's pi-adjusted factored damping (exact for a block
  with one factor, i.e. a `Full` block);
- `lineax.Cholesky()`, `lineax.LU()`, ...: dense factorisations (they materialise the block:
  `dim²` memory, so for `Full` blocks and small Kronecker blocks only);
- `lineax.CG(rtol, atol)` and other iterative solvers: only matrix-vector products, which keep
  the Kronecker structure.

Each block says how it is solved (its `_damped_operator` and `_solve`): Kronecker and full blocks
(`AbstractKroneckerFormBlock`) are handed to the solver as `K + λ·I` with `K` a PSD-tagged
`KroneckerOperator` (a full block is a Kronecker product with one factor) acting on the block's
canonical array, which is what the Kronecker solvers recognise. Other blocks are solved through
their `as_linear_operator(state, λ)`.
"""

from collections.abc import Sequence

import equinox as eqx
import lineax as lx
from jax.typing import ArrayLike
from jaxtyping import Array, PyTree

from ..blocks import CurvatureBlock
from ..blocks.linear_solver import SolverChoice
from ..estimators.base import AbstractCurvatureEstimator, EstimatorState, per_block


def damped_block_operator(
    block: CurvatureBlock, state: eqx.Module, identity_weight: ArrayLike = 0.0
) -> lx.AbstractLinearOperator:
    """The damped curvature `C + λI` of one (unstacked) block, in the form the solvers take.

    **Arguments:**

    - `block`: a curvature block.
    - `state`: its state.
    - `identity_weight`: the damping `λ`.

    **Returns:**

    For `Full` and `KroneckerFactored` blocks, `K + λ·I` (tagged symmetric PSD) with `K` a
    PSD-tagged `KroneckerOperator` on the block's canonical array (the flat parameters for
    `Full`); for other blocks, `block.as_linear_operator(state, λ)` on the tuple of parameters.
    """
    return block._damped_operator(state, identity_weight)


def solve_block(
    block: CurvatureBlock,
    state: eqx.Module,
    vector: Sequence[Array],
    identity_weight: ArrayLike,
    solver: lx.AbstractLinearSolver | None = None,
) -> tuple[Array, ...]:
    """Computes `(C + λI)⁻¹ v` for one block with a chosen solver.

    **Arguments:**

    - `block`: a curvature block.
    - `state`: its state (the current statistics are used, not cached inverses).
    - `vector`: a tuple of arrays shaped like the block's parameters.
    - `identity_weight`: the damping `λ`.
    - `solver`: a lineax solver (see the module docstring); default: the block's own `solver`
      when it has one, else `KroneckerEigenSolver()` for `Full` and Kronecker blocks and
      `lineax.AutoLinearSolver(well_posed=True)` otherwise.

    **Returns:**

    A tuple of arrays shaped like `vector`. A solver that fails (e.g. CG not converging) raises a
    run-time error, as `lineax.linear_solve` does.
    """
    return block._solve(state, block._check_vector(vector), identity_weight, solver)


def solve(
    estimator: AbstractCurvatureEstimator,
    state: EstimatorState,
    vector: PyTree[Array],
    identity_weight: ArrayLike | Sequence[ArrayLike],
    solver: SolverChoice | None = None,
) -> PyTree[Array]:
    """Computes `(C + λI)⁻¹ v` for a block-diagonal estimate, block by block, with chosen solvers.

    **Arguments:**

    - `estimator`: a `BlockDiagonalCurvature` or `ExplicitExactCurvature`.
    - `state`: its state.
    - `vector`: a parameter-space vector (the structure of
      `eqx.filter(params, eqx.is_inexact_array)`).
    - `identity_weight`: the damping, one value or one per block.
    - `solver`: `None` (the defaults of `solve_block`), one lineax solver for every block, one
      per block (`None` entries for the defaults), or a function from a block to its solver or
      `None` (e.g. CG for large Kronecker blocks, Cholesky for the others).

    **Returns:**

    A parameter-space vector.
    """
    if callable(solver) and not isinstance(solver, lx.AbstractLinearSolver):
        solvers = tuple(solver(block) for block in estimator.blocks)
    elif isinstance(solver, Sequence):
        solvers = per_block(tuple(solver), estimator.num_blocks, "solver")
    else:
        solvers = (solver,) * estimator.num_blocks
    weights = per_block(identity_weight, estimator.num_blocks, "identity_weight")
    blocks_vectors = estimator.params_vector_to_blocks_vectors(vector)
    return estimator.blocks_vectors_to_params_vector(
        tuple(
            solve_block(block, s, v, w, slv)
            for block, s, v, w, slv in zip(
                estimator.blocks, state.block_states, blocks_vectors, weights, solvers
            )
        )
    )
