"""Runs the examples of `docs/flax_haiku.md` and checks what the page says of them."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from doc_pages import DOCS, run_page

pytestmark = pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)


@pytest.fixture(scope="module")
def page():
    """The namespace after executing every Python block of the page, in order."""
    return run_page("flax_haiku.md", blocks=5)


def test_linen_registrations_are_the_pages(page):
    # The optimizer was built with on_unmatched="error": no parameter fell back to a generic block.
    (printed,) = re.findall(r"```text\n(.*?)\n```", (DOCS / "flax_haiku.md").read_text(), flags=re.DOTALL)
    estimator = page["optimizer"].estimators((page["params"], page["batch_stats"], page["batch"]))[0]
    assert str(estimator.registrations()) == printed


def test_linen_trains(page):
    assert float(page["stats"]["loss"]) < 0.5 * float(page["first_loss"])


def test_nnx_trains(page):
    # kfac_optax's norm constraint (0.1) bounds its first steps.
    assert float(page["loss"]) < 0.8 * float(page["nnx_first_loss"])


def test_nnx_batch_norm_trains_with_structured_blocks(page):
    assert float(page["bn_step_stats"]["loss"]) < 0.5 * float(page["bn_first_loss"])
    estimator = page["bn_optimizer"].estimators((page["bn_params"], page["bn_stats"], page["batch"]))[0]
    assert {r.tag for r in estimator.registrations().values()} == {"conv2d", "scale_and_shift", "dense"}


def test_nnx_batch_norm_statistics_are_the_models(page):
    # One more step: the statistics it returns are those NNX's own forward pass writes at the
    # parameters and statistics it was given, moved off their initial zeros and ones.
    params, stats, batch = page["bn_params"], page["bn_stats"], page["batch"]
    _, _, new_stats, _ = page["bn_optimizer"].step(
        params, page["bn_state"], jax.random.key(9), batch=batch, func_state=stats
    )
    expected = page["bn_loss"](params, stats, batch)[1]
    np.testing.assert_allclose(new_stats["batch_norm"]["mean"][...], expected["batch_norm"]["mean"][...], rtol=1e-5)
    np.testing.assert_allclose(new_stats["batch_norm"]["var"][...], expected["batch_norm"]["var"][...], rtol=1e-5)
    assert np.abs(np.asarray(stats["batch_norm"]["mean"][...])).min() > 0
    assert np.abs(np.asarray(stats["batch_norm"]["var"][...]) - 1).min() > 0


def test_nnx_optimizer_with_dropout_trains(page):
    # kfac_optax was built with on_unmatched="error": both Linear layers have Kronecker blocks.
    model = page["dropout_model"]
    params, rngs = nnx.state(model, nnx.Param), nnx.state(model, nnx.RngState)
    # Every step drew a new dropout mask: the stream's count moved once per step.
    assert int(rngs["dropout"]["rngs"]["count"][...]) == 5
    assert int(page["dropout_optimizer"].step[...]) == 5
    final_loss = page["dropout_loss"](params, rngs, page["batch"])[0]
    assert float(final_loss) < 0.9 * float(page["dropout_first_loss"])


def test_haiku_trains(page):
    assert float(page["hk_stats"]["loss"]) < 0.5 * float(page["hk_first_loss"])
