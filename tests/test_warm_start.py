"""`WarmStart`: a directly called `Optimizer.step` takes first-order steps while its K-FAC
programs compile in threads, then K-FAC's steps (issue 48, "Compilation hidden behind training").

References: the warm steps against the optax transformation applied by hand; the burn-in's
updates against the estimator's own update at the parameters and keys of each warm step; the
K-FAC step after the switch against an optimizer without a warm start given the same state.
"""

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_kfac
from eqx_kfac._optim.refresh import burnin_keys

GIVEN = dict(learning_rate=0.1, momentum=0.5, damping=1e-2)


def _loss(model, batch):
    x, y = batch
    logits = jax.vmap(model)(x)
    eqx_kfac.register_softmax_cross_entropy_loss(logits, y)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [(jnp.asarray(rng.normal(size=(16, 5))), jnp.asarray(rng.integers(0, 3, 16))) for _ in range(n)]


def _optimizer(warm_start, burnin=2, loss=_loss, **kwargs):
    return eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(loss), step_rule=eqx_kfac.MomentumStep(), damping_rule=eqx_kfac.GivenDamping(),
        refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=burnin, inverse_update_period=1),
        warm_start=warm_start, **kwargs,
    )


def _arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


# One layer (`depth=0`): what is checked here is the warm start's course and its references, the
# same for any number of layers, and each program compiles about a third faster than with two.
PARAMS = eqx.nn.MLP(5, 3, 8, 0, key=jax.random.key(0))
KEYS = [jax.random.key(100 + i) for i in range(10)]
# The tests whose checks do not need programs of their own share one warm start and burn-in (equal
# optimizers share their compiled programs): more warm steps than burn-in updates, so the burn-in
# takes the last warm batches. (Those that count compilations or wait for one build their own.)
ADAM = optax.adam(3e-2)
WARM_STEPS, BURNIN = 4, 3


def _shared(steps=WARM_STEPS):
    return _optimizer(eqx_kfac.WarmStart(steps, ADAM), BURNIN)


# The references, compiled (one program each instead of one per operation).
@eqx.filter_jit
def _reference_step(params, opt_state, batch):
    """A step of `ADAM` applied by hand: the loss, the new parameters and ADAM's state."""
    loss, grads = eqx.filter_value_and_grad(_loss)(params, batch)
    updates, opt_state = ADAM.update(grads, opt_state, eqx.filter(params, eqx.is_inexact_array))
    return loss, eqx.apply_updates(params, updates), opt_state


@eqx.filter_jit
def _burnin_update(estimator, curvature, key, params, batch):
    """One burn-in update of the estimator's state: weight 1, 16 examples."""
    return estimator.update_curvature_matrix_estimate(curvature, 1.0, 1.0, 16, key, (params, batch))


# Both sides of the burn-in's split: more warm steps than burn-in updates (the burn-in on the last
# warm batches), and fewer (the rest of the burn-in at the switch).
@pytest.mark.parametrize("steps", [WARM_STEPS, 1])
def test_warm_steps_are_the_transformation_and_burn_in_on_their_batches(steps):
    burnin = BURNIN
    optimizer = _shared(steps)
    batches = _batches(steps + 2)
    state0 = optimizer.init(PARAMS, jax.random.key(1), batches[0])
    params, state = PARAMS, state0
    # The reference: optax by hand; the burn-in's updates on the last `burnin` warm batches, at
    # the parameters before each warm step, with that step's keys.
    ref_params, ref_opt = PARAMS, ADAM.init(eqx.filter(PARAMS, eqx.is_inexact_array))
    estimator = optimizer.estimators((PARAMS, batches[0]))[0]
    ref_curvature = state0.estimator_state
    for i in range(steps):
        params, state, stats = optimizer.step(params, state, KEYS[i], batch=batches[i], **GIVEN)
        assert set(stats) == {"loss", "step", "warm_start_step", "batch_size", "data_seen", "skipped"}
        assert int(stats["warm_start_step"]) == i + 1 and int(state.step_counter) == 0
        made = i - max(steps - burnin, 0)
        if made >= 0:
            key = burnin_keys(KEYS[i], burnin)[made]
            ref_curvature = _burnin_update(estimator, ref_curvature, key, ref_params, batches[i])
        loss, ref_params, ref_opt = _reference_step(ref_params, ref_opt, batches[i])
        np.testing.assert_allclose(stats["loss"], loss, rtol=1e-12)
    for got, want in zip(_arrays(params), _arrays(ref_params)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-14)
    for got, want in zip(_arrays(state.estimator_state), _arrays(ref_curvature)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-14)
    assert int(state.warm_start_state.burnin_updates) == min(steps, burnin)
    assert float(state.data_seen) == 16 * steps
    # The switch: K-FAC's first step, the rest of the burn-in repeating its own batch (`batch=`),
    # as an optimizer without a warm start makes it from this state.
    plain = _optimizer(None, burnin)
    rest = burnin - min(steps, burnin)
    expected_state = state
    for made in range(rest):
        key = burnin_keys(KEYS[steps], burnin)[min(steps, burnin) + made]
        expected_state = eqx.tree_at(
            lambda s: s.estimator_state, expected_state,
            _burnin_update(estimator, expected_state.estimator_state, key, params, batches[steps]),
        )
    stepped = eqx.tree_at(lambda s: s.step_counter, expected_state, jnp.ones((), jnp.int32))  # no burn-in there
    expected = plain.step(params, eqx.tree_at(lambda s: s.warm_start_state, stepped, None), KEYS[steps],
                          batch=batches[steps], **GIVEN)
    got = optimizer.step(params, state, KEYS[steps], batch=batches[steps], **GIVEN)
    assert int(got[1].step_counter) == 1 and "rho" in got[2]
    for g, w in zip(_arrays(got[0]), _arrays(expected[0])):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-14)


def test_the_kfac_programs_compile_once_in_the_background():
    compiled = []

    def listener(event, seconds, fun_name="", **kwargs):
        if event.endswith("backend_compile_duration"):
            compiled.append(fun_name)

    optimizer = _optimizer(eqx_kfac.WarmStart(3), loss=lambda m, b: _loss(m, b))  # compiles anew
    batches = _batches(6)
    params, state = PARAMS, optimizer.init(PARAMS, jax.random.key(1), batches[0])
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for i in range(6):
            params, state, stats = optimizer.step(params, state, KEYS[i], batch=batches[i], **GIVEN)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert int(state.step_counter) == 3 and int(state.warm_start_state.steps_taken) == 3
    assert compiled.count("jit(_jitted_step)") == 1
    assert compiled.count("jit(_jitted_burnin)") == 1
    assert compiled.count("jit(_warm_step_body)") == 1


def test_data_iterator_the_burn_in_takes_the_warm_batches():
    batches = _batches(8)
    drawn = []

    def feed():
        for b in batches:
            drawn.append(b)
            yield b

    optimizer = _shared()
    params, state = PARAMS, optimizer.init(PARAMS, jax.random.key(1), batches[0])
    iterator = feed()
    for i in range(WARM_STEPS + 2):
        params, state, stats = optimizer.step(params, state, KEYS[i], data_iterator=iterator, **GIVEN)
    # 4 warm steps (3 with a burn-in update) then 2 K-FAC steps: one batch each, no extra burn-in
    # batches.
    assert len(drawn) == WARM_STEPS + 2 and int(state.step_counter) == 2


def test_switch_when_ready_switches_once_compiled():
    optimizer = _optimizer(eqx_kfac.WarmStart(10_000, switch_when_ready=True), loss=lambda m, b: _loss(m, b))
    batches = _batches(1)
    params, state = PARAMS, optimizer.init(PARAMS, jax.random.key(1), batches[0])
    calls = 0
    while int(state.step_counter) == 0:
        params, state, stats = optimizer.step(params, state, KEYS[calls % 10], batch=batches[0], **GIVEN)
        calls += 1
        time.sleep(0.05)
        assert calls < 2000
    taken = int(state.warm_start_state.steps_taken)
    assert calls == taken + 1 and 1 <= taken < 10_000
    assert int(state.warm_start_state.burnin_updates) <= 2 and np.isfinite(stats["loss"])


def test_a_non_finite_warm_step_keeps_the_parameters():
    optimizer = _shared(1)  # (one warm step, fewer than the burn-in's: it makes a burn-in update too)
    batches = _batches(2)
    state = optimizer.init(PARAMS, jax.random.key(1), batches[0])
    bad = (batches[0][0].at[0, 0].set(jnp.nan), batches[0][1])
    params, state, stats = optimizer.step(PARAMS, state, KEYS[0], batch=bad, **GIVEN)
    assert bool(stats["skipped"]) and int(state.warm_start_state.steps_taken) == 1
    assert all(jnp.array_equal(a, b) for a, b in zip(_arrays(params), _arrays(PARAMS)))
    assert float(state.data_seen) == 0


def test_inside_a_users_jit_the_step_is_kfacs_from_the_start():
    optimizer = _shared()
    batches = _batches(1)
    state = optimizer.init(PARAMS, jax.random.key(1), batches[0])
    step = eqx.filter_jit(lambda p, s, k, b: optimizer.step(p, s, k, batch=b, **GIVEN))
    _, state, stats = step(PARAMS, state, KEYS[0], batches[0])
    assert int(state.step_counter) == 1 and int(state.warm_start_state.steps_taken) == 0 and "rho" in stats


def test_a_warm_state_saves_and_loads(tmp_path):
    optimizer = _shared()  # two of its four warm steps taken: the second with a burn-in update
    batches = _batches(2)
    params, state = PARAMS, optimizer.init(PARAMS, jax.random.key(1), batches[0])
    for i in range(2):
        params, state, _ = optimizer.step(params, state, KEYS[i], batch=batches[i], **GIVEN)
    eqx.tree_serialise_leaves(tmp_path / "s.eqx", state)
    loaded = optimizer.load_state(tmp_path / "s.eqx", PARAMS, jax.random.key(1), batches[0])
    assert int(loaded.warm_start_state.steps_taken) == 2 and int(loaded.warm_start_state.burnin_updates) == 1
    for a, b in zip(_arrays(loaded), _arrays(state)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: eqx_kfac.WarmStart(-1), ValueError, "non-negative"),
        (lambda: eqx_kfac.WarmStart(2.5), TypeError, "int"),
        (lambda: eqx_kfac.WarmStart(2, transformation=optax.adam), TypeError, "GradientTransformation"),
        (lambda: _optimizer(eqx_kfac.WarmStart(2), devices=eqx_kfac.MultiDevice()), ValueError, "one device"),
    ],
)
def test_bad_warm_starts_are_refused(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_zero_steps_is_no_warm_start():
    batches = _batches(2)
    warm = _optimizer(eqx_kfac.WarmStart(0), BURNIN)
    plain = _optimizer(None, BURNIN)  # (the reference of the switch above too: compiled once)
    outs = []
    for optimizer in (warm, plain):
        state = optimizer.init(PARAMS, jax.random.key(1), batches[0])
        outs.append(optimizer.step(PARAMS, state, KEYS[0], batch=batches[0], **GIVEN))
    for a, b in zip(_arrays(outs[0][0]), _arrays(outs[1][0])):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    assert set(outs[0][2]) == set(outs[1][2])


def test_switch_when_ready_still_switches_after_steps_calls():
    # The cap: a compilation not yet ended is waited for at the call after `steps` warm steps.
    optimizer = _optimizer(eqx_kfac.WarmStart(2, switch_when_ready=True), loss=lambda m, b: _loss(m, b))
    batches = _batches(3)
    params, state = PARAMS, optimizer.init(PARAMS, jax.random.key(1), batches[0])
    counters = []
    for i in range(3):
        params, state, stats = optimizer.step(params, state, KEYS[i], batch=batches[i], **GIVEN)
        counters.append((int(state.warm_start_state.steps_taken), int(state.step_counter)))
    assert counters[-1][1] == 1 and counters[-1][0] <= 2
    assert counters[0] == (1, 0)  # the first call is a warm step: nothing has compiled yet
