"""Runs the example of `docs/extending.md` and checks what the page claims about it."""

import jax
import numpy as np
import pytest

import eqx_kfac

from doc_pages import run_page

pytestmark = pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)


@pytest.fixture(scope="module")
def page():
    """The namespace after executing every Python block of the page, in order."""
    return run_page("extending.md", blocks=8)


def test_pattern_registers_the_layer_with_the_new_block(page):
    registration = page["estimator"].registrations()["gain.log_gain"]
    assert registration == ("gain", "GainDiagonal", "gain", "")


def test_block_is_the_exact_ggn_diagonal(page):
    estimator, state, block = page["estimator"], page["state"], page["gain_block"]
    model, batch, loss_fn = page["model"], page["batch"], page["loss_fn"]
    exact = eqx_kfac.ExplicitExactCurvature(
        loss_fn, (model, batch), default_estimation_mode="ggn_exact"
    )
    exact_state = exact.update_curvature_matrix_estimate(
        exact.init(), 0.0, 1.0, 8, jax.random.key(0), (model, batch)
    )
    dense = np.asarray(exact.to_dense_matrix(exact_state))
    sizes = [int(np.prod(s)) for s in estimator.param_shapes]
    (index,) = block.spec.param_indices
    start = sum(sizes[:index])
    positions = np.arange(start, start + sizes[index])
    np.testing.assert_allclose(
        np.asarray(block.to_dense_matrix(state.block_states[estimator.blocks.index(block)])),
        np.diag(np.diag(dense)[positions]),
        rtol=1e-8,
        atol=1e-12,
    )


def test_optimizer_trains_with_the_extension(page):
    loss_fn, batch = page["loss_fn"], page["batch"]
    assert float(loss_fn(page["trained"], batch)) < 0.3 * float(loss_fn(page["model"], batch))
