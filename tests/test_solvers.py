"""Tests of the pluggable solvers: every solver agrees with a dense numpy solve on random PSD
blocks where it is exact, and the pi-adjusted one with the blocks' own approximate inverse."""

import equinox as eqx
import jax
import lineax as lx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eqx_kfac
from eqx_kfac import KroneckerLayout
from eqx_kfac import damped_block_operator, solve, solve_block

from block_helpers import dense_spec, flat, random_data, random_vector
from models import mlp_regression

EXACT_SOLVERS = {
    "eigen": eqx_kfac.KroneckerEigenSolver(),
    "cholesky": lx.Cholesky(),
    "cg": lx.CG(rtol=1e-13, atol=1e-13, max_steps=500),
}


def _close(actual, expected, rtol=1e-8, atol=1e-10):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


def _random_block(cls, seed, n_in, n_out, stack=None):
    """A block, estimation data for it and a vector (the state comes from `_state` under jit)."""
    spec = dense_spec(n_in, n_out, layout="out_in", stack=stack)
    block = cls(spec)
    key = jax.random.key(seed)
    return block, random_data(spec, key), random_vector(block, jax.random.fold_in(key, 1))


def _state(block, data):
    return block.update_curvature_matrix_estimate(block.init(), data, 0.0, 1.0, 3)


def _dense_solve(dense, vector, damping):
    dense = np.asarray(dense)
    return np.linalg.solve(dense + damping * np.eye(dense.shape[0]), np.asarray(flat(vector)))


@jax.jit
def _solve_all(block, data, vector, damping):
    state = _state(block, data)
    exact = {name: solve_block(block, state, vector, damping, s) for name, s in EXACT_SOLVERS.items()}
    pi = solve_block(block, state, vector, damping, eqx_kfac.KroneckerPiAdjustedSolver())
    own_exact = block.multiply_inverse(state, vector, damping, exact_power=True)
    own_approx = block.multiply_inverse(state, vector, damping, exact_power=False)
    return block.to_dense_matrix(state), exact, pi, own_exact, own_approx


# One shape per block class (a single-factor block on a size-1 input, and two factors of
# different sizes), so the hypothesis examples, which vary the statistics, vector and damping,
# share one compilation per class.
RANDOM_BLOCKS = ((eqx_kfac.DenseFull, 1, 3), (eqx_kfac.DenseTwoKroneckerFactored, 3, 2))


@settings(max_examples=4)
@given(seed=st.integers(0, 2**16), damping=st.sampled_from([1e-2, 0.3, 2.0]))
def test_solvers_agree_on_random_blocks(seed, damping):
    for cls, n_in, n_out in RANDOM_BLOCKS:
        block, data, vector = _random_block(cls, seed, n_in, n_out)
        dense, exact, pi, own_exact, own_approx = _solve_all(block, data, vector, damping)
        reference = _dense_solve(dense, vector, damping)
        for name, result in exact.items():
            assert [r.shape for r in result] == [v.shape for v in vector], name
            _close(flat(result), reference)
        _close(flat(own_exact), reference)
        # Pi-adjusted damping is the blocks' approximate inverse (and exact for one factor).
        _close(flat(pi), flat(own_approx))
        if cls is eqx_kfac.DenseFull:
            _close(flat(pi), reference)


@eqx.filter_jit
def _operator_and_dense(block, data):
    state = _state(block, data)
    operator = damped_block_operator(block, state, 0.5)
    return operator, operator.as_matrix(), block.to_dense_matrix(state)


def test_operator_matches_dense_matrix():
    for cls in (eqx_kfac.DenseFull, eqx_kfac.DenseTwoKroneckerFactored, eqx_kfac.DenseDiagonal):
        block, data, _ = _random_block(cls, 3, 3, 2)
        operator, matrix, dense = _operator_and_dense(block, data)
        dense = np.asarray(dense) + 0.5 * np.eye(block.dim)
        if cls is eqx_kfac.DenseFull:
            _close(matrix, dense)
        elif cls is eqx_kfac.DenseTwoKroneckerFactored:
            # Same matrix up to the canonical ordering of the parameters.
            order = KroneckerLayout(block).canonical_order()
            _close(matrix, dense[np.ix_(order, order)])
        assert lx.is_positive_semidefinite(operator)


@eqx.filter_jit
def _solve_with(block, data, vector, damping, solvers):
    """The state, its dense matrix and `solve_block` with each solver, in one program."""
    state = _state(block, data)
    results = [solve_block(block, state, vector, damping, solver) for solver in solvers]
    return state, block.to_dense_matrix(state), results


def test_other_blocks_use_their_linear_operator():
    block, data, vector = _random_block(eqx_kfac.DenseDiagonal, 5, 3, 2)
    _, dense, results = _solve_with(block, data, vector, 0.1, (None, lx.CG(rtol=1e-13, atol=1e-13)))
    for result in results:
        _close(flat(result), _dense_solve(dense, vector, 0.1))


def test_stacked_blocks():
    block, data, vector = _random_block(eqx_kfac.DenseTwoKroneckerFactored, 7, 2, 3, stack=3)
    solvers = (None, lx.CG(rtol=1e-13, atol=1e-13))
    state, dense, results = _solve_with(block, data, vector, 0.2, solvers)
    expected = _dense_solve(dense, vector, 0.2)
    for result in results:
        _close(flat(result), expected)
    with pytest.raises(ValueError, match="stacked"):
        damped_block_operator(block, state, 0.2)


def test_estimator_solve_with_solver_per_block(getkey):
    problem = mlp_regression(getkey())
    estimator = eqx_kfac.BlockDiagonalCurvature(
        problem.loss_fn, problem.func_args, default_estimation_mode="ggn_exact"
    )

    def choose(block):
        return lx.CG(rtol=1e-13, atol=1e-13) if block.dim > 10 else lx.Cholesky()

    solvers = (None, choose, [eqx_kfac.KroneckerEigenSolver()] * estimator.num_blocks)

    @jax.jit
    def solves(key):
        state = estimator.update_curvature_matrix_estimate(
            estimator.init(), 0.0, 1.0, problem.batch_size, key, problem.func_args
        )
        grads = jax.grad(lambda p: problem.loss_fn(p, problem.batch))(problem.params)
        expected = estimator.multiply_inverse(state, grads, 0.1, exact_power=True)
        return state, grads, expected, [solve(estimator, state, grads, 0.1, s) for s in solvers]

    state, grads, expected, results = solves(getkey())
    for result in results:
        for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(expected), strict=True):
            _close(a, b)
    with pytest.raises(ValueError, match="solver"):
        solve(estimator, state, grads, 0.1, [lx.Cholesky()])
