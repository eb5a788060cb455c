"""Runs the warm-start examples of `docs/seconds.md` (`Optimizer`'s and `OptaxTraining`'s) and checks what
the page says of them."""

import jax.numpy as jnp
import numpy as np
import pytest

import eqx_kfac
from doc_pages import run_page

pytestmark = pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)


@pytest.fixture(scope="module")
def page():
    """The namespace after executing the page's Python block."""
    return run_page("seconds.md", blocks=2)


def test_twelve_warm_steps_then_kfacs(page):
    assert page["kinds"] == ["warm"] * 12 + ["kfac"] * 18
    state = page["state"]
    assert int(state.step_counter) == 18 and int(state.warm_start_state.steps_taken) == 12
    # The last num_burnin_steps (default 10) warm steps made the burn-in's updates.
    assert int(state.warm_start_state.burnin_updates) == 10
    assert np.isfinite(float(page["stats"]["loss"]))


def test_twelve_adam_steps_then_kfac_optaxs(page):
    assert page["switched"] == [False] * 12 + [True] * 18
    state = page["training_state"]
    assert int(state.warm_start_state.steps_taken) == 12
    # `kfac_optax`'s own count: its 18 steps, none skipped.
    assert int(state.opt_state.inner_state[0].count) == 18
    assert np.isfinite(float(page["loss"]))


def test_the_default_transformation_is_adam_at_1e_3():
    transformation = eqx_kfac.WarmStart(3).transformation
    grads = {"w": jnp.array([2.0, -0.5, 1e-3])}
    updates, _ = transformation.update(grads, transformation.init(grads), grads)
    # Adam's first update is -lr * g / (|g| + eps): -1e-3 times the sign, nearly.
    np.testing.assert_allclose(updates["w"], -1e-3 * np.sign(grads["w"]), rtol=1e-4)
