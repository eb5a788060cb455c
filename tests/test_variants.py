"""Runs the research variants of `docs/variants.md` and checks what the page says of them (their
references on both paths are in `test_parts_both_paths.py`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_kfac

from doc_pages import run_page

pytestmark = pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)


@pytest.fixture(scope="module")
def page():
    """The namespace after executing every Python block of the page, in order."""
    return run_page("variants.md", blocks=9)


def _losses(history):
    return np.array([float(s["loss"]) for s in history])


def test_trust_region_damping_follows_rho_at_every_step(page):
    history = page["trust_region_history"]
    for before, after in zip(history, history[1:]):
        rho, damping = float(before["rho"]), float(before["damping"])
        factor = 4.0 if rho < 0.25 else 0.5 if rho > 0.75 else 1.0
        np.testing.assert_allclose(float(after["damping"]), np.clip(damping * factor, 1e-6, 1e3), rtol=1e-12)
    assert len({float(s["damping"]) for s in history}) > 1


def test_every_variant_trains_on_both_paths(page):
    for name in ("trust_region_history", "nesterov_history", "layerwise_history", "soap_history"):
        losses = _losses(page[name])
        assert losses[-1] < 0.7 * losses[0], name
    for name in ("nesterov_optax_losses", "layerwise_optax_losses", "soap_optax_losses", "kfac_muon_losses"):
        losses = np.array([float(v) for v in page[name]])
        assert losses[-1] < 0.7 * losses[0], name


def test_the_soap_state_counts_the_applied_steps(page):
    state, history = page["soap_state"], page["soap_history"]
    applied = sum(not bool(s["skipped"]) and not bool(s["rejected"]) for s in history)
    assert int(state.direction_state.count) == applied == len(history)
    assert isinstance(state.direction_state, eqx_kfac.EigenbasisAdamState)


def test_kfac_muon_keeps_its_momentum_in_its_state(page):
    state = page["kfac_muon_state"].inner_state[0].direction_state
    assert isinstance(state, eqx_kfac.KroneckerMuonState) and int(state.count) == len(page["kfac_muon_losses"])


def test_nesterov_step_looks_ahead_along_the_momentum(page):
    # From zero velocity the first update is (1 + m) times MomentumStep's, with the same
    # EK-FAC direction; the kept velocity is MomentumStep's update.
    nesterov, model = page["nesterov"], page["model"]
    plain = eqx.tree_at(lambda o: o.step_rule, nesterov, eqx_kfac.MomentumStep())
    kwargs = dict(learning_rate=0.1, momentum=0.9, damping=0.1)
    p_nesterov, s_nesterov, _ = page["train"](nesterov, steps=1, **kwargs)
    p_plain, s_plain, _ = page["train"](plain, steps=1, **kwargs)
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))])  # noqa: E731
    step_nesterov, step_plain = flat(p_nesterov) - flat(model), flat(p_plain) - flat(model)
    np.testing.assert_allclose(step_nesterov, 1.9 * step_plain, rtol=1e-8, atol=1e-14)
    np.testing.assert_allclose(flat(s_nesterov.velocities), step_plain, rtol=1e-8, atol=1e-14)
    assert {type(b).__name__ for b in nesterov.estimators((model, page["batch"]))[0].blocks} == {"DenseEigenbasisKFAC"}


def test_layerwise_damping_solves_each_block_with_its_own_damping(page):
    optimizer, model, batch, loss_fn = page["layerwise"], page["model"], page["batch"], page["loss_fn"]
    params, state, history = page["train"](optimizer, steps=1)
    stats = history[0]
    weights = np.asarray(stats["block_dampings"])
    # Damping proportional to the blocks' gradient norms, averaging to the step's damping.
    np.testing.assert_allclose(weights.mean(), float(stats["damping"]), rtol=1e-12)
    estimator, _ = optimizer.estimators((model, batch))
    # The gradient and the blocks' dense matrices each in one compiled program, the step in NumPy
    # (eagerly, every operation was compiled on its own: the test compiled 78 programs, now 25).
    grads = estimator.params_vector_to_blocks_vectors(
        eqx.filter(eqx.filter_jit(eqx.filter_grad(loss_fn))(model, batch), eqx.is_inexact_array)
    )
    norms = np.array([np.linalg.norm(np.concatenate([np.ravel(x) for x in g])) for g in grads])
    np.testing.assert_allclose(weights, float(stats["damping"]) * norms / norms.mean(), rtol=1e-10)
    # The first update is -lr times the direction (zero velocity); per block it is the exact
    # damped solve with the block's own damping, from the curvature the step used.
    delta = estimator.params_vector_to_blocks_vectors(jax.tree.map(
        lambda a, b: jnp.asarray(np.asarray(a) - np.asarray(b)),
        eqx.filter(params, eqx.is_inexact_array), eqx.filter(model, eqx.is_inexact_array),
    ))
    denses = eqx.filter_jit(lambda states: [b.to_dense_matrix(s) for b, s in zip(estimator.blocks, states)])(
        state.estimator_state.block_states
    )
    for dense, g, d, w in zip(denses, grads, delta, weights):
        dense = np.asarray(dense)
        g = np.concatenate([np.ravel(x) for x in g])
        expected = np.linalg.solve(dense + w * np.eye(len(g)), g)
        got = -np.concatenate([np.ravel(x) for x in d]) / float(stats["learning_rate"])
        np.testing.assert_allclose(got, expected, rtol=1e-7, atol=1e-12 * np.abs(expected).max())
