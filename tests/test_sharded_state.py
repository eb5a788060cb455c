"""Sharded state: `Optimizer(devices=MultiDevice(mesh, shard_state=True))` over a 2 x 2 mesh of the 4
host CPU devices (conftest), and the runnable example of docs/distributed.md.

The step is one SPMD program over global arrays: it must equal the single-device step, keep the
state laid out by `sharding_by_size` and the parameters as the caller placed them, and hold per
device a fraction of what the replicated (`shard_map`) layout holds, read off XLA's compiled
memory analysis. `benchmarks/scale.py` measures the same on 8 devices (a 2 x 4 mesh).
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_kfac
from doc_pages import DOCS


N_IN, WIDTH, N_OUT, BATCH, STEPS, STACK = 8, 16, 4, 16, 3, 4
# Given coefficients, eigendecompositions, and the sampled Fisher: the SPMD program draws the same
# samples as one device (one key). (The docs example has adaptive ones.)
GIVEN = dict(learning_rate=0.1, momentum=0.5, damping=1e-2)
# The learning rate and momentum adapted within the recommended bounds (the damping given).
ADAPTIVE_STEP = eqx_kfac.MomentumStep(
    eqx_kfac.AdaptiveHyperparameter(0.0, 10.0), eqx_kfac.AdaptiveHyperparameter(-0.95, 0.95),
    max_predicted_decrease=0.5,
)


def _mesh():
    return Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))


def _scan():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(WIDTH, WIDTH, use_bias=False, key=k))(
        jax.random.split(k2, STACK)
    )
    return (eqx.nn.Linear(N_IN, WIDTH, use_bias=False, key=k1), layers,
            eqx.nn.Linear(WIDTH, N_OUT, use_bias=False, key=k3))


def _scan_logits(model, x):
    first, layers, head = model
    dynamic, static = eqx.partition(layers, eqx.is_array)

    def forward(v):
        body = lambda h, layer: (jnp.tanh(eqx.combine(layer, static)(h)), None)  # noqa: E731
        return head(jax.lax.scan(body, jnp.tanh(first(v)), dynamic)[0])

    return jax.vmap(forward)(x)


def _problem():
    def loss(model, batch):
        x, y = batch
        logits = _scan_logits(model, x)
        eqx_kfac.register_softmax_cross_entropy_loss(logits, y)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    batch = (jax.random.normal(jax.random.key(1), (BATCH, N_IN)),
             jax.random.randint(jax.random.key(2), (BATCH,), 0, N_OUT))
    return loss, _scan(), batch


def _optimizer(loss, devices=None, step_rule=eqx_kfac.MomentumStep()):
    return eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(loss), l2_reg=1e-3,
        curvature=eqx_kfac.CurvatureOptions(estimation_mode="fisher_gradients"),
        refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=1, inverse_update_period=2),
        direction=eqx_kfac.PreconditionedGradient(exact_inverses=True),
        step_rule=step_rule, damping_rule=eqx_kfac.GivenDamping(), devices=devices,
    )


def _run(optimizer, model, batch):
    """`STEPS` steps through one compiled program; also its compiled memory analysis."""
    state = optimizer.init(model, jax.random.key(3), batch)
    step = jax.jit(lambda p, s, k: optimizer.step(p, s, k, batch=batch, **GIVEN))
    compiled = step.lower(model, state, jax.random.key(0)).compile()
    for i in range(STEPS):
        model, state, stats = compiled(model, state, jax.random.key(10 + i))
    return model, state, stats, compiled.memory_analysis()


def _flat(tree):
    return np.concatenate([np.ravel(a) for a in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))])


def _laid_out(tree, shardings):
    """Whether every array of `tree` has the sharding given for it (up to the spec's spelling)."""
    arrays = jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    pairs = zip(arrays, jax.tree.leaves(shardings), strict=True)
    return all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in pairs)


def _bytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def test_sharded_steps_equal_single_device_in_a_fraction_of_the_memory():
    loss, model, batch = _problem()
    single, single_state, single_stats, _ = _run(_optimizer(loss), model, batch)
    mesh = _mesh()
    placed = eqx.filter_shard(model, eqx_kfac.sharding_by_size(model, mesh))
    optimizer = _optimizer(loss, eqx_kfac.MultiDevice(mesh, axis_name="data", shard_state=True))
    multi, state, stats, memory = _run(optimizer, placed, batch)

    update = _flat(single) - _flat(model)
    assert np.linalg.norm(_flat(multi) - _flat(single)) <= 1e-8 * np.linalg.norm(update)
    for key in ("loss", "learning_rate", "momentum", "damping", "data_seen", "batch_size"):
        np.testing.assert_allclose(stats[key], single_stats[key], rtol=1e-9, err_msg=key)
    # The layout holds after the steps: the state as `sharding_by_size` says, parameters as placed.
    assert _laid_out(state, eqx_kfac.sharding_by_size(state, mesh))
    assert _laid_out(multi, [x.sharding for x in jax.tree.leaves(eqx.filter(placed, eqx.is_array))])
    # Every factor and cached eigendecomposition is split; the stacked ones along the stack.
    blocks = state.estimator_state.block_states
    assert all(x.sharding.spec != P() for x in jax.tree.leaves(blocks) if x.ndim >= 1)
    assert all(x.sharding.spec[0] == ("data", "model") for x in jax.tree.leaves(blocks[1]) if x.ndim == 3)
    # Per device (XLA's compiled memory analysis), the step's arguments (parameters, state, a
    # batch shard) take at most a third of what the replicated layout keeps on every device: all
    # parameters and all of the state.
    replicated = _bytes((single, single_state))
    assert memory.argument_size_in_bytes <= replicated / 3, (memory.argument_size_in_bytes, replicated)


@pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)
def test_the_docs_example_equals_one_device():
    """The runnable example of docs/distributed.md ("Sharded state"), against one device."""
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", (DOCS / "distributed.md").read_text(), re.DOTALL)
               if "shard_state=True" in b and "eqx.nn.MLP" in b]
    page = {"__name__": "distributed_example"}
    exec(compile(code, "distributed.md", "exec"), page)
    optimizer = eqx_kfac.Optimizer(eqx.filter_value_and_grad(page["loss"]), **page["options"])
    single, state = page["model"], optimizer.init(page["model"], jax.random.key(3), page["batch"])
    for i in range(3):
        single, state, stats = optimizer.step(single, state, jax.random.key(10 + i), batch=page["batch"])
    update = _flat(single) - _flat(page["model"])
    assert np.linalg.norm(_flat(page["params"]) - _flat(single)) <= 1e-8 * np.linalg.norm(update)
    np.testing.assert_allclose(page["stats"]["loss"], stats["loss"], rtol=1e-9)
    assert _laid_out(page["state"], eqx_kfac.sharding_by_size(page["state"], page["mesh"]))


def test_sharding_by_size():
    mesh = _mesh()
    tree = dict(
        stack=jnp.zeros((4, 6, 6)),  # a stack of matrices: along the stack
        matrix=jnp.zeros((8, 12)),  # the largest axis that 4 divides
        odd=jnp.zeros((17, 17)),  # nothing divides: replicated
        half=jnp.zeros((6, 3)),  # 4 divides nothing, one axis of 2 divides 6
        scalar=jnp.zeros(()),
        other="not an array",
    )
    specs = eqx_kfac.sharding_by_size(tree, mesh)
    assert specs["stack"].spec == P(("data", "model"), None, None)
    assert specs["matrix"].spec == P(None, ("data", "model"))
    assert specs["odd"].spec == P() and specs["scalar"].spec == P()
    assert specs["half"].spec in (P("data", None), P("model", None))
    assert specs["other"] is None
    assert isinstance(specs["matrix"], NamedSharding) and specs["matrix"].mesh == mesh
    only_model = eqx_kfac.sharding_by_size(tree, mesh, axis_names=("model",))
    assert only_model["matrix"].spec == P(None, "model")


def test_shard_state_needs_multi_device():
    # kfac-jax's keywords: `MultiDevice(shard_state=True)` is multi-device by itself.
    loss, _, _ = _problem()
    with pytest.raises(ValueError, match="shard_state=True shards the state .*needs multi_device=True"):
        eqx_kfac.kfac_jax.Optimizer(eqx.filter_value_and_grad(loss), l2_reg=0.0, shard_state=True)


def test_a_replicated_then_a_sharded_step_of_one_loss():
    """The loss's trace is cached per abstract mesh: one made under the replicated layout's
    `shard_map` (mesh axes Manual) and reused by the sharded SPMD step (Auto) mixed the two meshes
    in the quadratic model (`ValueError: Mesh for all inputs should be equal`, seen in
    `benchmarks/scale.py --quick`). The sharded step equals the single-device one (the
    replicated one draws its Fisher samples per device, so it differs from both)."""
    loss, model, batch = _problem()
    adaptive = dict(step_rule=ADAPTIVE_STEP)

    def run(optimizer, params):
        state = optimizer.init(params, jax.random.key(3), batch)
        step = jax.jit(lambda p, s, k: optimizer.step(p, s, k, batch=batch, damping=1e-2))
        return step(params, state, jax.random.key(0))[0]

    # The replicated step first, as in the benchmark: its trace is the first one made. On a
    # 1 x 1 mesh no value varies over a mesh axis, so only the mesh tells the traces apart.
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    replicated = run(_optimizer(loss, eqx_kfac.MultiDevice(mesh, axis_name="data"), **adaptive), model)
    placed = eqx.filter_shard(model, eqx_kfac.sharding_by_size(model, mesh))
    sharded = run(
        _optimizer(loss, eqx_kfac.MultiDevice(mesh, axis_name="data", shard_state=True), **adaptive),
        placed,
    )
    single = run(_optimizer(loss, **adaptive), model)
    update = np.linalg.norm(_flat(single) - _flat(model))
    assert np.isfinite(_flat(replicated)).all()
    assert np.linalg.norm(_flat(sharded) - _flat(single)) <= 1e-8 * update
