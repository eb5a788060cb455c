"""`step` is pure: same result inside a user's jit, compiled once, checkpoints resume bit-for-bit,
non-finite steps change nothing, and the registration report is logged."""

import functools as ft
import io
import logging
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import mlp_classification

from eqx_kfac import (
    COMPILER_OPTIONS, GivenDamping, LevenbergMarquardtDamping, MomentumStep, Optimizer, RefreshSchedule,
    StepGuard, StepOptions,
)


# One layer: what is checked here (the step's purity and its compilation) is the same for any
# number of layers, and each of the many programs compiled here compiles faster with one.
PROBLEM = mlp_classification(jax.random.key(0), sizes=(3, 3))
BATCH = PROBLEM.batch
TRACES = []


def _counting_loss(params, batch):
    TRACES.append(True)  # runs only while tracing, never at run time
    return PROBLEM.loss_fn(params, batch)


def _optimizer(options=None, **refresh):
    # Adaptive everything (the default step rule and guard; the damping from 1, adapted every 2
    # steps), with cached inverses and burn-in: every state field moves.
    refresh = dict(num_burnin_steps=2, inverse_update_period=2) | refresh
    return Optimizer(
        eqx.filter_value_and_grad(_counting_loss), l2_reg=1e-3,
        damping_rule=LevenbergMarquardtDamping(1.0, interval=2, minimum=1e-6, fault_increase=2.0),
        refresh=RefreshSchedule(**refresh), options=options,
    )


# Learning rate, momentum and damping passed to `step`.
GIVEN = dict(step_rule=MomentumStep(), damping_rule=GivenDamping())


OPT = _optimizer()


def _run(params, state, keys, batches=None):
    for i, key in enumerate(keys):
        batch = BATCH if batches is None else batches[i]
        params, state, stats = OPT.step(params, state, key, batch=batch)
    return params, state, stats


def _assert_trees_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _assert_trees_close(a, b, atol):
    """Equal structures, leaves within 1e-12 relative (float64) or `atol`: two programs compiled
    apart may order their reductions differently."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-12, atol=atol)


def test_step_inside_user_jit_equals_direct_call_and_compiles_once():
    state0 = OPT.init(PROBLEM.params, jax.random.key(0), BATCH)
    keys = [jax.random.key(i) for i in range(3)]
    first = _run(PROBLEM.params, state0, keys[:1])
    traces = len(TRACES)
    direct = _run(*first[:2], keys[1:])
    assert len(TRACES) == traces  # later calls reuse the compiled step: no new trace

    @eqx.filter_jit
    def user_step(params, state, key, batch):
        return OPT.step(params, state, key, batch=batch)

    params, state = PROBLEM.params, state0
    for key in keys:
        params, state, stats = user_step(params, state, key, BATCH)
    _assert_trees_close((params, state, stats), direct, atol=1e-15)
    assert int(state.step_counter) == 3



def test_compiler_options_reach_the_directly_called_step_only():
    """`compiler_options` go to XLA with the step `step` compiles (XLA rejects an unknown name), and
    a user's own jit compiles with its own: the option is then ignored. The default is
    `eqx_kfac.COMPILER_OPTIONS` (read-only), whose option is for GPUs: on this CPU the steps equal
    those of XLA's defaults, and a user's jit takes it as the docs pass it."""
    assert OPT.options.compiler_options == tuple(sorted(COMPILER_OPTIONS.items()))
    with pytest.raises(TypeError):
        COMPILER_OPTIONS["xla_gpu_enable_triton_gemm"] = True
    bogus = _optimizer(StepOptions(compiler_options={"xla_no_such_option_of_eqx_kfac": True}))
    state0 = OPT.init(PROBLEM.params, jax.random.key(0), BATCH)
    key = jax.random.key(1)
    with pytest.raises(Exception, match="xla_no_such_option_of_eqx_kfac"):
        bogus.step(PROBLEM.params, state0, key, batch=BATCH)
    users_jit = eqx.filter_jit(
        lambda p, s: bogus.step(p, s, key, batch=BATCH), compiler_options=dict(COMPILER_OPTIONS)
    )
    inside = users_jit(PROBLEM.params, state0)
    xla_defaults = _optimizer(StepOptions(compiler_options=None))
    _assert_trees_equal(inside, xla_defaults.step(PROBLEM.params, state0, key, batch=BATCH))
    _assert_trees_equal(OPT.step(PROBLEM.params, state0, key, batch=BATCH), inside)
    # The burn-in from a data iterator compiles apart, and also leaves options to the user's jit.
    def from_iterator(opt, p, s):
        return opt.step(p, s, key, data_iterator=iter([BATCH] * 3), global_step_int=0)

    inside = eqx.filter_jit(ft.partial(from_iterator, bogus))(PROBLEM.params, state0)
    _assert_trees_equal(inside, from_iterator(xla_defaults, PROBLEM.params, state0))


def test_checkpoint_resume_is_bit_identical():
    keys = [jax.random.key(i) for i in range(4)]
    state0 = OPT.init(PROBLEM.params, jax.random.key(0), BATCH)
    uninterrupted = _run(PROBLEM.params, state0, keys)
    params, state, _ = _run(PROBLEM.params, state0, keys[:2])
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, (params, state))
    buffer.seek(0)
    like = (PROBLEM.params, OPT.init(PROBLEM.params, jax.random.key(7), BATCH))
    params, state = eqx.tree_deserialise_leaves(buffer, like)
    resumed = _run(params, state, keys[2:])
    _assert_trees_equal(resumed, uninterrupted)


def _without_guard(state):
    return eqx.tree_at(lambda s: s.guard_state, state, None)


def test_non_finite_step_changes_nothing():
    state0 = OPT.init(PROBLEM.params, jax.random.key(0), BATCH)
    params1, state1, _ = _run(PROBLEM.params, state0, [jax.random.key(0)])
    bad = (BATCH[0].at[0, 0].set(jnp.nan), BATCH[1])
    params2, state2, stats = OPT.step(params1, state1, jax.random.key(1), batch=bad)
    assert bool(stats["skipped"]) and not np.isfinite(float(stats["loss"]))
    # Nothing changes but the guard's count of faults in a row.
    _assert_trees_equal((params2, _without_guard(state2)), (params1, _without_guard(state1)))
    assert int(state2.guard_state.consecutive_faults) == 1
    # A NaN first batch also leaves the burn-in undone.
    params_b, state_b, stats_b = OPT.step(PROBLEM.params, state0, jax.random.key(0), batch=bad)
    assert bool(stats_b["skipped"])
    _assert_trees_equal((params_b, _without_guard(state_b)), (PROBLEM.params, _without_guard(state0)))
    # The next good step proceeds as if the bad one had not happened, but for the guard's counts.
    after = OPT.step(params2, state2, jax.random.key(1), batch=BATCH)
    expected = OPT.step(params1, state1, jax.random.key(1), batch=BATCH)
    _assert_trees_equal((after[0], _without_guard(after[1]), after[2]),
                        (expected[0], _without_guard(expected[1]), expected[2]))
    assert not bool(after[2]["skipped"])
    guard = after[1].guard_state
    assert (int(guard.steps), int(guard.total_skipped), int(guard.consecutive_faults)) == (3, 1, 0)


def test_without_skipping_non_finite_values_propagate():
    opt = Optimizer(eqx.filter_value_and_grad(PROBLEM.loss_fn), guard=StepGuard(skip_non_finite=False),
                    refresh=RefreshSchedule(num_burnin_steps=0, inverse_update_period=1), **GIVEN)
    state = opt.init(PROBLEM.params, jax.random.key(0), BATCH)
    bad = (BATCH[0].at[0, 0].set(jnp.nan), BATCH[1])
    params, state, stats = opt.step(PROBLEM.params, state, jax.random.key(0), batch=bad,
                                    learning_rate=0.1, momentum=0.0, damping=0.1)
    assert not bool(stats["skipped"])
    assert int(state.step_counter) == 1
    assert np.isnan(np.asarray(params.layers[0].weight)).any()


def test_registration_report_is_logged_at_each_init_not_at_steps(caplog):
    # The estimators are cached per loss function, configuration and signature, across optimizers
    # (other tests build them for PROBLEM.loss_fn): a loss of its own is built here first. Each
    # `init` reports, from the cache too (tests/test_reports.py); a step's trace does not.
    def loss_fn(*args):
        return PROBLEM.loss_fn(*args)

    opt = Optimizer(eqx.filter_value_and_grad(loss_fn), **GIVEN)
    with caplog.at_level(logging.INFO, logger="eqx_kfac"):
        opt.init(PROBLEM.params, jax.random.key(0), BATCH)
        state = opt.init(PROBLEM.params, jax.random.key(1), BATCH)
        opt.step(PROBLEM.params, state, jax.random.key(2), batch=BATCH, learning_rate=0.1,
                 momentum=0.0, damping=0.1)
    records = [r for r in caplog.records if r.name == "eqx_kfac"]
    assert len(records) == 2 and records[0].getMessage() == records[1].getMessage()
    message = records[0].getMessage()
    assert "layers[0].weight" in message and "DenseTwoKroneckerFactored" in message


def test_non_finite_update_is_skipped_and_the_statistics_kept():
    # Finite loss and gradient, infinite learning rate: the update is not finite. The batch was
    # processed (its statistics folded in, the counters advance), the update is not applied.
    opt = Optimizer(eqx.filter_value_and_grad(PROBLEM.loss_fn), l2_reg=1e-3,
                    refresh=RefreshSchedule(num_burnin_steps=0, inverse_update_period=2), **GIVEN)
    state = opt.init(PROBLEM.params, jax.random.key(0), BATCH)
    hyper = dict(momentum=0.5, damping=0.1)
    good = opt.step(PROBLEM.params, state, jax.random.key(1), batch=BATCH, learning_rate=0.1,
                    **hyper)
    params, new_state, stats = opt.step(PROBLEM.params, state, jax.random.key(1), batch=BATCH,
                                        learning_rate=jnp.inf, **hyper)
    assert bool(stats["skipped"]) and np.isfinite(float(stats["loss"]))
    _assert_trees_equal(params, PROBLEM.params)
    _assert_trees_equal(new_state.velocities, state.velocities)
    _assert_trees_equal(
        (new_state.step_counter, new_state.data_seen), (good[1].step_counter, good[1].data_seen)
    )
    assert int(new_state.guard_state.consecutive_faults) == 1
    # The batch's statistics and the refreshed cache are those of the good step.
    _assert_trees_equal(new_state.estimator_state, good[1].estimator_state)


def test_donating_step_equals_plain_step_and_consumes_its_arguments():
    plain = OPT  # (its step compiled by the other tests already)
    donating = _optimizer(StepOptions(donate_parameters=True, donate_optimizer_state=True))
    state0 = plain.init(PROBLEM.params, jax.random.key(0), BATCH)
    expected = (PROBLEM.params, state0)
    # (Copied by `device_put`, which compiles nothing: `jnp.array` compiles a copy per shape.)
    copy = jax.tree.map(lambda a: jax.device_put(a, may_alias=False) if eqx.is_array(a) else a, expected)
    params, state = copy
    for i in range(3):
        expected = plain.step(*expected, jax.random.key(i), batch=BATCH)[:2]
        donated_leaf = jax.tree.leaves(params)[0]
        state_leaf = state.estimator_state
        state_leaf = jax.tree.leaves(state_leaf)[0]
        params, state, _ = donating.step(params, state, jax.random.key(i), batch=BATCH)
        assert donated_leaf.is_deleted()
        # The first step (with its burn-in) keeps the state it was given, as documented: the
        # step returns it if it is skipped. Later steps consume it.
        assert state_leaf.is_deleted() == (i > 0)
    # With donated buffers XLA may fuse differently (seen: the last bit of every weight).
    _assert_trees_close((params, state), expected, atol=1e-300)


def test_optimizer_holds_no_mutable_state():
    # Equal configurations give equal optimizers (no per-instance cache), which share their
    # estimators.
    def make():
        return Optimizer(eqx.filter_value_and_grad(PROBLEM.loss_fn))

    first, second = make(), make()
    assert bool(first == second)
    func_args = (PROBLEM.params, BATCH)
    assert first.estimators(func_args)[0] is second.estimators(func_args)[0]


def test_init_compiles_one_program_for_the_whole_state(xla_compilations):
    # Built op by op, every array of a new shape in the state (factors, caches, velocities) would
    # compile a program of its own: 12 for a two-layer MLP when `init` built the state eagerly.
    OPT.init(PROBLEM.params, jax.random.key(0), BATCH)  # the estimator, built once
    key = jax.random.key(1)
    count = xla_compilations(lambda: OPT.init(PROBLEM.params, key, BATCH))
    # The loss's checks and the one scalar by which the checks see whether a `jit` is tracing
    # them (a program compiled once per process, counted here after `clear_caches`). The state
    # compiles nothing: its arrays are constants, made on the host (`host_built`).
    assert count == 2, count
    # A second `init` of the same optimizer and shapes compiles nothing (it compiled the state's
    # program again, 0.14 s of 0.15 s on a 64-128-128-10 MLP, when that program was a new `jit`
    # of each call's own `functools.partial`).
    assert xla_compilations(lambda: OPT.init(PROBLEM.params, key, BATCH), clear=False) == 0


# Options for XLA:CPU that change nothing here, to tell the step's own options from others.
FAST_MATH_OFF = {"xla_cpu_enable_fast_math": False}


def _recorded_first_step(optimizer):
    """The optimizer's first step, called directly: `(compiles, used)`, the (thread, program) of
    each compilation during the step, and the (function, options) of each program the step asks
    `compilation._jit` for."""
    from eqx_kfac._optim import compilation

    state = optimizer.init(PROBLEM.params, jax.random.key(0), BATCH)
    compiles, used = [], []
    original = compilation._jit

    def recording(fn, donate, options):
        used.append((fn.__name__, dict(options)))
        return original(fn, donate, options)

    def listener(event, seconds, fun_name="", **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append((threading.current_thread().name, fun_name))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compilation, "_jit", recording)
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            optimizer.step(PROBLEM.params, state, jax.random.key(1), batch=BATCH)
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
    return compiles, used


@pytest.fixture(scope="module")
def fresh_first_step():
    """`_recorded_first_step` of an optimizer nothing compiled before (a new configuration), with a
    burn-in of 2 updates and the step's compiler options set: its programs are compiled once for
    the two tests below."""
    return _recorded_first_step(_optimizer(StepOptions(compiler_options=FAST_MATH_OFF), curvature_ema=0.9))


def test_first_step_compiles_its_program_once_during_the_burn_in(fresh_first_step):
    # Called directly, the first step runs its burn-in updates (a program of their own) first;
    # the step's program is compiled meanwhile in a thread of its own, and not again after.
    compiles, _ = fresh_first_step
    steps = [thread for thread, name in compiles if "_jitted_step" in name]
    assert steps == ["eqx_kfac-compile"], compiles
    assert any("_jitted_burnin" in name for _, name in compiles), compiles


@pytest.mark.parametrize("burnin", [2, 11])
def test_a_short_burnin_compiles_its_update_for_compile_time(request, burnin):
    # The burn-in's update runs `num_burnin_steps` times: at most 10, LLVM does not optimise its
    # kernels (on top of the step's own options); the step keeps its options either way.
    if burnin == 2:
        _, used = request.getfixturevalue("fresh_first_step")
    else:
        _, used = _recorded_first_step(_optimizer(StepOptions(compiler_options=FAST_MATH_OFF), num_burnin_steps=burnin))
    step = FAST_MATH_OFF
    short = {**step, "xla_backend_optimization_level": 0, "xla_gpu_autotune_level": 0}
    assert {name for name, _ in used} == {"_jitted_step", "_jitted_burnin"}, used
    assert all(options == step for name, options in used if name == "_jitted_step"), used
    burnin_options = short if burnin <= 10 else step
    assert all(options == burnin_options for name, options in used if name == "_jitted_burnin"), used
