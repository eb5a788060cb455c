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
    spec = dense_spec(n_in, n_out, layout="out_in", stack=stack)
    block = cls(spec)
    key = jax.random.key(seed)
    state = block.update_curvature_matrix_estimate(
        block.init(), random_data(spec, key), 0.0, 1.0, 3
    )
    return block, state, random_vector(block, jax.random.fold_in(key, 1))


def _dense_solve(block, state, vector, damping):
    dense = np.asarray(block.to_dense_matrix(state))
    return np.linalg.solve(dense + damping * np.eye(dense.shape[0]), np.asarray(flat(vector)))


@jax.jit
def _solve_all(block, state, vector, damping):
    exact = {name: solve_block(block, state, vector, damping, s) for name, s in EXACT_SOLVERS.items()}
    pi = solve_block(block, state, vector, damping, eqx_kfac.KroneckerPiAdjustedSolver())
    own_exact = block.multiply_inverse(state, vector, damping, exact_power=True)
    own_approx = block.multiply_inverse(state, vector, damping, exact_power=False)
    return exact, pi, own_exact, own_approx


sizes = st.integers(min_value=1, max_value=3)
dampings = st.sampled_from([1e-2, 0.3, 2.0])


@settings(max_examples=4)
@given(seed=st.integers(0, 2**16), n_in=sizes, n_out=sizes, damping=dampings)
def test_solvers_agree_on_random_blocks(seed, n_in, n_out, damping):
    for cls in (eqx_kfac.DenseFull, eqx_kfac.DenseTwoKroneckerFactored):
        block, state, vector = _random_block(cls, seed, n_in, n_out)
        exact, pi, own_exact, own_approx = _solve_all(block, state, vector, damping)
        reference = _dense_solve(block, state, vector, damping)
        for name, result in exact.items():
            assert [r.shape for r in result] == [v.shape for v in vector], name
            _close(flat(result), reference)
        _close(flat(own_exact), reference)
        # Pi-adjusted damping is the blocks' approximate inverse (and exact for one factor).
        _close(flat(pi), flat(own_approx))
        if cls is eqx_kfac.DenseFull:
            _close(flat(pi), reference)


def test_operator_matches_dense_matrix():
    for cls in (eqx_kfac.DenseFull, eqx_kfac.DenseTwoKroneckerFactored, eqx_kfac.DenseDiagonal):
        block, state, vector = _random_block(cls, 3, 3, 2)
        operator = damped_block_operator(block, state, 0.5)
        dense = np.asarray(block.to_dense_matrix(state)) + 0.5 * np.eye(block.dim)
        if cls is eqx_kfac.DenseFull:
            _close(operator.as_matrix(), dense)
        elif cls is eqx_kfac.DenseTwoKroneckerFactored:
            # Same matrix up to the canonical ordering of the parameters.
            order = KroneckerLayout(block).canonical_order()
            _close(operator.as_matrix(), dense[np.ix_(order, order)])
        assert lx.is_positive_semidefinite(operator)


def test_other_blocks_use_their_linear_operator():
    block, state, vector = _random_block(eqx_kfac.DenseDiagonal, 5, 3, 2)
    for solver in (None, lx.CG(rtol=1e-13, atol=1e-13)):
        _close(flat(solve_block(block, state, vector, 0.1, solver)), _dense_solve(block, state, vector, 0.1))


def test_stacked_blocks():
    block, state, vector = _random_block(eqx_kfac.DenseTwoKroneckerFactored, 7, 2, 3, stack=3)
    expected = _dense_solve(block, state, vector, 0.2)
    for solver in (None, lx.CG(rtol=1e-13, atol=1e-13)):
        result = eqx.filter_jit(solve_block)(block, state, vector, 0.2, solver)
        _close(flat(result), expected)
    with pytest.raises(ValueError, match="stacked"):
        damped_block_operator(block, state, 0.2)


def test_estimator_solve_with_solver_per_block(getkey):
    problem = mlp_regression(getkey())
    estimator = eqx_kfac.BlockDiagonalCurvature(
        problem.loss_fn, problem.func_args, default_estimation_mode="ggn_exact"
    )
    state = estimator.update_curvature_matrix_estimate(
        estimator.init(), 0.0, 1.0, problem.batch_size, getkey(), problem.func_args
    )
    grads = jax.grad(lambda p: problem.loss_fn(p, problem.batch))(problem.params)
    expected = estimator.multiply_inverse(state, grads, 0.1, exact_power=True)

    def choose(block):
        return lx.CG(rtol=1e-13, atol=1e-13) if block.dim > 10 else lx.Cholesky()

    for solver in (None, choose, [eqx_kfac.KroneckerEigenSolver()] * estimator.num_blocks):
        result = jax.jit(lambda s, g: solve(estimator, s, g, 0.1, solver))(state, grads)
        for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(expected), strict=True):
            _close(a, b)
    with pytest.raises(ValueError, match="solver"):
        solve(estimator, state, grads, 0.1, [lx.Cholesky()])
