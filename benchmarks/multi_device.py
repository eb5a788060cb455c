"""Per-step time of the multi-device `Optimizer` on 1, 2 and 4 devices, and the share spent on caches.

An MLP classifier with K-FAC blocks, a fixed global batch; for each device count the step runs
under `shard_map` over a mesh of that many devices, with block work spread (`distributed`) or
repeated on every device (`redundant`). `inverse_update_period=2`: the table reports the median
time of a step that refreshes the cached inverses, of one that does not, and the share of the
refreshing step spent on the refresh, `(refresh - plain) / refresh`.

On this machine the devices are host CPU devices (`--xla_force_host_platform_device_count`) that
share the same cores: the figures are indicative only (they show overheads and the balance of
block work, not the speed-up of real accelerators).

    python benchmarks/multi_device.py            # default sizes
    python benchmarks/multi_device.py --quick    # small widths and few rounds
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# The mesh helper is internal: the public API takes any 1-D `jax.sharding.Mesh`.
from eqx_kfac import (  # noqa: E402
    GivenDamping, MomentumStep, MultiDevice, Optimizer, PreconditionedGradient, RefreshSchedule,
)
from eqx_kfac._core.distributed import data_mesh  # noqa: E402
from benchmarks.model_zoo.losses import cross_entropy  # noqa: E402
from benchmarks.model_zoo.tanh_mlp import TanhMLP  # noqa: E402


def loss_fn(model, batch):
    x, y = batch
    return cross_entropy(jax.vmap(model)(x), y)


def _block(out):
    jax.block_until_ready(jax.tree.leaves(eqx.filter(out, eqx.is_array)))


def time_steps(num_devices, distributed, sizes, batch_size, rounds):
    """Median seconds of a refreshing step and of a plain step."""
    model = TanhMLP(sizes, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (batch_size, sizes[0]), jnp.float32)
    y = jax.random.randint(jax.random.key(2), (batch_size,), 0, sizes[-1])
    batch = (x, y)
    opt = Optimizer(
        eqx.filter_value_and_grad(loss_fn),
        step_rule=MomentumStep(), damping_rule=GivenDamping(),  # given to every step
        refresh=RefreshSchedule(num_burnin_steps=0, inverse_update_period=2),
        direction=PreconditionedGradient(distributed=distributed),
        devices=MultiDevice(data_mesh("kfac_axis", jax.devices()[:num_devices]), distributed_inverses=distributed),
    )
    state = opt.init(model, jax.random.key(3), batch)
    hyper = dict(learning_rate=1e-2, momentum=0.9, damping=1e-1)
    states = {
        name: eqx.tree_at(lambda s: s.step_counter, state, jnp.asarray(counter))
        for name, counter in (("refresh", 2), ("plain", 1))
    }
    times = {name: [] for name in states}
    for name, s in states.items():
        _block(opt.step(model, s, jax.random.key(4), batch=batch, **hyper))
    for _ in range(rounds):
        for name, s in states.items():
            start = time.perf_counter()
            _block(opt.step(model, s, jax.random.key(4), batch=batch, **hyper))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small widths, few rounds")
    args = parser.parse_args()
    sizes = (32, 64, 64, 10) if args.quick else (256, 512, 512, 512, 10)
    batch_size = 64 if args.quick else 512
    rounds = 5 if args.quick else 20
    print(f"devices available: {jax.device_count()} ({jax.devices()[0].platform}); MLP {sizes}, "
          f"global batch {batch_size}, float32, median of {rounds} rounds")
    print("CPU host devices share the same cores: the figures are indicative only.\n")
    header = f"{'devices':>7}  {'blocks':<11}  {'refresh step':>12}  {'plain step':>10}  {'cache share':>11}"
    print(header)
    print("-" * len(header))
    for num_devices in (1, 2, 4):
        for distributed in (True, False):
            t = time_steps(num_devices, distributed, sizes, batch_size, rounds)
            share = max(t["refresh"] - t["plain"], 0.0) / t["refresh"]
            print(f"{num_devices:>7}  {'distributed' if distributed else 'redundant':<11}  "
                  f"{t['refresh'] * 1e3:>9.2f} ms  {t['plain'] * 1e3:>7.2f} ms  {share:>10.0%}")


if __name__ == "__main__":
    main()
