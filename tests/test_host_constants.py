"""`host_built` (`_tracing/host_constants.py`): a program's constant outputs made on the host, the rest
compiled. Every output must equal what `eqx.filter_jit` of the same function returns, bit for
bit, with the same dtype, weak type, sharding and commitment; and the constants compile nothing.
Checked on a function with each operation evaluated on the host, and on the optimizer states
`init` builds with it (one device, kfac-jax's replicated convention, the sharded state).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_kfac
from eqx_kfac._tracing.host_constants import host_built
from eqx_kfac._optim import compilation


def _same(built, expected):
    """Equal leaves (bit for bit; keys by their data), dtypes, weak types, shardings, commitment."""
    leaves, reference = jax.tree.leaves(built), jax.tree.leaves(expected)
    assert jax.tree.structure(built) == jax.tree.structure(expected)
    for k, (a, b) in enumerate(zip(leaves, reference, strict=True)):
        if not eqx.is_array(b):
            assert a == b, k
            continue
        assert (a.dtype, a.shape, jax.typeof(a).weak_type) == (b.dtype, b.shape, jax.typeof(b).weak_type), k
        assert a.sharding == b.sharding and a.committed == b.committed, (k, a.sharding, b.sharding)
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(k))


def _mesh():
    return Mesh(np.array(jax.devices()), ("d",))


def _constants_and_more(params, key, constrained=True):
    ones = jnp.ones((2, 3), jnp.bfloat16)
    iota = jax.lax.broadcasted_iota(jnp.int32, (3, 4), 1)
    return dict(
        zeros=jnp.zeros((4, 5)),
        eye=jnp.eye(4),
        nested=jax.jit(lambda: jnp.eye(3, dtype=jnp.float32))(),
        selected=jnp.where(iota == 2, jnp.float32(7.5), jnp.float32(-1.0)),
        reshaped=jnp.concatenate([ones, ones.astype(jnp.float32).T.reshape(2, 3)], axis=0).astype(jnp.float16),
        squeezed=jnp.squeeze(jnp.full((1, 3, 1), 3, jnp.int8)),
        constrained=jax.lax.with_sharding_constraint(jnp.zeros((4, 2)), NamedSharding(_mesh(), P("d", None)))
        if constrained else None,
        counter=jnp.zeros((), jnp.int32),
        weak=jnp.asarray(0.5) * 0,  # weakly typed: compiled
        split=jax.random.split(key),  # from an argument: compiled
        copied=jax.tree.map(jnp.zeros_like, params),
        moved=jax.tree.map(lambda p: 2 * p, params),  # from an argument: compiled
        tag="static",
    )


@pytest.mark.parametrize("where", ["uncommitted", "committed", "several devices"])
def test_host_built_equals_the_compiled_program(where):
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.float32)}
    if where == "committed":
        params = jax.device_put(params, jax.devices()[2])
    elif where == "several devices":
        params = jax.device_put(params, NamedSharding(_mesh(), P()))
    key = jax.random.key(4)
    # (A program's sharding constraint and its arguments must be on the same devices.)
    constrained = where != "committed"
    built = host_built(_constants_and_more, {})(params, key, constrained)
    _same(built, eqx.filter_jit(_constants_and_more)(params, key, constrained))
    if where != "several devices":
        assert built["zeros"].sharding == built["moved"]["w"].sharding


@pytest.mark.parametrize("shape, spec", [
    ((1,), P("d")), ((4, 1), P("d", "m")), ((4, 1), P("m", "d")), ((2, 2), P(("d", "m"))),
    ((2, 2), P("m", None)), ((1, 4), P(("d", "m"), None)),
])
def test_a_constrained_output_has_the_compiled_programs_sharding(shape, spec):
    # A compiled program reports its outputs' shardings without mesh axes of size 1 and trailing
    # `None`s: an equal layout is no equal sharding, and a step compiled for one is another program.
    names = ("d", "m")[: len(shape)]
    sharding = NamedSharding(Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names), spec)

    def fn(key):
        return jax.lax.with_sharding_constraint(jnp.eye(4), sharding), jax.random.split(key)

    key = jax.random.key(0)
    _same(host_built(fn, {})(key), eqx.filter_jit(fn)(key))


def test_constants_compile_nothing(xla_compilations):
    def constants(params, key):
        out = _constants_and_more(params, key)
        return {k: out[k] for k in ("zeros", "eye", "nested", "selected", "reshaped", "squeezed")}

    def constrained(params, key):  # (every output constrained: the program's devices do not matter)
        return _constants_and_more(params, key)["constrained"]

    params, key = {"w": jnp.ones((2, 3))}, jax.random.key(0)
    for fn in (constants, constrained):
        built = host_built(fn, {})
        assert xla_compilations(lambda: jax.block_until_ready(built(params, key)), clear=False) == 0
    # With outputs to compute, one program (once), of them alone.
    built = host_built(_constants_and_more, {})
    assert xla_compilations(lambda: jax.block_until_ready(built(params, key))) == 1
    assert xla_compilations(lambda: jax.block_until_ready(built(params, key)), clear=False) == 0


def _loss(model, batch):
    x, y = batch
    logits = jax.vmap(model)(x)
    eqx_kfac.register_softmax_cross_entropy_loss(logits, y)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


_MODEL = eqx.nn.MLP(6, 4, 8, 2, key=jax.random.key(0))
_BATCH = (jax.random.normal(jax.random.key(1), (8, 6)), jax.random.randint(jax.random.key(2), (8,), 0, 4))


def _init_both_ways(monkeypatch, optimizer, *args):
    """The state `init` builds (host constants), and the one the whole program compiles."""
    built = optimizer.init(*args)
    monkeypatch.setattr(compilation, "_STATE_PROGRAM", eqx.filter_jit(compilation._build_state))
    return built, optimizer.init(*args)


@pytest.mark.parametrize("configuration", ["default", "cached inverses", "eigenbasis adam", "sharded state"])
def test_optimizer_states_equal_the_compiled_programs(configuration, monkeypatch):
    options, model = {}, _MODEL
    if configuration == "cached inverses":
        options = dict(refresh=eqx_kfac.RefreshSchedule(cache_inverses=True), damping_rule=eqx_kfac.GivenDamping())
    elif configuration == "eigenbasis adam":
        options = dict(direction=eqx_kfac.EigenbasisAdam())
    elif configuration == "sharded state":
        mesh = _mesh()
        options = dict(devices=eqx_kfac.MultiDevice(mesh, axis_name="d", shard_state=True))
        model = eqx.filter_shard(model, eqx_kfac.sharding_by_size(model, mesh))
    optimizer = eqx_kfac.Optimizer(eqx.filter_value_and_grad(_loss), **options)
    _same(*_init_both_ways(monkeypatch, optimizer, model, jax.random.key(3), _BATCH))


def _dict_loss(params, batch):
    x, y = batch
    logits = x @ params["w"] + params["b"]
    eqx_kfac.register_softmax_cross_entropy_loss(logits, y)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def test_the_kfac_jax_replicated_state_equals_the_compiled_program(monkeypatch):
    kfac_jax = eqx_kfac.kfac_jax
    optimizer = kfac_jax.Optimizer(
        jax.value_and_grad(_dict_loss), l2_reg=0.0, multi_device=True, use_adaptive_damping=True,
        use_adaptive_learning_rate=True, use_adaptive_momentum=True, initial_damping=1.0,
    )
    n = jax.local_device_count()
    params = {"w": jax.random.normal(jax.random.key(5), (6, 4)), "b": jnp.zeros(4)}
    params = kfac_jax.utils.replicate_all_local_devices(params)
    key = kfac_jax.utils.replicate_all_local_devices(jax.random.key(3))
    batch = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), _BATCH)
    built, expected = _init_both_ways(monkeypatch, optimizer, params, key, batch)
    _same(built, expected)
    assert all(x.sharding.device_set == set(jax.local_devices()) for x in jax.tree.leaves(built) if eqx.is_array(x))


def test_an_operation_the_host_cannot_evaluate_is_compiled(monkeypatch, xla_compilations):
    # A case a NumPy rule does not cover (here: every iota raising) leaves the outputs computed
    # from it to the compiled program, with the same values, instead of failing `init`.
    from eqx_kfac._tracing import host_constants

    def failing(*args, **kwargs):
        raise ValueError("not covered")

    def eye_and_zeros(params):
        return jnp.eye(3), jnp.zeros(2)

    monkeypatch.setitem(host_constants._RULES, "iota", failing)
    params = {"w": jnp.ones(2)}
    built = host_built(eye_and_zeros, {})
    assert xla_compilations(lambda: _same(built(params), eqx.filter_jit(eye_and_zeros)(params))) == 2
