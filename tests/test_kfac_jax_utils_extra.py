"""The `kfac_jax.utils` names kfac-jax's `examples/training.py` uses besides the replicated
convention's helpers (issue 49): `default_add_function`, `MultiChunkAccumulator` (one device and
kfac-jax's replicated convention on the 4 host CPU devices), `serialize_state_tree` and
`host_all_gather`, each against NumPy or a structure written out by hand."""

import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_kfac.kfac_jax as kfac_jax

utils = kfac_jax.utils
RNG = np.random.default_rng(0)


def test_default_add_function_is_the_weighted_sum():
    x = {"a": RNG.normal(size=(3, 2)), "b": (RNG.normal(size=4),)}
    y = {"a": RNG.normal(size=(3, 2)), "b": (RNG.normal(size=4),)}
    out = utils.default_add_function(jax.tree.map(jnp.asarray, x), jax.tree.map(jnp.asarray, y), 0.3, -1.7)
    np.testing.assert_allclose(out["a"], 0.3 * x["a"] - 1.7 * y["a"], rtol=1e-12)
    np.testing.assert_allclose(out["b"][0], 0.3 * x["b"][0] - 1.7 * y["b"][0], rtol=1e-12)


def test_accumulator_on_one_device_is_the_weighted_mean():
    chunks = [{"w": RNG.normal(size=(2, 3)), "s": RNG.normal()} for _ in range(3)]
    weights = [2, 0.5, jnp.asarray(3.0)]
    acc = utils.MultiChunkAccumulator.empty(False)
    assert acc.value is None and acc.weight.shape == () and acc.multi_device is False
    for chunk, weight in zip(chunks, weights):
        acc.add(jax.tree.map(jnp.asarray, chunk), weight)
    total = 2 + 0.5 + 3.0
    expected = {k: sum(float(w) * c[k] for c, w in zip(chunks, weights)) for k in ("w", "s")}
    np.testing.assert_allclose(acc.accumulator["w"], expected["w"], rtol=1e-12)
    np.testing.assert_allclose(acc.weight, total, rtol=1e-12)
    copy = acc.copy()
    value = acc.value_and_clear()
    np.testing.assert_allclose(value["w"], expected["w"] / total, rtol=1e-12)
    np.testing.assert_allclose(value["s"], expected["s"] / total, rtol=1e-12)
    assert acc.accumulator is None and acc.weight is None
    # The copy holds the same arrays, and is a PyTree of the accumulator and the weight.
    np.testing.assert_allclose(copy.value["w"], expected["w"] / total, rtol=1e-12)
    leaves, treedef = jax.tree.flatten(copy)
    assert len(leaves) == 3 and jax.tree.unflatten(treedef, leaves).multi_device is False


def test_accumulator_refuses_what_kfac_jax_refuses():
    acc = utils.MultiChunkAccumulator.empty(False)
    with pytest.raises(ValueError, match="shape of the accumulator's weight"):
        acc.add({"x": jnp.ones(())}, jnp.ones(3))
    acc = utils.MultiChunkAccumulator.empty(False)
    acc.add({"x": jnp.ones(2)})
    with pytest.raises(ValueError, match="holds a non-empty PyTree"):
        acc.add({})
    acc = utils.MultiChunkAccumulator.empty(False)
    acc.add({})
    with pytest.raises(ValueError, match="holds an empty PyTree"):
        acc.add({"x": jnp.ones(2)})


def test_accumulator_on_devices_is_each_devices_mean_averaged():
    """kfac-jax's multi-device value is `pmean(accumulator / weight)`: each device's quotient,
    averaged over the devices, one copy on each (examples/training.py's evaluation adds `pmap`
    outputs with weight 1, then reads `get_first(value)` and `int(weight[0])`)."""
    n = jax.local_device_count()
    assert n == 4
    chunks = [RNG.normal(size=(n, 3)) for _ in range(3)]
    acc = utils.MultiChunkAccumulator.empty(True)
    assert acc.weight.shape == (n,) and acc.weight.dtype == jnp.int32
    for chunk in chunks:
        acc.add({"x": utils.broadcast_all_local_devices(jnp.asarray(chunk))}, 1)
    value = acc.value["x"]
    assert value.shape == (n, 3) and len(value.sharding.device_set) == n
    np.testing.assert_allclose(value, np.broadcast_to(sum(chunks).mean(axis=0) / 3, (n, 3)), rtol=1e-12)
    assert int(acc.weight[0]) == 3
    # Weights that differ between devices: the quotients are averaged, not the sums divided.
    weights = RNG.uniform(1, 2, size=n)
    uneven = utils.MultiChunkAccumulator({"x": utils.broadcast_all_local_devices(jnp.asarray(chunks[0]))},
                                         utils.broadcast_all_local_devices(jnp.asarray(weights)), True)
    expected = (chunks[0] / weights[:, None]).mean(axis=0)
    np.testing.assert_allclose(uneven.value["x"], np.broadcast_to(expected, (n, 3)), rtol=1e-12)
    zeros = utils.MultiChunkAccumulator.zeros_like({"x": value}, True)
    assert zeros.weight.dtype == jnp.int32 and zeros.weight.shape == (n,)
    np.testing.assert_array_equal(zeros.accumulator["x"], np.zeros((n, 3)))
    zeros.add({"x": value}, 2)
    np.testing.assert_allclose(zeros.value["x"], value, rtol=1e-12)


class _Inner(eqx.Module):
    a: jax.Array
    tag: str = eqx.field(static=True)


class _Outer(eqx.Module):
    inner: _Inner
    items: list
    nothing: None


class _Pair(typing.NamedTuple):
    left: jax.Array
    right: jax.Array


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def test_serialize_state_tree_writes_state_objects_as_dicts():
    """Modules without their static fields, kfac-jax's mutable average and a kfac-jax-style
    block `State` become dicts of their fields with `__class__`; containers are rebuilt (a
    named tuple as a tuple); anything else is returned as it is."""
    a, b, c, d = (jnp.full((2,), float(i)) for i in range(4))
    average = utils.WeightedMovingAverage(value=b, weight=c)
    block_state = kfac_jax.KroneckerFactored.State(cache={"x": d}, factors=(average,))
    tree = {"m": _Outer(_Inner(a, "t"), [1, "s", _Pair(b, c)], None), "avg": average, "state": block_state, "set": {3}}
    expected = {
        "m": {
            "inner": {"a": a, "__class__": _name(_Inner)},
            "items": [1, "s", (b, c)],
            "nothing": None,
            "__class__": _name(_Outer),
        },
        "avg": {"weight": c, "value": b, "__class__": _name(utils.WeightedMovingAverage)},
        "state": {
            "cache": {"x": d},
            "factors": ({"weight": c, "value": b, "__class__": _name(utils.WeightedMovingAverage)},),
            "__class__": _name(type(block_state)),
        },
        "set": {3},
    }
    out = utils.serialize_state_tree(tree)
    assert type(out["m"]["items"][2]) is tuple
    assert jax.tree.structure(out) == jax.tree.structure(expected)
    same = lambda x, y: x is y if isinstance(y, jax.Array) else (type(x), x) == (type(y), y)
    assert all(same(x, y) for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True))
    assert utils.serialize_state_tree(a) is a and utils.serialize_state_tree(None) is None


def test_serialize_state_tree_keeps_an_optimizer_states_arrays():
    """training.py sums the sizes of the serialised state's non-string leaves: they are the
    state's arrays, one for one."""

    def loss_fn(params, batch):
        x, y = batch
        logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
        kfac_jax.register_softmax_cross_entropy_loss(logits, y)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    optimizer = kfac_jax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss_fn), l2_reg=1e-3, value_func_has_aux=False,
        value_func_has_state=False, value_func_has_rng=False, use_adaptive_learning_rate=True,
        use_adaptive_momentum=True, use_adaptive_damping=True, initial_damping=1.0, multi_device=False,
    )
    key = jax.random.key(0)
    params = {"w1": jnp.asarray(RNG.normal(size=(3, 4))), "w2": jnp.asarray(RNG.normal(size=(4, 2)))}
    state = optimizer.init(params, key, (jnp.asarray(RNG.normal(size=(4, 3))), jnp.arange(4) % 2))
    out = utils.serialize_state_tree(state)
    arrays = [x for x in jax.tree.leaves(out) if not isinstance(x, str)]
    assert sorted(map(id, arrays)) == sorted(map(id, jax.tree.leaves(state)))
    assert out["__class__"] == _name(type(state)) and "batch_signature" not in out  # static
    assert out["examples_seen"]["__class__"].endswith("ExampleCount")


def test_host_all_gather_is_the_identity_in_one_process():
    tree = {"x": jnp.arange(3.0)}
    assert jax.process_count() == 1 and utils.host_all_gather(tree) is tree
