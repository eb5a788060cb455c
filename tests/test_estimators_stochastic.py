"""The sampled estimation modes are unbiased estimators of the exact Fisher / GGN blocks.

Each check averages `n` independent one-batch estimates (one key each) and compares with the exact
estimate. The tolerance comes from the estimates themselves: every entry of the mean must lie
within 5 empirical standard errors (`std / sqrt(n)`) of the exact value, and the error must shrink
with `n` (the Frobenius error of the mean of 2000 estimates is below the average error of means
of 500, whose expected ratio is `sqrt(500 / 2000) = 0.5`).
"""

import equinox as eqx
import jax
import numpy as np
import pytest

from eqx_kfac import DenseFull, NaiveFull
from eqx_kfac import BlockDiagonalCurvature, ExplicitExactCurvature

from models import two_losses

NUM_KEYS = 2000
GROUPS = 4


def _estimates(estimator, problem, mode, keys):
    @eqx.filter_jit
    def run(estimator, func_args, keys):
        state0 = estimator.init()

        def one(key):
            state = estimator.update_curvature_matrix_estimate(
                state0, 0.0, 1.0, problem.batch_size, key, func_args, mode
            )
            return estimator.to_dense_matrix(state)

        return jax.lax.map(one, keys, batch_size=500)

    return np.asarray(run(estimator, problem.func_args, keys))


def _check_unbiased(samples, exact):
    n = samples.shape[0]
    mean = samples.mean(axis=0)
    standard_error = samples.std(axis=0, ddof=1) / np.sqrt(n)
    error = np.abs(mean - exact)
    scale = np.abs(exact).max()
    assert np.all(error <= 5 * standard_error + 1e-12 * scale), np.max(
        error / (standard_error + 1e-300)
    )
    error_all = np.linalg.norm(mean - exact)
    error_groups = np.mean(
        [np.linalg.norm(g.mean(axis=0) - exact) for g in np.split(samples, GROUPS)]
    )
    assert error_all < error_groups


@pytest.mark.parametrize("mode", ["fisher_gradients", "fisher_curvature_prop", "ggn_curvature_prop"])
def test_block_diagonal_modes_are_unbiased(mode, getkey):
    problem = two_losses(getkey(), batch=3)
    estimator = BlockDiagonalCurvature(
        problem.loss_fn, problem.func_args, layer_tag_to_block_ctor={"dense": DenseFull, "generic": NaiveFull}
    )
    exact_mode = "fisher_exact" if mode.startswith("fisher") else "ggn_exact"
    exact = _estimates(estimator, problem, exact_mode, jax.random.split(getkey(), 1))[0]
    samples = _estimates(estimator, problem, mode, jax.random.split(getkey(), NUM_KEYS))
    _check_unbiased(samples, exact)


def test_explicit_exact_sampled_mode_is_unbiased(getkey):
    problem = two_losses(getkey(), batch=3)
    estimator = ExplicitExactCurvature(problem.loss_fn, problem.func_args)
    exact = _estimates(estimator, problem, "fisher_exact", jax.random.split(getkey(), 1))[0]
    samples = _estimates(estimator, problem, "fisher_gradients", jax.random.split(getkey(), NUM_KEYS))
    _check_unbiased(samples, exact)
