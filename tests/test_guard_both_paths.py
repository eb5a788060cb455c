"""The step guard on both paths (issue 50): `kfac_optax` skips a step whose loss is not finite,
rejects one that raises the loss (with `use_step_rejection`) and lets the run go on, counts them
in its state, and stops with a message that names the first faulty step and says what was
protected; misuse of `kfac_optax` raises clear errors. A tiny float32 MLP, a few steps each."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_kfac


MODEL = eqx.nn.MLP(4, 3, 8, 1, key=jax.random.key(0), dtype=jnp.float32)
X = jax.random.normal(jax.random.key(1), (16, 4), jnp.float32)
Y = jnp.argmax(X[:, :3], axis=1)
BATCH = (X, Y)
# Labels outside the classes: the loss is NaN (an out-of-range gather fills with NaN) while the
# gradient is finite (its scatter drops them).
BAD_LABELS = (X, Y + 7)
NAN_BATCH = (X.at[0, 0].set(jnp.nan), Y)


def per_example(model, batch):
    logits = jax.vmap(model)(batch[0])
    eqx_kfac.register_softmax_cross_entropy_loss(logits, batch[1])
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), batch[1][:, None], axis=1)[:, 0]


def loss(model, batch):
    return jnp.mean(per_example(model, batch))


VALUE_AND_GRAD = eqx.filter_jit(eqx.filter_value_and_grad(loss))
# The learning rate is 1e30 at the second update (count 1), 0.1 elsewhere.
SPIKE = eqx_kfac.kfac_optax(loss, (MODEL, BATCH), lambda count: jnp.where(count == 1, 1e30, 0.1),
                            use_step_rejection=True, max_consecutive_faults=2)
PLAIN = eqx_kfac.kfac_optax(loss, (MODEL, BATCH), max_consecutive_faults=2)


def _run(optimizer, batches, params=None, state=None):
    """Steps of `optimizer` on `batches` (the loss and gradient at the current parameters);
    the parameters, state and losses."""
    params = eqx.filter(MODEL, eqx.is_inexact_array) if params is None else params
    state = optimizer.init(params) if state is None else state
    losses = []
    for i, batch in enumerate(batches):
        value, grads = VALUE_AND_GRAD(eqx.combine(params, MODEL), batch)
        updates, state = optimizer.update(grads, state, params, batch=batch, key=jax.random.key(i))
        params = eqx.apply_updates(params, updates)
        losses.append(float(value))
    return params, state, losses


def _same(a, b):
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(jnp.all(x == y)), a, b)))


def test_a_learning_rate_of_1e30_is_rejected_and_the_run_goes_on():
    params, before, losses = _run(SPIKE, [BATCH])
    same_params, after, _ = _run(SPIKE, [BATCH], params, before)
    # Rejected: parameters and momentum kept, the schedule's count moved past the spike.
    assert _same(same_params, params) and _same(after.inner_state[1], before.inner_state[1])
    assert int(after.inner_state[2].count) == int(before.inner_state[2].count) + 1 == 2
    params, state, _ = _run(SPIKE, [BATCH] * 4, same_params, after)
    guard = state.guard_state
    assert int(guard.total_rejected) == 1 and int(guard.total_skipped) == 0
    assert int(guard.fault_start) == 1 and int(guard.consecutive_faults) == 0
    final = float(loss(eqx.combine(params, MODEL), BATCH))
    assert np.isfinite(final) and final < losses[0]


def test_a_nan_loss_with_a_finite_gradient_is_skipped():
    value, grads = VALUE_AND_GRAD(MODEL, BAD_LABELS)
    assert not np.isfinite(float(value))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    params, state, _ = _run(PLAIN, [BATCH])
    new_params, new_state, _ = _run(PLAIN, [BAD_LABELS], params, state)
    assert _same(new_params, params)
    assert _same(new_state.inner_state, state.inner_state)
    assert int(new_state.guard_state.total_skipped) == 1
    assert int(new_state.guard_state.consecutive_faults) == 1


def test_the_stop_names_the_first_bad_step_and_what_was_protected():
    # Without step rejection, the message does not claim that the parameters are intact.
    with pytest.raises(RuntimeError) as plain:
        _run(PLAIN, [BATCH, BATCH, BAD_LABELS, NAN_BATCH])
    assert "the first of them was step 2" in str(plain.value)
    assert "Step rejection is off" in str(plain.value) and "may have been damaged" in str(plain.value)
    # With it: the spike (step 1) is a run of one fault; the stop names step 3.
    with pytest.raises(RuntimeError) as rejecting:
        _run(SPIKE, [BATCH, BATCH, BATCH, NAN_BATCH, BAD_LABELS])
    assert "the first of them was step 3" in str(rejecting.value)
    assert "did not rise (step rejection)" in str(rejecting.value)


def test_optimizer_names_the_first_bad_step_too():
    opt = eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(loss), refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=0),
        guard=eqx_kfac.StepGuard(reject_loss_increase=True, max_consecutive_faults=2),
    )
    state = opt.init(MODEL, jax.random.key(0), BATCH)
    params = MODEL
    params, state, stats = opt.step(params, state, jax.random.key(1), batch=BATCH)
    _, state, stats = opt.step(params, state, jax.random.key(2), batch=BAD_LABELS)
    assert bool(stats["skipped"]) and int(state.guard_state.total_skipped) == 1
    with pytest.raises(RuntimeError, match="the first of them was step 1"):
        opt.step(params, state, jax.random.key(3), batch=NAN_BATCH)


def test_a_per_example_loss_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"must return a scalar(.|\n)*returns \(16,\)(.|\n)*jnp.mean"):
        eqx_kfac.kfac_optax(per_example, (MODEL, BATCH))


def test_a_state_restored_without_a_template_is_refused():
    params = eqx.filter(MODEL, eqx.is_inexact_array)
    state = PLAIN.init(params)
    as_dicts = {"inner_state": state.inner_state, "guard_state": {"steps": 0}}
    grads = jax.tree.map(jnp.zeros_like, params)
    with pytest.raises(TypeError, match=r"restored without a template(.|\n)*optimizer.init\(params\)"):
        PLAIN.update(grads, as_dicts, params, batch=BATCH, key=jax.random.key(0))


class _Unreadable:
    """A count whose reading fails (it would wait for the step that computes it)."""

    def __int__(self):
        raise AssertionError("read")


def test_check_reads_no_count_without_a_limit():
    """Without limits (kfac-jax's defaults) `check` reads nothing, so a directly called step
    never waits for its program; with one, it reads that count."""
    state = eqx_kfac.StepGuard().init()
    unread = eqx.tree_at(lambda s: (s.consecutive_faults, s.consecutive_stalls), state,
                         (_Unreadable(), _Unreadable()), is_leaf=lambda x: x is None)
    eqx_kfac.StepGuard(max_consecutive_faults=None, max_consecutive_stalls=None).check(unread)
    with pytest.raises(AssertionError, match="read"):
        eqx_kfac.StepGuard(max_consecutive_faults=3, max_consecutive_stalls=None).check(unread)
