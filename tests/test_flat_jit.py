"""`_core/flat_jit.FlatJit`: `eqx.filter_jit`'s partition of the arguments, a cached structure,
donation by argument, and placement only of what does not lie where the first call placed it."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_kfac._core.flat_jit import FlatJit


class _Pair(eqx.Module):
    a: jax.Array
    b: jax.Array
    label: str = eqx.field(static=True)


def _fn(pair, scale, n):
    # `scale` an array, `n` a Python int (static): the outputs mix arrays and Python values.
    return _Pair(pair.a * scale, pair.b + n, pair.label + "!"), {"n": n, "sum": jnp.sum(pair.a)}


def _traces(fn):
    count = []

    def counted(*args):
        count.append(1)
        return fn(*args)

    counted.__name__ = counted.__qualname__ = fn.__name__
    return counted, count


def test_matches_filter_jit_and_traces_once_per_structure():
    counted, count = _traces(_fn)
    program = FlatJit(counted)
    pair = _Pair(jnp.arange(3.0), jnp.ones(2), "p")
    for scale in (2.0, 3.0):
        got = program(pair, np.float64(scale), 4)
        want = eqx.filter_jit(_fn)(pair, np.float64(scale), 4)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(g, w)
    assert got[0].label == "p!" and got[1]["n"] == 4 and isinstance(got[1]["n"], int)
    assert len(count) == 1
    program(pair, np.float64(2.0), 5)  # another static value
    program(_Pair(jnp.arange(4.0), jnp.ones(2), "p"), np.float64(2.0), 4)  # another shape
    program(_Pair(jnp.arange(3.0), jnp.ones(2), "q"), np.float64(2.0), 4)  # another static field
    assert len(count) == 4


def test_donates_the_arrays_of_the_arguments_named():
    program = FlatJit(lambda x, y: (jax.tree.map(lambda u: u + 1.0, x), y * 2.0), donate_args=frozenset({0}))
    x, y = {"u": jnp.ones(3), "v": jnp.zeros(2)}, jnp.ones(4)
    out = program(x, y)
    np.testing.assert_array_equal(out[0]["u"], 2.0)
    assert x["u"].is_deleted() and x["v"].is_deleted()
    assert not y.is_deleted()


def test_inside_a_trace_the_program_is_inlined_without_compiler_options():
    program = FlatJit(lambda x, k: x * k, compiler_options={"xla_cpu_enable_fast_math": False})
    grads = jax.jit(jax.grad(lambda x: jnp.sum(program(x, 3))))(jnp.arange(3.0))
    np.testing.assert_array_equal(grads, 3.0)
    np.testing.assert_array_equal(program(jnp.arange(3.0), 3), [0.0, 3.0, 6.0])


def test_places_the_first_call_and_only_misplaced_arrays_later():
    mesh = jax.sharding.Mesh(jax.devices()[:4], ("data",))
    replicated = jax.NamedSharding(mesh, jax.sharding.PartitionSpec())
    split = jax.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    placed_calls = []

    def place(args):
        placed_calls.append(1)
        state, batch = args
        return jax.device_put(state, replicated), jax.device_put(batch, split)

    compiles = []
    listener = lambda name, *_, **__: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        program = FlatJit(lambda state, batch: state + jnp.mean(batch))
        state = jnp.zeros(3)
        for step in range(3):
            batch = np.full((8,), float(step))  # the caller's host arrays, every step
            state = program(state, batch, place=place)
            assert state.sharding == replicated
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    np.testing.assert_array_equal(state, 3.0)
    assert len(placed_calls) == 1
    assert len(compiles) == 1, compiles


def test_lower_compiles_the_program_a_later_call_runs():
    compiles = []
    listener = lambda name, *_, **__: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    program = FlatJit(lambda x: jnp.sin(x) * 2.0)
    x = jnp.arange(5.0)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        program.lower(x).compile()
        np.testing.assert_allclose(program(x), np.sin(np.arange(5.0)) * 2.0, rtol=1e-12)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compiles) == 1, compiles


@pytest.mark.parametrize("leaf", [1.5, "a string", None])
def test_non_array_leaves_are_static(leaf):
    counted, count = _traces(lambda x, s: (x, s))
    program = FlatJit(counted)
    out = program(jnp.ones(2), leaf)
    assert out[1] == leaf
    program(jnp.zeros(2), leaf)
    assert len(count) == 1
