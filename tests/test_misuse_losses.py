"""Misused loss registrations are named, for `Optimizer` and `kfac_optax` alike (issue 50): float
class labels, labels outside `[0, classes)` (masked ones allowed), a loss registered twice, and a
frozen parameter (no curvature needed, not a fallback)."""

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest

import eqx_kfac

_MODEL = eqx.nn.Linear(3, 4, key=jax.random.key(0))
_X = jnp.linspace(-1.0, 1.0, 24).reshape(8, 3)
_LABELS = jnp.arange(8) % 4
_PADDED = _LABELS.at[0].set(-1)
_KEEP = jnp.ones(8).at[0].set(0.0)  # the mask that drops the padded example


def _cross_entropy(model, batch):
    x, t = batch
    logits = eqx_kfac.register_softmax_cross_entropy_loss(jax.vmap(model)(x), t)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, t))


def _masked_cross_entropy(model, batch):
    x, t, keep = batch
    logits = eqx_kfac.register_softmax_cross_entropy_loss(jax.vmap(model)(x), t, mask=keep)
    safe = jnp.where(keep > 0, t, 0)
    return jnp.mean(keep * optax.softmax_cross_entropy_with_integer_labels(logits, safe))


def _optimizer(loss, **curvature):
    """`Optimizer` with scheduled coefficients, no burn-in and `CurvatureOptions(**curvature)`."""
    return eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(loss),
        step_rule=eqx_kfac.MomentumStep(
            eqx_kfac.ScheduledHyperparameter(lambda s: 0.1), eqx_kfac.ScheduledHyperparameter(lambda s: 0.0)
        ),
        damping_rule=eqx_kfac.ScheduledDamping(lambda s: 0.1),
        refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=0),
        curvature=eqx_kfac.CurvatureOptions(**curvature),
    )


def _build(path, loss, params, batch, **kwargs):
    """What each path checks when it is set up: `kfac_optax` at construction, `Optimizer` at
    `init`; returns the `kfac_optax` transformation or the `Optimizer` state. A new function
    each time: the estimators (and the reports made when one is built) are cached per function."""

    def fresh(p, b):
        return loss(p, b)

    if path == "kfac_optax":
        return eqx_kfac.kfac_optax(fresh, (params, batch), **kwargs)
    return _optimizer(fresh, **kwargs).init(params, jax.random.key(0), batch)


_PATHS = ("kfac_optax", "Optimizer")


@pytest.mark.parametrize("path", _PATHS)
def test_float_labels_name_the_loss_and_the_fix(path):
    floats = (_X, _LABELS.astype(jnp.float32))
    with pytest.raises(TypeError) as error:
        _build(path, _cross_entropy, _MODEL, floats)
    message = str(error.value)
    assert message.startswith("register_softmax_cross_entropy_loss: `targets` of shape (8,)")
    assert "must be integers" in message and "float32" in message
    assert "labels.astype(jnp.int32)" in message and "one-hot" in message


def test_float_labels_given_to_the_loss_class(monkeypatch):
    # The test-time jaxtyping checks would refuse the labels first: the user's error is tested.
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    with pytest.raises(TypeError, match=r"^CategoricalLogitsNegativeLogProbLoss: .* must be integers"):
        eqx_kfac.CategoricalLogitsNegativeLogProbLoss(_X, _LABELS.astype(jnp.float32))


@pytest.mark.parametrize("path", _PATHS)
@pytest.mark.parametrize("label", [-1, 4])
def test_labels_outside_the_classes_are_refused_alike(path, label):
    batch = (_X, _LABELS.at[0].set(label))
    refused = r"loss #0 \(a categorical loss\) has 1 labels outside \[0, classes\)"
    with pytest.raises(ValueError, match=refused):
        _build(path, _cross_entropy, _MODEL, batch)


@pytest.mark.parametrize("path", _PATHS)
def test_masked_examples_may_carry_any_label(path):
    _build(path, _masked_cross_entropy, _MODEL, (_X, _PADDED, _KEEP))
    logits = jax.vmap(_MODEL)(_X)
    loss = eqx_kfac.CategoricalLogitsNegativeLogProbLoss(logits, _PADDED, mask=_KEEP)
    labels = jnp.where(_KEEP > 0, _PADDED, 0)
    reference = _KEEP * optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    np.testing.assert_allclose(np.asarray(loss.evaluate()), np.asarray(reference), rtol=1e-6)
    (grad,) = loss.grad_of_evaluate()
    np.testing.assert_array_equal(np.asarray(grad[0]), 0.0)


def test_a_negative_label_is_nan_in_the_curvature_never_a_wrapped_class():
    logits = jax.vmap(_MODEL)(_X)
    loss = eqx_kfac.CategoricalLogitsNegativeLogProbLoss(logits, _PADDED)
    (grad,) = loss.grad_of_evaluate()
    assert np.isnan(np.asarray(loss.evaluate()[0])) and np.all(np.isnan(np.asarray(grad[0])))
    expected = jax.grad(lambda l: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(l, _LABELS)))(
        logits
    )
    np.testing.assert_allclose(np.asarray(grad[1:]), np.asarray(expected[1:]), rtol=1e-5)


def _factors_and_dropped(estimator_state):
    return jax.tree.leaves(estimator_state.block_states[0].factors), int(estimator_state.dropped_updates)


def _curvature_before_and_after_a_step(path, loss, batch):
    """The estimator states set up on valid labels and after one step on `batch`."""
    valid = (_X, _LABELS) + batch[2:]
    params = eqx.filter(_MODEL, eqx.is_inexact_array)
    if path == "kfac_optax":
        opt = eqx_kfac.kfac_optax(loss, (_MODEL, valid), estimation_mode="fisher_empirical")
        state = opt.init(params)
        grads = eqx.filter_grad(loss)(_MODEL, batch)
        _, new_state = opt.update(grads, state, params, batch=batch, key=jax.random.key(1))
        return state.inner_state[0].estimator_state, new_state.inner_state[0].estimator_state
    opt = _optimizer(loss, estimation_mode="fisher_empirical")
    state = opt.init(_MODEL, jax.random.key(0), valid)
    _, new_state, stats = opt.step(_MODEL, state, jax.random.key(1), batch=batch)
    assert bool(stats["curvature_update_dropped"]) == (int(new_state.estimator_state.dropped_updates) == 1)
    return state.estimator_state, new_state.estimator_state


@pytest.mark.parametrize("path", _PATHS)
@pytest.mark.parametrize(
    ("loss", "batch", "folded_in"),
    [(_cross_entropy, (_X, _PADDED), False), (_masked_cross_entropy, (_X, _PADDED, _KEEP), True)],
    ids=["unmasked", "masked"],
)
def test_a_step_with_a_negative_label(path, loss, batch, folded_in):
    # In a step, a -1 label that is not masked out skips the step (tests/test_invalid_targets.py),
    # so the batch is not folded in (it was, with the example's gradient silently zero), nor
    # counted as a dropped update; a masked one is folded in.
    before, after = _curvature_before_and_after_a_step(path, loss, batch)
    (old, _), (new, dropped) = _factors_and_dropped(before), _factors_and_dropped(after)
    unchanged = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(old, new))
    assert (dropped, unchanged) == (0, not folded_in)


def _two_heads(model, batch):
    # A cross-entropy on the logits plus a squared-error penalty on the same logits.
    x, t = batch
    logits = jax.vmap(model)(x)
    eqx_kfac.register_softmax_cross_entropy_loss(logits, t)
    eqx_kfac.register_squared_error_loss(logits, jnp.zeros_like(logits), weight=0.01)
    penalty = 0.01 * jnp.mean(jnp.sum(logits**2, axis=-1))
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, t)) + penalty


def _twice_chained(model, batch):
    x, t = batch
    logits = eqx_kfac.register_softmax_cross_entropy_loss(jax.vmap(model)(x), t)
    logits = eqx_kfac.register_softmax_cross_entropy_loss(logits, t)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, t))


def _messages(path, loss, params, batch, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _build(path, loss, params, batch, **kwargs)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("path", _PATHS)
def test_two_different_losses_on_one_tensor_do_not_warn(path):
    assert not [m for m in _messages(path, _two_heads, _MODEL, (_X, _LABELS)) if "registered already" in m]


def test_the_same_loss_registered_twice_warns_also_when_chained():
    (message,) = [m for m in _messages("kfac_optax", _twice_chained, _MODEL, (_X, _LABELS)) if "already" in m]
    assert re.search(r"loss #1 \(CategoricalLogitsNegativeLogProbLoss\) were registered already by the "
                     r"same loss \(registered loss #0 .*counts twice", message)


def _frozen_offset(params, batch):
    x, t = batch
    logits = jax.vmap(params["linear"])(x) + jax.lax.stop_gradient(params["offset"])
    logits = eqx_kfac.register_softmax_cross_entropy_loss(logits, t)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, t))


@pytest.mark.parametrize("path", _PATHS)
def test_a_frozen_parameter_is_reported_as_frozen_not_as_a_fallback(path):
    params = {"linear": _MODEL, "offset": jnp.ones(4)}
    # No fallback, so `on_unmatched="error"` does not raise; the report says what happened.
    (message,) = _messages(path, _frozen_offset, params, (_X, _LABELS), on_unmatched="error")
    assert "fall back" not in message
    assert (
        "1 parameter(s) are not reached by the registered losses (frozen or unused): they need no "
        "curvature" in message
    )
    assert (
        "`['offset']` (unused): it is frozen: the registered losses reach it only through "
        "`jax.lax.stop_gradient`" in message
    )
    args = (params, (_X, _LABELS))
    registrations = eqx_kfac.BlockDiagonalCurvature(_frozen_offset, args, on_unmatched="ignore").registrations()
    assert registrations["['offset']"].origin == "unused"
    assert "(origin `unused`: the registered losses do not depend on the parameter, which is frozen" in str(
        registrations
    )


def test_a_parameter_the_loss_does_not_reach_is_no_fallback_either():
    params = {"linear": _MODEL, "extra": jnp.ones(3)}

    def loss(p, batch):
        return _cross_entropy(p["linear"], batch) + 1e-3 * jnp.sum(p["extra"] ** 2)

    (message,) = _messages("kfac_optax", loss, params, (_X, _LABELS), on_unmatched="error")
    assert message.startswith("eqx_kfac: 1 parameter(s) are not reached by the registered losses")
    assert "`['extra']` (unused): the registered losses do not depend on it" in message
