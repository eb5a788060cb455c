"""A batch with a class label outside `[0, classes)` on an example the categorical loss does not
mask out is skipped like a non-finite step, on both paths (issue 50): the user's loss wraps -1 to
the last class (and clamps `classes` to it), its gradient is finite, and the step used to update
the parameters and (`fisher_gradients` samples its targets) the curvature statistics. A tiny
MLP, a few steps each."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_kfac


MODEL = eqx.nn.MLP(4, 3, 8, 1, key=jax.random.key(0))
PARAMS = eqx.filter(MODEL, eqx.is_inexact_array)
X = jax.random.normal(jax.random.key(1), (16, 4))
Y = jnp.argmax(X[:, :3], axis=1)
ALL = jnp.ones(16)
GOOD = (X, Y, ALL)
# Batches of one structure and shape (x, labels, mask), so that each path compiles once.
BAD = {"minus_one": (X, Y.at[0].set(-1), ALL), "classes": (X, Y.at[0].set(3), ALL)}
MASKED = (X, Y.at[0].set(-1), ALL.at[0].set(0.0))  # the mask drops the -1
INVALID = "invalid labels"
KEY = jax.random.key(1)


def loss(model, batch):
    x, t, keep = batch
    logits = jax.vmap(model)(x)
    eqx_kfac.register_softmax_cross_entropy_loss(logits, t, mask=keep)
    # Indexing wraps -1 to the last class and clamps `classes` to it: a finite loss and gradient.
    picked = jax.nn.log_softmax(logits)[jnp.arange(t.shape[0]), t]
    return -jnp.mean(keep * picked)


VALUE_AND_GRAD = eqx.filter_jit(eqx.filter_value_and_grad(loss))
# inverse_update_period=2: the third step (counter 2) refreshes the cached inverses.
OPT = eqx_kfac.Optimizer(
    eqx.filter_value_and_grad(loss),
    refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=0, inverse_update_period=2),
    step_rule=eqx_kfac.MomentumStep(
        eqx_kfac.ScheduledHyperparameter(lambda s: 0.1), eqx_kfac.ScheduledHyperparameter(lambda s: 0.9)
    ),
    damping_rule=eqx_kfac.ScheduledDamping(lambda s: 0.1),
)
# stop_in_program: inside a user's jit, the twentieth fault in a row stops the run from the program.
KFAC_OPTAX = eqx_kfac.kfac_optax(loss, (MODEL, GOOD), inverse_update_period=2, stop_in_program=True)


def _same(a, b):
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(jnp.all(x == y)), a, b)))


def _kept(old, new):
    """`new` equals `old` but for the guard's counts."""
    return _same(eqx.tree_at(lambda s: s.guard_state, new, old.guard_state), old)


def _optimizer_step(params, state, batch, key):
    params, state, stats = OPT.step(params, state, key, batch=batch)
    return params, state, stats["skipped"], stats["invalid_targets"]


def _kfac_optax_step(params, state, batch, key):
    value, grads = VALUE_AND_GRAD(eqx.combine(params, MODEL), batch)
    updates, state = KFAC_OPTAX.update(grads, state, params, batch=batch, key=key, value=value)
    return eqx.apply_updates(params, updates), state


# Called directly, and inside a user's jit (compiled once: the key is an array argument).
OPTIMIZER_STEPS = {"direct": _optimizer_step, "in_jit": eqx.filter_jit(_optimizer_step)}
KFAC_OPTAX_STEPS = {"direct": _kfac_optax_step, "in_jit": eqx.filter_jit(_kfac_optax_step)}


@pytest.mark.parametrize("call", sorted(OPTIMIZER_STEPS))
def test_optimizer_skips_a_batch_with_an_invalid_label(call):
    step = OPTIMIZER_STEPS[call]
    params, state = MODEL, OPT.init(MODEL, jax.random.key(0), GOOD)
    for i in range(2):
        params, state, skipped, invalid = step(params, state, GOOD, jax.random.key(i))
        assert not bool(skipped) and not bool(invalid)
    for bad in BAD.values():
        new_params, new_state, skipped, invalid = step(params, state, bad, jax.random.key(2))
        assert bool(skipped) and bool(invalid)
        assert _same(new_params, params) and _kept(state, new_state)
        assert int(new_state.guard_state.consecutive_faults) == 1
        assert int(new_state.guard_state.total_skipped) == 1
    # The next good step proceeds from the state before the bad batch.
    after, after_state, skipped, invalid = step(new_params, new_state, GOOD, jax.random.key(3))
    assert not bool(skipped) and not bool(invalid) and not _same(after, params)
    assert int(after_state.step_counter) == 3 and int(after_state.guard_state.consecutive_faults) == 0
    assert not _same(after_state.estimator_state, state.estimator_state)


@pytest.mark.parametrize("call", sorted(KFAC_OPTAX_STEPS))
def test_kfac_optax_skips_a_batch_with_an_invalid_label(call):
    step = KFAC_OPTAX_STEPS[call]
    params, state = PARAMS, KFAC_OPTAX.init(PARAMS)
    for i in range(2):
        params, state = step(params, state, GOOD, jax.random.key(i))
    for bad in BAD.values():
        new_params, new_state = step(params, state, bad, jax.random.key(2))
        assert _same(new_params, params) and _kept(state, new_state)
        guard = new_state.guard_state
        assert (int(guard.total_skipped), int(guard.consecutive_faults), int(guard.steps)) == (1, 1, 3)
    after, after_state = step(new_params, new_state, GOOD, jax.random.key(3))
    assert not _same(after, params) and int(after_state.guard_state.consecutive_faults) == 0
    assert int(after_state.inner_state[0].count) == 3


def test_kfac_preconditioner_folds_no_invalid_label_into_its_statistics():
    precondition = eqx_kfac.kfac_preconditioner(loss, (MODEL, GOOD), damping=0.1)
    state = precondition.init(PARAMS)
    grads = eqx.filter_grad(loss)(MODEL, GOOD)
    _, state = precondition.update(grads, state, PARAMS, batch=GOOD, key=jax.random.key(0))
    for batch, kept in [(BAD["minus_one"], True), (GOOD, False)]:
        grads = eqx.filter_grad(loss)(MODEL, batch)
        _, new_state = precondition.update(grads, state, PARAMS, batch=batch, key=jax.random.key(1))
        assert _same(new_state.estimator_state, state.estimator_state) == kept


@pytest.mark.parametrize("path", ["Optimizer", "kfac_optax"])
def test_a_masked_invalid_label_is_not_skipped_an_unmasked_one_is(path):
    for batch, skip in [(MASKED, False), (BAD["minus_one"], True)]:
        if path == "Optimizer":
            state = OPT.init(MODEL, jax.random.key(0), GOOD)
            params, new_state, skipped, invalid = _optimizer_step(MODEL, state, batch, KEY)
            assert bool(skipped) == bool(invalid) == skip and _kept(state, new_state) == skip
        else:
            params, new_state = _kfac_optax_step(PARAMS, KFAC_OPTAX.init(PARAMS), batch, KEY)
            assert int(new_state.guard_state.total_skipped) == skip
        assert _same(params, MODEL if path == "Optimizer" else PARAMS) == skip


@pytest.mark.parametrize(
    ("path", "call"), [("Optimizer", "direct"), ("kfac_optax", "direct"), ("kfac_optax", "in_jit")]
)
def test_twenty_invalid_batches_in_a_row_stop_the_run_naming_invalid_labels(path, call):
    # Directly: a RuntimeError after the step; inside a user's jit, the guard's host callback
    # (`stop_in_program=True`).
    error = RuntimeError if call == "direct" else Exception
    if path == "Optimizer":
        params, state = MODEL, OPT.init(MODEL, jax.random.key(0), GOOD)
        step = lambda p, s, b, k: _optimizer_step(p, s, b, k)[:2]  # noqa: E731
    else:
        params, state = PARAMS, KFAC_OPTAX.init(PARAMS)
        step = KFAC_OPTAX_STEPS[call]
    for i in range(19):
        params, state = step(params, state, BAD["minus_one"], jax.random.key(i))
    assert int(state.guard_state.consecutive_faults) == 19
    with pytest.raises(error, match=INVALID):
        jax.block_until_ready(step(params, state, BAD["classes"], jax.random.key(19)))
