"""Multi-device execution: the `shard_map` step equals the single-device step on the global batch
(the mesh and block-assignment helpers of `eqx_kfac._core.distributed` are tested on purpose).

Run with the 4 host CPU devices of conftest. Also run as a script (`python test_distributed.py
worker ...`) by the multi-host test: two processes with two CPU devices each, a localhost
coordinator and gloo collectives.
"""

import functools
import os
import socket
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


N_IN, N_HIDDEN, N_OUT, BATCH, STEPS = 3, 5, 4, 16, 4
FIXED = dict(learning_rate=0.1, momentum=0.5, damping=1e-2)


def _mlp(key):
    k1, k2 = jax.random.split(key)
    return (eqx.nn.Linear(N_IN, N_HIDDEN, key=k1), eqx.nn.Linear(N_HIDDEN, N_OUT, key=k2))


def _loss(model, batch):
    from eqx_kfac import register_softmax_cross_entropy_loss

    x, y = batch
    logits = jax.vmap(lambda v: model[1](jnp.tanh(model[0](v))))(x)
    register_softmax_cross_entropy_loss(logits, y)
    picked = jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def _problem():
    model = _mlp(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, N_IN))
    y = jax.random.randint(jax.random.key(2), (BATCH,), 0, N_OUT)
    return model, (x, y)


def _flat(tree):
    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))
    return np.concatenate([np.ravel(np.asarray(a)) for a in leaves])


def _optimizer(mode, setting, num_burnin_steps=1, devices=None, distributed=True):
    """"adaptive": the recommended rules with the damping from 1, adapted every 2 steps; "fixed":
    `FIXED` given to `step`. `distributed`: the direction's (and `devices`' inverses')."""
    import eqx_kfac

    if setting == "adaptive":
        rules = dict(damping_rule=eqx_kfac.LevenbergMarquardtDamping(1.0, interval=2, minimum=1e-6, fault_increase=2.0))
    else:
        rules = dict(step_rule=eqx_kfac.MomentumStep(), damping_rule=eqx_kfac.GivenDamping())
    return eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(_loss), l2_reg=1e-3, curvature=eqx_kfac.CurvatureOptions(estimation_mode=mode),
        refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=num_burnin_steps, inverse_update_period=2),
        direction=eqx_kfac.PreconditionedGradient(distributed=distributed), devices=devices, **rules,
    )


def _run(opt, setting, model, batch):
    """`STEPS` steps; returns the final parameters and the last stats."""
    step_kwargs = FIXED if setting == "fixed" else {}
    state = opt.init(model, jax.random.key(3), batch)
    stats = None
    for i in range(STEPS):
        model, state, stats = opt.step(
            model, state, jax.random.key(10 + i), batch=batch, **step_kwargs
        )
    return model, stats


# --- the worker of the multi-host test ------------------------------------------------------


def _worker(process_id: int, port: int, out_path: str) -> None:
    """One of two processes: 2 local CPU devices each, 4 global, one global mesh."""
    from jax.sharding import NamedSharding, PartitionSpec

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id
    )
    from eqx_kfac import MultiDevice
    from eqx_kfac._core.distributed import data_mesh

    mesh = data_mesh("kfac_axis")
    model, (x, y) = _problem()
    half = BATCH // 2
    sharding = NamedSharding(mesh, PartitionSpec("kfac_axis"))
    local = slice(process_id * half, (process_id + 1) * half)
    batch = tuple(
        jax.make_array_from_process_local_data(sharding, np.asarray(a)[local]) for a in (x, y)
    )
    replicated = jax.device_put(model, NamedSharding(mesh, PartitionSpec()))
    opt = _optimizer("ggn_exact", "adaptive", devices=MultiDevice(mesh))
    replicated, stats = _run(opt, "adaptive", replicated, batch)
    # The sharded layout on a 2-D mesh (processes x local devices), as docs/distributed.md says.
    from eqx_kfac import sharding_by_size
    from jax.experimental import multihost_utils

    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, -1), ("kfac_axis", "model"))
    sharded = eqx.filter_shard(model, sharding_by_size(model, mesh))
    opt = _optimizer("ggn_exact", "adaptive", devices=MultiDevice(mesh, shard_state=True))
    sharded, _ = _run(opt, "adaptive", sharded, batch)
    sharded = jax.tree.map(lambda a: multihost_utils.process_allgather(a, tiled=True),
                           eqx.filter(sharded, eqx.is_array))
    np.savez(out_path, params=_flat(replicated), sharded=_flat(sharded),
             loss=np.asarray(stats["loss"]), devices=jax.device_count())
    jax.distributed.shutdown()


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    os.environ["JAX_PLATFORMS"] = "cpu"
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    sys.exit(0)


# --- tests ----------------------------------------------------------------------------------

import pytest  # noqa: E402
from jax.sharding import Mesh, PartitionSpec  # noqa: E402

from eqx_kfac._core.distributed import (  # noqa: E402
    assign_blocks,
    block_cost,
    data_mesh,
    fold_in_device,
)
from eqx_kfac import BlockDiagonalCurvature, MultiDevice  # noqa: E402


def _assert_same_update(model, single, multi):
    start = _flat(model)
    update = _flat(single) - start
    error = np.linalg.norm(_flat(multi) - _flat(single))
    assert error <= 1e-8 * np.linalg.norm(update), (error, np.linalg.norm(update))


@functools.cache
def _single_device(mode, setting, burnin):
    """The single-device run of `_run` (the reference), made once per configuration: the
    multi-device case with the burn-in and the two processes' test share theirs."""
    model, batch = _problem()
    return _run(_optimizer(mode, setting, burnin), setting, model, batch)


# Every mode, both settings, both inverse placements and a 2-D mesh, each at least once: three
# cases (a fourth, ggn_exact with given coefficients and distributed inverses on the 1-D mesh,
# repeated what these cover). The burn-in (its own program under `shard_map` before the first
# step) in one case: it costs a compilation more in each. That case is the two processes'
# configuration (ggn_exact, adaptive, with the burn-in), whose single-device reference is then
# computed once.
@pytest.mark.parametrize(
    "mode, setting, distributed, mesh_shape, burnin",
    [
        ("ggn_exact", "adaptive", False, None, 1),
        ("fisher_exact", "adaptive", True, None, 0),
        ("fisher_empirical", "fixed", True, (2, 2), 0),
    ],
)
def test_multi_device_steps_equal_single_device(mode, setting, distributed, mesh_shape, burnin):
    model, batch = _problem()
    mesh = None
    if mesh_shape is not None:
        # A 2-D mesh: the batch is split over the data axis and replicated over the other.
        mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), ("kfac_axis", "model"))
    single, single_stats = _single_device(mode, setting, burnin)
    opt = _optimizer(
        mode, setting, burnin, MultiDevice(mesh, distributed_inverses=distributed), distributed
    )
    multi, multi_stats = _run(opt, setting, model, batch)
    _assert_same_update(model, single, multi)
    for key in ("loss", "learning_rate", "momentum", "damping", "data_seen", "batch_size"):
        np.testing.assert_allclose(multi_stats[key], single_stats[key], rtol=1e-9, err_msg=key)
    assert int(multi_stats["batch_size"]) == BATCH


def test_uneven_batch_is_rejected():
    model, (x, y) = _problem()
    batch = (x[:14], y[:14])
    opt = _optimizer("ggn_exact", "fixed", devices=MultiDevice())
    # `init` traces the loss as the step does, on each device's share: it says so at once.
    with pytest.raises(ValueError, match=r"batch size 14.*multiple of 4"):
        opt.init(model, jax.random.key(0), batch)
    # A state made for an uneven batch later (an epoch's last batch) is refused by the step.
    state = opt.state_for_batch(opt.init(model, jax.random.key(0), (x[:16], y[:16])), batch)
    with pytest.raises(ValueError, match=r"batch size 14.*multiple of 4"):
        opt.step(model, state, jax.random.key(1), batch=batch, **FIXED)


def test_mesh_without_the_data_axis_is_rejected():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    with pytest.raises(ValueError, match=r"mesh has axes \('data',\) but the batch is split over .*'kfac_axis'"):
        MultiDevice(mesh)


def _sharded(fn, in_specs):
    mesh = data_mesh("d")
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(), check_vma=False)
    )


@pytest.mark.parametrize("mode", ["ggn_exact", "fisher_empirical"])
def test_estimator_inside_a_users_shard_map(mode):
    """Built outside on per-device shapes, updated inside with `axis_name`: the global statistics."""
    model, batch = _problem()
    params, static = eqx.partition(model, eqx.is_array)
    per_device = jax.tree.map(lambda a: a[: BATCH // 4], batch)
    estimator = BlockDiagonalCurvature(_loss, (model, per_device), default_estimation_mode=mode)
    state = estimator.init(jax.random.key(0))

    def body(p, s, b):
        s = estimator.update_curvature_matrix_estimate(
            s, 0.0, 1.0, BATCH // 4, jax.random.key(1), (eqx.combine(p, static), b),
            axis_name="d",
        )
        return estimator.to_dense_matrix(s)

    multi = _sharded(body, (PartitionSpec(), PartitionSpec(), PartitionSpec("d")))(
        params, state, batch
    )
    reference = BlockDiagonalCurvature(_loss, (model, batch), default_estimation_mode=mode)
    exact = eqx.filter_jit(lambda model, batch: reference.to_dense_matrix(reference.update_curvature_matrix_estimate(
        reference.init(jax.random.key(0)), 0.0, 1.0, BATCH, jax.random.key(1), (model, batch)
    )))(model, batch)  # one program (eagerly, one per operation)
    np.testing.assert_allclose(multi, exact, rtol=1e-10, atol=1e-12 * np.abs(exact).max())


def test_fisher_gradients_across_devices_is_unbiased():
    """The average over keys of the 4-device sampled estimate tends to the exact Fisher estimate."""
    model, batch = _problem()
    params, static = eqx.partition(model, eqx.is_array)
    per_device = jax.tree.map(lambda a: a[: BATCH // 4], batch)
    estimator = BlockDiagonalCurvature(_loss, (model, per_device))
    state = estimator.init(jax.random.key(0))
    num_keys = 400
    keys = jax.random.split(jax.random.key(5), num_keys)

    def body(p, s, b, keys):
        def one(key):
            new = estimator.update_curvature_matrix_estimate(
                s, 0.0, 1.0, BATCH // 4, fold_in_device(key, "d"), (eqx.combine(p, static), b),
                axis_name="d",
            )
            return estimator.to_dense_matrix(new)

        return jax.lax.map(one, keys)

    samples = np.asarray(_sharded(
        body, (PartitionSpec(), PartitionSpec(), PartitionSpec("d"), PartitionSpec())
    )(params, state, batch, keys))
    exact = eqx.filter_jit(lambda state, model, batch: estimator.to_dense_matrix(
        estimator.update_curvature_matrix_estimate(state, 0.0, 1.0, BATCH, jax.random.key(1), (model, batch), "fisher_exact")
    ))(state, model, batch)  # one program (eagerly, one per operation)
    mean = samples.mean(axis=0)
    standard_error = samples.std(axis=0, ddof=1) / np.sqrt(num_keys)
    # Entries with (numerically) zero variance are deterministic and must match exactly.
    tolerance = 5.0 * standard_error + 1e-10 * np.abs(exact).max()
    assert np.all(np.abs(mean - exact) <= tolerance), np.max(np.abs(mean - exact) - tolerance)
    # Not a vacuous check: the estimate does vary with the key.
    assert standard_error.max() > 1e-6


def test_fold_in_device_gives_every_device_its_own_key():
    def body(key):
        return jax.random.key_data(fold_in_device(key, "d"))[None]

    mesh = data_mesh("d")
    out = jax.shard_map(
        body, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec("d"), check_vma=False
    )(jax.random.key(0))
    assert len({tuple(np.asarray(k).ravel()) for k in out}) == len(jax.devices())


def test_block_assignment_balances_cost():
    costs = [block_cost(jnp.zeros((n, n))) for n in (8, 7, 6, 5, 4, 3, 2, 2)]
    owners = assign_blocks(costs, 4)
    loads = [sum(c for c, o in zip(costs, owners) if o == d) for d in range(4)]
    # Longest-processing-time-first: no device exceeds the mean load plus one block.
    assert max(loads) <= sum(costs) / 4 + max(costs)
    # The largest block is alone on its device (its cost exceeds all the others together / 3).
    assert sum(o == owners[0] for o in owners) == 1
    assert block_cost(jnp.zeros((3, 5))) == 15.0


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)
def test_two_processes_agree_with_one(tmp_path):
    """Two processes (2 CPU devices each, localhost coordinator) equal one device on the batch,
    with the state replicated and with it sharded over a 2 x 2 mesh."""
    from conftest import TEST_XLA_FLAGS

    port = _free_port()
    flags = "--xla_force_host_platform_device_count=2 " + TEST_XLA_FLAGS
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    env.pop("PYTEST_ADDOPTS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "worker", str(i), str(port), str(tmp_path / f"p{i}.npz")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    model, _ = _problem()
    single, single_stats = _single_device("ggn_exact", "adaptive", 1)
    for i in range(2):
        result = np.load(tmp_path / f"p{i}.npz")
        assert int(result["devices"]) == 4
        _assert_same_update(model, single, result["params"])
        _assert_same_update(model, single, result["sharded"])
        np.testing.assert_allclose(result["loss"], single_stats["loss"], rtol=1e-9)


def test_arguments_already_on_the_mesh_are_not_put_again():
    """The previous step's outputs are placed as the step takes them: `placed_on_mesh` returns
    them as they are (no `device_put` of the whole state at every step), and places others."""
    from eqx_kfac._core.distributed import placed_on_mesh

    mesh = data_mesh("d")
    args = (jnp.ones((3, 2)), jnp.arange(8.0), jnp.ones(()))
    placed = placed_on_mesh(args, mesh, "d", batch_index=1)
    assert placed is not args and placed[1].sharding.spec == PartitionSpec("d")
    again = placed_on_mesh(placed, mesh, "d", batch_index=1)
    assert len(again) == len(placed) and all(a is b for a, b in zip(again, placed))
