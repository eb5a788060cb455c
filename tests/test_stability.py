"""Faults and dtypes: what a bad batch, an overflow, a misuse or a low-precision model does to a
run (issue: stable by default). Every case runs a handful of steps of a tiny MLP."""

import os
import re
import subprocess
import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TEST_XLA_FLAGS
from models import mlp_classification

import eqx_kfac


PROBLEM = mlp_classification(jax.random.key(0), sizes=(3, 6, 3), batch=8)
BATCH = PROBLEM.batch
VG = eqx.filter_value_and_grad(PROBLEM.loss_fn)
NO_BURNIN = eqx_kfac.RefreshSchedule(num_burnin_steps=0)
# The module's configuration: the recommended parts (adaptive learning rate, momentum and damping,
# steps that raise the loss rejected, statistics growing more than 1e3 times dropped), no burn-in.
OPT = eqx_kfac.Optimizer(VG, refresh=NO_BURNIN)
# The outlier test without a limit on the statistics' growth and the trust-region test's tight run
# share one configuration, so that its step is compiled once: neither test's option matters to
# the other's check.
TIGHT_AND_UNLIMITED = dict(
    refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=0, max_statistics_growth=None),
    step_rule=eqx_kfac.MomentumStep(
        eqx_kfac.AdaptiveHyperparameter(0.0, 10.0), eqx_kfac.AdaptiveHyperparameter(-0.95, 0.95),
        max_predicted_decrease=1e-3,
    ),
    guard=eqx_kfac.StepGuard(),
)


def _long_step_optimizer(raise_at_once=False, **guard):
    """Adaptive damping from 1e-3 (and momentum) with the learning rate given to `step`; steps that
    raise the loss rejected."""
    return eqx_kfac.Optimizer(
        VG, refresh=NO_BURNIN,
        step_rule=eqx_kfac.MomentumStep(
            eqx_kfac.GivenHyperparameter(), eqx_kfac.AdaptiveHyperparameter(-0.95, 0.95), max_predicted_decrease=0.5
        ),
        damping_rule=eqx_kfac.LevenbergMarquardtDamping(
            1e-3, minimum=1e-6, fault_increase=2.0, raise_at_once=raise_at_once
        ),
        guard=eqx_kfac.StepGuard(reject_loss_increase=True, **guard),
    )


def _scaled(scale):
    return (BATCH[0] * scale, BATCH[1])


# (Checks of results on the host, with NumPy: eager JAX operations compile a program each.)
def _finite(tree):
    leaves = [x for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
    return all(np.all(np.isfinite(np.asarray(x, np.float64))) for x in leaves)


def _same(a, b):
    return np.array_equal(np.asarray(a), np.asarray(b))


def _statistics(state):
    return [f.value for s in state.estimator_state.block_states for f in getattr(s, "factors", ())]


def test_overflowing_statistics_are_dropped_and_the_run_goes_on():
    opt = OPT
    params, state, _ = opt.step(PROBLEM.params, opt.init(PROBLEM.params, jax.random.key(0), BATCH),
                                jax.random.key(1), batch=BATCH)
    before = _statistics(state)
    # Inputs x1e300 in float64: loss and gradient finite, second moments overflow.
    params, state, stats = opt.step(params, state, jax.random.key(2), batch=_scaled(1e300))
    assert bool(stats["curvature_update_dropped"])
    assert int(state.estimator_state.dropped_updates) == 1
    for old, new in zip(before, _statistics(state)):
        np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
    assert _finite((params, state))
    for i in range(3):
        params, state, stats = opt.step(params, state, jax.random.key(3 + i), batch=BATCH)
    assert not bool(stats["curvature_update_dropped"]) and _finite((params, state))


@pytest.mark.parametrize("growth", [1e3, None])
def test_an_outlier_batch_is_not_folded_into_the_statistics(growth):
    # Inputs x1e6: finite, but their second moments are 1e12 times the usual ones.
    opt = OPT if growth is not None else eqx_kfac.Optimizer(VG, **TIGHT_AND_UNLIMITED)
    assert growth is None or opt.preconditioner.refresh.max_statistics_growth == growth
    params, state, _ = opt.step(PROBLEM.params, opt.init(PROBLEM.params, jax.random.key(0), BATCH),
                                jax.random.key(1), batch=BATCH)
    before = _statistics(state)
    _, state, stats = opt.step(params, state, jax.random.key(2), batch=_scaled(1e6))
    unchanged = all(_same(o, n) for o, n in zip(before, _statistics(state)))
    assert bool(stats["curvature_update_dropped"]) == unchanged == (growth is not None)
    # An ordinary batch is folded in.
    _, state, stats = opt.step(params, state, jax.random.key(3), batch=_scaled(1.5))
    assert not bool(stats["curvature_update_dropped"])


def test_the_trust_region_bounds_the_predicted_decrease():
    # The loose run has the default limit (0.5 times the loss; the configuration of the other
    # tests here, so its step is compiled once): its predicted decrease is at most the model
    # minimiser's, so where it exceeds 1e-3 times the loss, the limit of 1e-3 binds.
    optimizers = {
        0.5: OPT,
        1e-3: eqx_kfac.Optimizer(VG, **TIGHT_AND_UNLIMITED),
    }
    changes = {}
    for tau, opt in optimizers.items():
        params, state = PROBLEM.params, opt.init(PROBLEM.params, jax.random.key(0), BATCH)
        for i in range(2):  # the second step has momentum
            params, state, stats = opt.step(params, state, jax.random.key(i), batch=BATCH)
            assert not bool(stats["rejected"])
            changes[tau, i] = (float(stats["quad_model_change"]), float(stats["loss"]))
    for i in range(2):
        loose, loss = changes[0.5, i]
        assert loose < -1e-3 * loss  # the limit binds: the model's minimiser predicts more
        np.testing.assert_allclose(changes[1e-3, i][0], -1e-3 * changes[1e-3, i][1], rtol=1e-8)


def test_a_collapse_of_rho_raises_the_damping_at_once():
    # A fixed learning rate far too long: rho < 0 on the first step, which is not an adaptation
    # step of the interval (5); with raise_damping_at_once the damping rises there, by the
    # interval's factor, before the rejected step's factor (2) applies. (Without it, the
    # configuration of the rejection test below: its step is compiled once.)
    dampings = {}
    for at_once in (False, True):
        opt = _long_step_optimizer(at_once, max_consecutive_faults=None)
        state = opt.init(PROBLEM.params, jax.random.key(0), BATCH)
        _, state, stats = opt.step(PROBLEM.params, state, jax.random.key(1), batch=BATCH,
                                   learning_rate=1e4)
        assert bool(stats["rejected"])
        dampings[at_once] = float(state.damping)
    np.testing.assert_allclose(dampings[False], 2e-3, rtol=1e-12)
    np.testing.assert_allclose(dampings[True], 2e-3 / 0.9**5, rtol=1e-6)


def test_damping_keeps_still_when_the_change_is_below_the_loss_resolution():
    # A batch fitted to rounding: the loss cannot show a predicted change of 1e-20 (or does
    # not change at all), rho is 0, and raising the damping there (as kfac-jax does) ratchets it
    # up for nothing; a resolved change with rho < 0.25 raises it.
    estimator = eqx_kfac.BlockDiagonalCurvature(PROBLEM.loss_fn, (PROBLEM.params, BATCH))
    rule = eqx_kfac.LevenbergMarquardtDamping(initial_damping=1e-3, interval=1)
    loss = jnp.asarray(1e-9, jnp.float32)  # resolution 4·eps·|L| = 4.8e-16
    context = eqx_kfac.StepContext(
        jnp.zeros((), int), jnp.zeros(()), (PROBLEM.params, BATCH), loss, None, estimator,
        estimator.init(), eqx_kfac.ImplicitExactCurvature(PROBLEM.loss_fn), "ggn_exact", 0.0,
        None, PROBLEM.loss_fn, lambda out: out, eqx_kfac.GivenValues(),
    )
    state = rule.init(jnp.float64)
    # Compiled, as the step runs it (one program for the three cases, not one per operation).
    update = eqx.filter_jit(lambda state, outcome: rule.update(state, state.damping, outcome, context))
    for change, new_loss, expected in (
        (-1e-20, loss, 1e-3), (-1e-12, loss, 1e-3), (-1e-12, 2 * loss, 1e-3 / 0.9)
    ):
        outcome = eqx_kfac.StepOutcome(None, None, jnp.asarray(change, jnp.float32), new_loss,
                                       jnp.asarray(True), jnp.asarray(False))
        new_state, report = update(state, outcome)
        np.testing.assert_allclose(float(report.rho), float((new_loss - loss) / change), rtol=1e-6)
        np.testing.assert_allclose(float(new_state.damping), expected, rtol=1e-12)


def test_nan_batch_and_overflow_leave_kfac_optax_unchanged():
    # Compiled, as it is used (one program for the three updates instead of one per operation).
    transform = eqx_kfac.kfac_optax(PROBLEM.loss_fn, (PROBLEM.params, BATCH))
    update = eqx.filter_jit(transform.update)
    params = eqx.filter(PROBLEM.params, eqx.is_inexact_array)
    state = transform.init(params)
    grad = eqx.filter_jit(eqx.filter_grad(PROBLEM.loss_fn))
    updates, state = update(grad(PROBLEM.params, BATCH), state, params, batch=BATCH,
                            key=jax.random.key(0))
    params = optax.apply_updates(params, updates)
    nan_batch = (BATCH[0].at[0, 0].set(jnp.nan), BATCH[1])
    new_updates, new_state = update(grad(PROBLEM.params, nan_batch), state, params,
                                    batch=nan_batch, key=jax.random.key(1))
    assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(new_updates))
    same = jax.tree.map(_same, new_state.inner_state, state.inner_state)
    assert all(jax.tree.leaves(same))
    assert int(new_state.total_skipped) == 1
    huge = _scaled(1e300)
    updates, state = update(grad(eqx.combine(params, PROBLEM.params), huge), state, params,
                            batch=huge, key=jax.random.key(2))
    assert _finite(state) and _finite(updates)


def test_skip_non_finite_sees_what_the_inner_transformation_makes():
    # Finite gradients, a non-finite update: optax.apply_if_finite would apply it.
    inner = optax.scale_by_schedule(lambda count: jnp.where(count == 1, jnp.inf, 1.0))
    guarded = eqx_kfac.skip_non_finite(inner)
    grads = {"w": jnp.ones(3)}
    state = guarded.init(grads)
    u0, state = guarded.update(grads, state)
    u1, state = guarded.update(grads, state)
    assert bool(jnp.all(u0["w"] == 1.0)) and bool(jnp.all(u1["w"] == 0.0))
    assert int(state.total_skipped) == 1 and int(state.guard_state.consecutive_faults) == 1


def test_faults_in_a_row_stop_the_run_with_an_explanation():
    # The default limit (20 faults in a row) and the module's configuration (compiled once): a
    # directly called step stops in Python.
    opt = OPT
    state = opt.init(PROBLEM.params, jax.random.key(0), BATCH)
    nan_batch = (BATCH[0].at[0, 0].set(jnp.nan), BATCH[1])
    for i in range(19):
        _, state, stats = opt.step(PROBLEM.params, state, jax.random.key(1 + i), batch=nan_batch)
        assert bool(stats["skipped"])
    with pytest.raises(Exception, match="20 consecutive steps were not applied(.|\n)*has converged"):
        opt.step(PROBLEM.params, state, jax.random.key(20), batch=nan_batch)


def test_faults_in_a_row_stop_a_run_inside_jit_with_stop_in_program():
    # (Without `stop_in_program`, `optimizer.check(state)` stops it: tests/test_platform_lowering.py.)
    guard = eqx_kfac.StepGuard(reject_loss_increase=True, max_consecutive_faults=1, stop_in_program=True)
    opt = eqx_kfac.Optimizer(VG, refresh=NO_BURNIN, guard=guard)
    state = opt.init(PROBLEM.params, jax.random.key(0), BATCH)
    step = eqx.filter_jit(lambda p, s, b: opt.step(p, s, jax.random.key(1), batch=b))
    with pytest.raises(Exception, match="1 consecutive steps were not applied"):
        jax.block_until_ready(step(PROBLEM.params, state, (BATCH[0].at[0, 0].set(jnp.nan), BATCH[1])))


@pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)
def test_the_persistent_cache_stores_steps_without_a_host_callback(tmp_path):
    # JAX 0.10's persistent compilation cache does not store a program that holds a host callback
    # (JAX 0.11 and later do). `Optimizer.step` called directly checks its guard's count in Python,
    # so its compiled step holds none and is stored. kfac_optax's stop after 20 faults in a row
    # with `stop_in_program=True` is a callback in the user's jitted step: tracing it with the
    # cache on warns exactly when the step is not stored; by default it is stored (and
    # `check_consecutive_faults` checks in Python).
    script = f"""
import warnings, jax, equinox as eqx, optax, eqx_kfac
eqx_kfac.enable_compilation_cache({str(tmp_path)!r}, min_compile_time_secs=0.0)
model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
batch = jax.random.normal(jax.random.key(1), (8, 3)), jax.numpy.arange(8) % 2
def loss(model, batch):
    logits = jax.vmap(model)(batch[0])
    eqx_kfac.register_softmax_cross_entropy_loss(logits, batch[1])
    return -jax.numpy.mean(jax.nn.log_softmax(logits)[jax.numpy.arange(8), batch[1]])
opt = eqx_kfac.Optimizer(eqx.filter_value_and_grad(loss), refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=0))
opt.step(model, opt.init(model, jax.random.key(0), batch), jax.random.key(1), batch=batch)
params, static = eqx.partition(model, eqx.is_inexact_array)
def make_step(stop_in_program):
    transform = eqx_kfac.kfac_optax(loss, (model, batch), stop_in_program=stop_in_program)
    def step(params, state):
        grads = eqx.filter_grad(loss)(eqx.combine(params, static), batch)
        updates, state = transform.update(grads, state, params, batch=batch, key=jax.random.key(2))
        return optax.apply_updates(params, updates), state
    return transform.init(params), step
state, step = make_step(True)
def guarded_step(params, state):
    return step(params, state)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.jit(guarded_step)(params, state)
print("warned:", any("will not be stored" in str(w.message) for w in caught))
state, step = make_step(False)
def free_step(params, state):
    return step(params, state)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    params, state = jax.jit(free_step)(params, state)
assert not any("will not be stored" in str(w.message) for w in caught), caught
eqx_kfac.check_consecutive_faults(state, 20)
"""
    env = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, timeout=600, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    warned = "warned: True" in run.stdout
    assert warned or "warned: False" in run.stdout, run.stdout
    names = [path.name for path in tmp_path.iterdir()]
    assert any(name.startswith("jit__jitted_step-") for name in names), names
    assert any(name.startswith("jit_free_step-") for name in names), names
    stored = any(name.startswith("jit_guarded_step-") for name in names)
    assert warned != stored, (warned, names)
    assert stored == (jax.__version_info__ >= (0, 11)), names


def test_check_consecutive_faults_reads_every_guard_in_a_state():
    inner = optax.scale_by_schedule(lambda count: jnp.where(count >= 1, jnp.inf, 1.0))
    guarded = eqx_kfac.skip_non_finite(inner, max_consecutive_faults=None)
    grads = {"w": jnp.ones(3)}
    state = guarded.init(grads)
    for _ in range(3):
        _, state = guarded.update(grads, state)
    # Two faults in a row (the first update was applied), found inside any PyTree.
    eqx_kfac.check_consecutive_faults((grads, state), 3)
    with pytest.raises(RuntimeError, match="2 consecutive steps were not applied"):
        eqx_kfac.check_consecutive_faults((grads, state), 2)
    with pytest.raises(ValueError, match="found no step guard"):
        eqx_kfac.check_consecutive_faults(grads, 2)


def test_a_step_that_raises_the_loss_is_rejected_and_the_damping_raised():
    # A fixed, far too long learning rate with adaptive damping: every step raises the loss.
    # (Adaptive momentum: the configuration of the collapse test above, compiled once.)
    opt = _long_step_optimizer(max_consecutive_faults=None)
    state = opt.init(PROBLEM.params, jax.random.key(0), BATCH)
    params, state, stats = opt.step(PROBLEM.params, state, jax.random.key(1), batch=BATCH,
                                    learning_rate=1e4)
    assert bool(stats["rejected"]) and float(stats["new_loss"]) > float(stats["loss"])
    assert jax.tree.all(jax.tree.map(_same, params, PROBLEM.params))
    np.testing.assert_allclose(float(state.damping), 2e-3, rtol=1e-12)
    assert int(state.step_counter) == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_a_rise_within_rounding_is_not_rejected(dtype):
    # `rounding_tolerance=32`: a rise of at most 32 eps |loss| is rounding, one above it is not.
    guard = eqx_kfac.StepGuard(reject_loss_increase=True)
    grads, delta = (jnp.ones(3, dtype),), (jnp.ones(3, dtype),)
    loss = jnp.asarray(1.5e-3, dtype)
    eps = float(jnp.finfo(dtype).eps)
    within = np.nextafter(loss + dtype(30 * eps * 1.5e-3), np.inf, dtype=dtype)
    beyond = loss + dtype(40 * eps * 1.5e-3)
    assert float(beyond - loss) > 32 * eps * 1.5e-3 > float(within - loss) > 0
    # Compiled, as the step runs them (one program per guard, not one per operation).
    decide = eqx.filter_jit(lambda guard, new: guard.decide(loss, grads, delta, new))
    decisions = [decide(guard, jnp.asarray(new, dtype)) for new in (within, beyond, jnp.nan)]
    assert [bool(d.rejected) for d in decisions] == [False, True, True]
    strict = eqx_kfac.StepGuard(reject_loss_increase=True, rounding_tolerance=0.0)
    assert bool(decide(strict, jnp.asarray(within, dtype)).rejected)
    with pytest.raises(ValueError, match="rounding_tolerance"):
        eqx_kfac.StepGuard(rounding_tolerance=-1.0)


@pytest.mark.parametrize(
    "dtype, adaptive, hyper",
    [
        (jnp.bfloat16, True, {}),
        (jnp.float16, False, dict(learning_rate=0.1, momentum=0.9, damping=0.1)),
    ],
)
def test_low_precision_parameters_train_and_keep_their_dtype(dtype, adaptive, hyper):
    params = jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, PROBLEM.params)
    batch = (BATCH[0].astype(dtype), BATCH[1])
    strict = eqx_kfac.CurvatureOptions(on_unmatched="error")
    if adaptive:
        opt = eqx_kfac.Optimizer(VG, refresh=NO_BURNIN, curvature=strict)
        state = opt.init(params, jax.random.key(0), batch)
        p = params
        for i in range(2):
            p, state, stats = opt.step(p, state, jax.random.key(i), batch=batch, **hyper)
        assert {x.dtype for x in jax.tree.leaves(eqx.filter(p, eqx.is_inexact_array))} == {jnp.dtype(dtype)}
        assert {s.dtype for s in _statistics(state)} == {jnp.dtype(jnp.float32)}
        assert not bool(stats["skipped"]) and _finite(p)
        return
    opt = eqx_kfac.Optimizer(VG, refresh=NO_BURNIN, curvature=strict, step_rule=eqx_kfac.MomentumStep(),
                             damping_rule=eqx_kfac.GivenDamping())
    p, state, _ = opt.step(params, opt.init(params, jax.random.key(0), batch), jax.random.key(1),
                           batch=batch, **hyper)
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(p, eqx.is_inexact_array))} == {jnp.dtype(dtype)}
    transform = eqx_kfac.kfac_optax(PROBLEM.loss_fn, (params, batch), on_unmatched="error")
    flat = eqx.filter(params, eqx.is_inexact_array)
    grads = eqx.filter_jit(eqx.filter_grad(PROBLEM.loss_fn))(params, batch)
    updates, _ = eqx.filter_jit(transform.update)(grads, transform.init(flat), flat, batch=batch,
                                                  key=jax.random.key(0))
    applied = jax.eval_shape(optax.apply_updates, flat, updates)  # (its dtypes, without compiling)
    assert {x.dtype for x in jax.tree.leaves(applied)} == {jnp.dtype(dtype)}


def test_float32_parameters_with_float64_inputs_keep_structured_blocks_and_train():
    params = jax.tree.map(lambda x: x.astype(jnp.float32) if eqx.is_inexact_array(x) else x, PROBLEM.params)
    opt = eqx_kfac.Optimizer(VG, refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=1),
                             curvature=eqx_kfac.CurvatureOptions(on_unmatched="error"))
    state = opt.init(params, jax.random.key(0), BATCH)
    losses = []
    for i in range(6):
        params, state, stats = opt.step(params, state, jax.random.key(i), batch=BATCH)
        losses.append(float(stats["loss"]))
        assert not bool(stats["skipped"])
    assert losses[-1] < losses[0]
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(params, eqx.is_inexact_array))} == {jnp.dtype(jnp.float32)}


def test_the_count_of_examples_cannot_wrap():
    count = eqx_kfac.ExampleCount.zero()
    for _ in range(3):
        count = count.add(2**30 - 1)
    assert int(count.high) * 2**30 + int(count.low) == 3 * (2**30 - 1)
    assert count.as_int() == 3 * (2**30 - 1)
    assert float(count.value) == 3.0 * (2**30 - 1)
    # Past 2³¹ the exact reading stays exact where a float32 one rounds (docs/optimizer.md).
    past = eqx_kfac.ExampleCount.zero().add(2**30).add(2**30).add(54)
    assert past.as_int() == 2**31 + 54
    assert np.float32(past.as_int()) == np.float32(2147483648.0)
    opt = eqx_kfac.Optimizer(
        VG, refresh=NO_BURNIN,
        step_rule=eqx_kfac.MomentumStep(
            eqx_kfac.ScheduledHyperparameter(lambda step, data_seen: 0.1 / (1 + data_seen / 2**31)),
            eqx_kfac.ScheduledHyperparameter(lambda step: 0.0),
        ),
        damping_rule=eqx_kfac.ScheduledDamping(lambda step: 0.1),
    )
    state = opt.init(PROBLEM.params, jax.random.key(0), BATCH)
    state = eqx.tree_at(lambda s: s.examples_seen, state, count)
    _, state, stats = opt.step(PROBLEM.params, state, jax.random.key(1), batch=BATCH)
    assert float(stats["data_seen"]) == 3.0 * (2**30 - 1) + 8
    assert np.isfinite(float(stats["learning_rate"])) and not bool(stats["skipped"])


def test_misuse_raises_clear_errors():
    opt = OPT
    state = opt.init(PROBLEM.params, jax.random.key(0), BATCH)
    other = mlp_classification(jax.random.key(1), sizes=(3, 5, 3), batch=8).params
    with pytest.raises(ValueError, match="parameters passed to step are not those given to init"):
        opt.step(other, state, jax.random.key(0), batch=BATCH)
    with pytest.raises(ValueError, match="its structure is"):
        opt.step(PROBLEM.params, state, jax.random.key(0), batch=list(BATCH))
    # (Under the tests' run-time type checks the annotation catches it first.)
    with pytest.raises(TypeError, match="restored without a template|Expected type: .*OptimizerState"):
        opt.step(PROBLEM.params, {"step_counter": 0}, jax.random.key(0), batch=BATCH)

    def vector_loss(params, batch):
        logits = jax.vmap(params)(batch[0])
        eqx_kfac.register_softmax_cross_entropy_loss(logits, batch[1])
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), batch[1][:, None], 1)[:, 0]

    vector = eqx_kfac.Optimizer(eqx.filter_value_and_grad(lambda p, b: jnp.sum(vector_loss(p, b))),
                                value_func=vector_loss)
    with pytest.raises(ValueError, match="must return a scalar loss"):
        vector.init(PROBLEM.params, jax.random.key(0), BATCH)
    transform = eqx_kfac.kfac_preconditioner(PROBLEM.loss_fn, (PROBLEM.params, BATCH), damping=0.1)
    with pytest.raises(TypeError, match="restored without a template"):
        transform.update(PROBLEM.params, {"count": 0}, PROBLEM.params, batch=BATCH, key=jax.random.key(0))


def test_suspicious_registrations_warn_and_bad_labels_raise():
    def twice(model, batch):
        logits = jax.vmap(model)(batch[0])
        eqx_kfac.register_softmax_cross_entropy_loss(logits, batch[1])
        eqx_kfac.register_softmax_cross_entropy_loss(logits, batch[1])
        return jnp.mean(logits)

    def stopped(model, batch):
        logits = jax.vmap(model)(batch[0])
        eqx_kfac.register_softmax_cross_entropy_loss(jax.lax.stop_gradient(logits), batch[1])
        return jnp.mean(logits)

    for loss, message in ((twice, "registered already"), (stopped, "does not depend on the parameters")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eqx_kfac.BlockDiagonalCurvature(loss, (PROBLEM.params, BATCH))
        assert any(re.search(message, str(w.message)) for w in caught), loss.__name__
    labels = BATCH[1].at[0].set(-1)
    bad = (BATCH[0], labels)
    opt = OPT
    with pytest.raises(ValueError, match=r"loss #0 .* 1 labels outside \[0, classes\)"):
        opt.init(PROBLEM.params, jax.random.key(0), bad)

    # The message counts every registered loss: a squared error first, the labels' loss second.
    def two_losses(model, batch):
        logits = jax.vmap(model)(batch[0])
        eqx_kfac.register_squared_error_loss(2 * logits, jnp.zeros_like(logits))
        eqx_kfac.register_softmax_cross_entropy_loss(logits, batch[1])
        return jnp.mean(logits)

    with pytest.raises(ValueError, match=r"loss #1 .* 1 labels outside"):
        eqx_kfac.kfac_preconditioner(two_losses, (PROBLEM.params, bad), damping=1e-3)
    # In a step (the labels are not known when it is traced), an empirical-Fisher update with
    # the label is not finite and dropped; the label never wraps to the last class.
    evaluate = eqx.filter_jit(lambda x, y: eqx_kfac.CategoricalLogitsNegativeLogProbLoss(x, y).evaluate())
    losses = [evaluate(BATCH[0], labels)]
    assert np.isnan(np.asarray(losses[0][0])) and np.all(np.isfinite(np.asarray(losses[0][1:])))


def test_damping_calibration_stops_where_the_rule_keeps_the_damping():
    # With adaptation at every step, the first step after the calibration is the calibration's
    # last trial again: its rho lies between the thresholds and the damping stays, from a start
    # far below or far above. (`initial_damping`, a static field, only sets the damping of the
    # state `init` builds: the start far above is set there, so that one optimizer's trial and
    # step are compiled once for both starts.)
    opt = eqx_kfac.Optimizer(
        VG, refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=1),
        damping_rule=eqx_kfac.LevenbergMarquardtDamping(
            1e-4, interval=1, minimum=1e-6, fault_increase=2.0, calibrate=True
        ),
        guard=eqx_kfac.StepGuard(),
    )
    for initial in (1e-4, 10.0):
        state = opt.init(PROBLEM.params, jax.random.key(0), BATCH)
        np.testing.assert_array_equal(np.asarray(state.damping), 1e-4)
        start = jnp.asarray(initial, state.damping.dtype)
        state = eqx.tree_at(lambda s: s.damping_state.damping, state, start)
        _, state, stats = opt.step(PROBLEM.params, state, jax.random.key(1), batch=BATCH)
        assert float(stats["damping"]) != initial
        assert 0.25 <= float(stats["rho"]) <= 0.75
        assert float(state.damping) == float(stats["damping"])
