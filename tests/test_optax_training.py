"""`OptaxTraining`: `kfac_optax` (or any optax transformation) with a ready training step that
takes first-order steps while the transformation's step compiles in a thread (issue 48, "a ready
training helper for `kfac_optax`").

References: the warm steps against the optax transformation applied by hand; the steps after the
switch against `kfac_optax`'s `update` applied by hand from the parameters the warm steps reached
and its `init`'s state; the compilations counted by JAX's monitoring events.
"""

import os
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_kfac

from test_warm_start import _batches, _loss


PARAMS = eqx.nn.MLP(5, 3, 8, 0, key=jax.random.key(0))
BATCHES = _batches(6)
KEYS = [jax.random.key(100 + i) for i in range(6)]
ADAM = optax.adam(3e-2)
TRANSFORM = eqx_kfac.kfac_optax(_loss, (PARAMS, BATCHES[0]), learning_rate=0.1, momentum=0.5, damping=1e-2)


# The references, compiled (one program each instead of one per operation).
@eqx.filter_jit
def _adam_step(params, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(_loss)(params, batch)
    updates, opt_state = ADAM.update(grads, opt_state, eqx.filter(params, eqx.is_inexact_array))
    return eqx.apply_updates(params, updates), opt_state, loss


@eqx.filter_jit
def _kfac_step(params, opt_state, batch, key):
    loss, grads = eqx.filter_value_and_grad(_loss)(params, batch)
    updates, opt_state = TRANSFORM.update(
        grads, opt_state, eqx.filter(params, eqx.is_inexact_array), batch=batch, key=key, value=loss
    )
    return eqx.apply_updates(params, updates), opt_state, loss


def _arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))


def _assert_close(got, want):
    for g, w in zip(_arrays(got), _arrays(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-14)


def _train(training, steps, params=PARAMS, state=None):
    state = training.init(params) if state is None else state
    runs = []
    for i in range(steps):
        params, state, loss = training.step(params, state, BATCHES[i], key=KEYS[i])
        runs.append((params, state, loss))
    return runs


@pytest.fixture(scope="module")
def warm_run():
    return _train(eqx_kfac.OptaxTraining(_loss, TRANSFORM, eqx_kfac.WarmStart(3, ADAM)), 5)


def test_warm_steps_then_the_transformations_steps_as_applied_by_hand(warm_run):
    params, adam_state = PARAMS, ADAM.init(eqx.filter(PARAMS, eqx.is_inexact_array))
    for i in range(3):
        params, adam_state, loss = _adam_step(params, adam_state, BATCHES[i])
        _assert_close(warm_run[i][0], params)
        np.testing.assert_allclose(warm_run[i][2], loss, rtol=1e-12)
        assert int(warm_run[i][1].warm_start_state.steps_taken) == i + 1 and not bool(warm_run[i][1].switched)
    opt_state = TRANSFORM.init(eqx.filter(PARAMS, eqx.is_inexact_array))
    for i in range(3, 5):
        params, opt_state, loss = _kfac_step(params, opt_state, BATCHES[i], KEYS[i])
        _assert_close(warm_run[i][0], params)
        np.testing.assert_allclose(warm_run[i][2], loss, rtol=1e-12)
        assert int(warm_run[i][1].warm_start_state.steps_taken) == 3 and bool(warm_run[i][1].switched)
    for g, w in zip(jax.tree.leaves(warm_run[-1][1].opt_state), jax.tree.leaves(opt_state), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-14)


def test_a_state_saves_and_loads_after_the_switch(warm_run, tmp_path):
    training = eqx_kfac.OptaxTraining(_loss, TRANSFORM, eqx_kfac.WarmStart(3, ADAM))
    params, state, _ = warm_run[3]
    eqx.tree_serialise_leaves(tmp_path / "state.eqx", state)
    loaded = eqx.tree_deserialise_leaves(tmp_path / "state.eqx", training.init(PARAMS))
    assert bool(loaded.switched) and int(loaded.warm_start_state.steps_taken) == 3
    params, _, _ = training.step(params, loaded, BATCHES[4], key=KEYS[4])
    _assert_close(params, warm_run[4][0])


def test_each_program_compiles_once_the_transformations_in_the_background():
    compiled = []

    def listener(event, seconds, fun_name="", **kwargs):
        if event.endswith("backend_compile_duration"):
            compiled.append(fun_name)

    loss = lambda m, b: _loss(m, b)  # (a new function: programs of its own)
    training = eqx_kfac.OptaxTraining(loss, TRANSFORM, eqx_kfac.WarmStart(2, ADAM))
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        runs = _train(training, 5)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert bool(runs[-1][1].switched) and int(runs[-1][1].warm_start_state.steps_taken) == 2
    assert compiled.count("jit(_transformation_step)") == 1
    assert compiled.count("jit(_warm_step)") == 1


def test_switch_when_ready_switches_once_compiled():
    loss = lambda m, b: _loss(m, b)
    training = eqx_kfac.OptaxTraining(loss, TRANSFORM, eqx_kfac.WarmStart(10_000, ADAM, switch_when_ready=True))
    params, state, calls = PARAMS, training.init(PARAMS), 0
    while not bool(state.switched):
        params, state, loss_value = training.step(params, state, BATCHES[0], key=KEYS[calls % 6])
        calls += 1
        time.sleep(0.05)
        assert calls < 2000
    taken = int(state.warm_start_state.steps_taken)
    assert calls == taken + 1 and 1 <= taken < 10_000 and np.isfinite(loss_value)


def test_a_non_finite_warm_step_keeps_the_parameters():
    training = eqx_kfac.OptaxTraining(_loss, TRANSFORM, eqx_kfac.WarmStart(3, ADAM))
    state = training.init(PARAMS)
    bad = (BATCHES[0][0].at[0, 0].set(jnp.nan), BATCHES[0][1])
    params, state, loss = training.step(PARAMS, state, bad, key=KEYS[0])
    assert not np.isfinite(loss) and int(state.warm_start_state.steps_taken) == 1
    assert all(jnp.array_equal(a, b) for a, b in zip(_arrays(params), _arrays(PARAMS)))
    for g, w in zip(jax.tree.leaves(state.warm_start_state.transformation_state),
                    jax.tree.leaves(training.init(PARAMS).warm_start_state.transformation_state)):
        np.testing.assert_array_equal(g, w)


def test_inside_a_users_jit_and_without_a_warm_start_the_steps_are_the_transformations():
    """No warm start, or the step traced by the user's `jit`: `kfac_optax` from the first call
    (the warm start's state kept as it was)."""
    warm = eqx_kfac.OptaxTraining(_loss, TRANSFORM, eqx_kfac.WarmStart(3, ADAM))
    jitted = eqx.filter_jit(lambda p, s, b, k: warm.step(p, s, b, key=k))
    plain = eqx_kfac.OptaxTraining(_loss, TRANSFORM)
    params, opt_state = PARAMS, TRANSFORM.init(eqx.filter(PARAMS, eqx.is_inexact_array))
    states = {"jit": warm.init(PARAMS), "plain": plain.init(PARAMS)}
    models = {"jit": PARAMS, "plain": PARAMS}
    assert states["plain"].warm_start_state is None and bool(states["plain"].switched)
    for i in range(2):
        params, opt_state, _ = _kfac_step(params, opt_state, BATCHES[i], KEYS[i])
        models["jit"], states["jit"], _ = jitted(models["jit"], states["jit"], BATCHES[i], KEYS[i])
        models["plain"], states["plain"], _ = plain.step(models["plain"], states["plain"], BATCHES[i], key=KEYS[i])
        _assert_close(models["jit"], params)
        _assert_close(models["plain"], params)
    assert int(states["jit"].warm_start_state.steps_taken) == 0 and not bool(states["jit"].switched)


def test_a_plain_optax_transformation_and_a_loss_with_aux_and_two_arguments():
    def loss_with_aux(model, scale, batch):
        loss = scale * _loss(model, batch)
        return loss, {"double": 2 * loss}

    sgd = optax.sgd(0.1)
    training = eqx_kfac.OptaxTraining(loss_with_aux, sgd, eqx_kfac.WarmStart(1, ADAM), has_aux=True)
    state, scale = training.init(PARAMS), jnp.asarray(0.5)
    params, state, (loss0, _) = training.step(PARAMS, state, 1.0, BATCHES[0])
    params, state, (loss1, aux) = training.step(params, state, scale, BATCHES[1])
    adam_params, _, want0 = _adam_step(PARAMS, ADAM.init(eqx.filter(PARAMS, eqx.is_inexact_array)), BATCHES[0])
    want1, grads = eqx.filter_value_and_grad(lambda m: scale * _loss(m, BATCHES[1]))(adam_params)
    _assert_close(params, eqx.apply_updates(adam_params, jax.tree.map(lambda g: -0.1 * g, grads)))
    np.testing.assert_allclose([loss0, loss1, aux["double"]], [want0, want1, 2 * want1], rtol=1e-12)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        # (The suite's run-time type checks refuse these first, naming the parameter too.)
        (dict(loss_fn=3, transformation=TRANSFORM), "loss_fn"),
        (dict(loss_fn=_loss, transformation=ADAM.update), "GradientTransformation"),
        (dict(loss_fn=_loss, transformation=TRANSFORM, warm_start=5), "warm_start"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(TypeError, match=match):
        eqx_kfac.OptaxTraining(**kwargs)



_ENDS_WHILE_COMPILING = """
import atexit, threading
import jax, jax.numpy as jnp, equinox as eqx, optax, eqx_kfac
def compiling():
    return [t for t in threading.enumerate() if t.name == "eqx_kfac-compile" and t.is_alive()]
# (Run after the interpreter has waited for the threads that are not daemons.)
atexit.register(lambda: print("compiling at exit:", len(compiling()), flush=True))
def loss_fn(m, b):
    logits = jax.vmap(m)(b[0])
    eqx_kfac.register_softmax_cross_entropy_loss(logits, b[1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b[1]).mean()
model = eqx.nn.MLP(16, 4, 32, 25, key=jax.random.key(0))
batch = (jnp.ones((8, 16)), jnp.zeros(8, jnp.int32))
training = eqx_kfac.OptaxTraining(loss_fn, eqx_kfac.kfac_optax(loss_fn, (model, batch)), eqx_kfac.WarmStart(100))
state = training.init(model)
for i in range(2):
    model, state, loss = training.step(model, state, batch, key=jax.random.key(i))
print("compiling after the steps:", len(compiling()), flush=True)
"""


@pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml): a process of its own
def test_a_script_that_ends_while_the_step_compiles_waits_for_it():
    # The compiling thread was a daemon: still inside XLA's compiler when the interpreter shut
    # down, it could abort the process after the script's work was done (flax_examples.py
    # --warm-start 150 --when-ready: exit code 134, "FATAL: exception not rethrown").
    done = subprocess.run([sys.executable, "-c", _ENDS_WHILE_COMPILING], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compiling after the steps: 1" in done.stdout and "compiling at exit: 0" in done.stdout, done.stdout
