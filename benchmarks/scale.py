"""Scale study: per-device memory of parameters and K-FAC state with the state sharded, simulated on
host devices and projected to a 1B-parameter transformer, with the communication of a step.

**Simulation.** A decoder-only transformer (scan-stacked blocks, causal attention, a 4x MLP,
bias-free layers as in LLaMA-style models) is trained by `Optimizer(devices=MultiDevice(mesh,
shard_state=True))` on 1, 2, 4 and 8 host CPU devices (meshes 1x1, 2x1, 2x2, 2x4 of a data and a
model axis), parameters placed by `eqx_kfac.sharding_by_size`. For each, XLA's compiled memory
analysis of the step gives the bytes per device of its arguments (parameters, optimizer state and
a batch shard), outputs and temporaries, against the replicated layout (`MultiDevice(mesh)`
without `shard_state`: parameters and state whole on every device), and the compiled program's
collectives are summed (bytes per device of every all-gather, reduce-scatter, all-reduce,
all-to-all and collective-permute, each counted once: a step that refreshes the inverses runs
them all). The step on the largest mesh is compared with the single-device step on the same
global batch (relative difference of the parameters after 2 steps, against the update).

**Projection.** A 1B-parameter transformer of the same form (d = 2048, 20 blocks, 4x MLP, a
50,304-token tied embedding), its block sizes read from the shapes: per-device bytes of
parameters (bf16) and state (float32 velocities, Kronecker factors and their cached inverses),
replicated and sharded over 8, 64 and 256 devices, and the communication per step, from the same
count as the simulation's collectives (see `projected_communication`).

    python benchmarks/scale.py            # simulation (1, 2, 4, 8 devices) and projection
    python benchmarks/scale.py --quick    # a smaller model, 1 and 8 devices

Host devices share the same cores: memory and communication volumes are what XLA compiles for
the mesh, times are not measured.
"""

import os

# Eight host devices share this machine's cores: on a busy machine a device can reach a
# collective more than XLA's default 40 s after the others, which then abort the process.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_cpu_collective_call_terminate_timeout_seconds=1800"
    " --xla_cpu_collective_timeout_seconds=1800"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import eqx_kfac  # noqa: E402
# The layout rule of `sharding_by_size`, to project it to meshes larger than this machine's.
from eqx_kfac._core.distributed import _spec  # noqa: E402


# --- the model -----------------------------------------------------------------------------------


def _rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class Block(eqx.Module):
    """A pre-norm decoder block: causal multi-head attention and a 4x GELU MLP, no biases."""

    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, width, heads, key):
        keys = jax.random.split(key, 6)
        self.q, self.k, self.v, self.o = (
            eqx.nn.Linear(width, width, use_bias=False, key=k) for k in keys[:4]
        )
        self.up = eqx.nn.Linear(width, 4 * width, use_bias=False, key=keys[4])
        self.down = eqx.nn.Linear(4 * width, width, use_bias=False, key=keys[5])
        self.heads = heads

    def __call__(self, x):
        seq, width = x.shape
        h = _rms(x)
        q, k, v = (jax.vmap(f)(h).reshape(seq, self.heads, -1) for f in (self.q, self.k, self.v))
        scores = jnp.einsum("shd,thd->hst", q, k) / math.sqrt(width // self.heads)
        scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -1e9)
        attended = jnp.einsum("hst,thd->shd", jax.nn.softmax(scores, axis=-1), v).reshape(seq, width)
        x = x + jax.vmap(self.o)(attended)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(_rms(x))))


class Decoder(eqx.Module):
    """Token embedding, scan-stacked blocks, a bias-free head."""

    embed: eqx.nn.Embedding
    blocks: Block
    head: eqx.nn.Linear

    def __init__(self, vocab, width, depth, heads, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, width, key=k1)
        self.blocks = eqx.filter_vmap(lambda k: Block(width, heads, k))(jax.random.split(k2, depth))
        self.head = eqx.nn.Linear(width, vocab, use_bias=False, key=k3)

    def __call__(self, tokens):
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        body = lambda x, block: (eqx.combine(block, static)(x), None)  # noqa: E731
        x, _ = jax.lax.scan(body, jax.vmap(self.embed)(tokens), dynamic)
        return jax.vmap(self.head)(_rms(x))


def loss_fn(model, batch):
    tokens, targets = batch
    logits = jax.vmap(model)(tokens)
    # A per-token mean (over batch and positions): `mean_over="all"` scales the curvature to match.
    eqx_kfac.register_softmax_cross_entropy_loss(logits, targets, mean_over="all")
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)
    return -jnp.mean(picked)


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int
    width: int
    depth: int
    heads: int
    batch: int
    seq: int


SIMULATED = Config(vocab=256, width=64, depth=8, heads=4, batch=16, seq=16)
QUICK = Config(vocab=64, width=32, depth=8, heads=2, batch=8, seq=8)
MESHES = {1: (1, 1), 2: (2, 1), 4: (2, 2), 8: (2, 4)}


def _problem(config):
    model = Decoder(config.vocab, config.width, config.depth, config.heads, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (config.batch, config.seq + 1), 0, config.vocab)
    return model, (tokens[:, :-1], tokens[:, 1:])


def _optimizer(devices=None):
    """The recommended configuration with a burn-in of 1, inverses every 2 steps and no stop
    after faults in a row, on `devices` (a `MultiDevice`, or `None` for one device)."""
    return eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(loss_fn), l2_reg=1e-5,
        refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=1, inverse_update_period=2),
        guard=eqx_kfac.StepGuard(reject_loss_increase=True, max_consecutive_faults=None),
        devices=devices,
    )


# --- compiled programs: memory and collectives ---------------------------------------------------

_COLLECTIVE = re.compile(
    r"= (\(?[^=]*?\)?) (all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(?:-start)?\("
)
_SHAPE = re.compile(r"(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([0-9,]*)\]")
_BYTES = dict(pred=1, s8=1, u8=1, s16=2, u16=2, bf16=2, f16=2, s32=4, u32=4, f32=4, s64=8, u64=8, f64=8)


def collective_bytes(hlo_text):
    """Bytes per device of the results of every collective in a compiled (partitioned) HLO
    module, by kind, each op counted once."""
    totals = {}
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if match is None:
            continue
        shapes = _SHAPE.findall(match.group(1))
        size = sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in shapes)
        totals[match.group(2)] = totals.get(match.group(2), 0) + size
    return totals


@dataclasses.dataclass
class Measured:
    devices: int
    mesh: tuple[int, int]
    layout: str
    arguments: int
    outputs: int
    temporaries: int
    collectives: dict


def _compiled(optimizer, model, batch):
    state = optimizer.init(model, jax.random.key(3), batch)
    step = jax.jit(lambda p, s, k: optimizer.step(p, s, k, batch=batch))
    return step.lower(model, state, jax.random.key(0)).compile(), state


def measure(config, devices, layout):
    """The compiled step's memory per device and collectives on `devices` host devices."""
    model, batch = _problem(config)
    shape = MESHES[devices]
    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(shape), ("data", "model"))
    sharded = layout == "sharded"
    optimizer = _optimizer(eqx_kfac.MultiDevice(mesh, axis_name="data", shard_state=sharded))
    if sharded:
        model = eqx.filter_shard(model, eqx_kfac.sharding_by_size(model, mesh))
    compiled, _ = _compiled(optimizer, model, batch)
    memory = compiled.memory_analysis()
    return Measured(
        devices, shape, layout, memory.argument_size_in_bytes, memory.output_size_in_bytes,
        memory.temp_size_in_bytes, collective_bytes(compiled.as_text()),
    )


def _flat(tree):
    return np.concatenate([np.ravel(a) for a in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))])


def agreement(config, devices, steps=2):
    """Relative difference of the sharded and the single-device parameters after `steps` steps,
    against the size of the single-device update."""
    model, batch = _problem(config)
    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(MESHES[devices]), ("data", "model"))
    runs = {}
    for name, optimizer, start in (
        ("single", _optimizer(), model),
        ("sharded", _optimizer(eqx_kfac.MultiDevice(mesh, axis_name="data", shard_state=True)),
         eqx.filter_shard(model, eqx_kfac.sharding_by_size(model, mesh))),
    ):
        compiled, state = _compiled(optimizer, start, batch)
        params = start
        for i in range(steps):
            params, state, _ = compiled(params, state, jax.random.key(10 + i))
        runs[name] = _flat(params)
    update = np.linalg.norm(runs["single"] - _flat(model))
    return float(np.linalg.norm(runs["sharded"] - runs["single"]) / update)


def _bytes(n):
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def simulation_table(config, device_counts):
    rows = [
        "| devices | mesh (data x model) | arguments / device: replicated | sharded | sharded / "
        "replicated | temporaries / device: replicated | sharded | collectives / device (sharded) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in device_counts:
        replicated, sharded = measure(config, n, "replicated"), measure(config, n, "sharded")
        total = sum(sharded.collectives.values())
        kinds = ", ".join(f"{k} {_bytes(v)}" for k, v in sorted(sharded.collectives.items()))
        rows.append(
            f"| {n} | {sharded.mesh[0]} x {sharded.mesh[1]} | {_bytes(replicated.arguments)} | "
            f"{_bytes(sharded.arguments)} | {sharded.arguments / replicated.arguments:.3f} | "
            f"{_bytes(replicated.temporaries)} | {_bytes(sharded.temporaries)} | "
            f"{_bytes(total)}{f' ({kinds})' if kinds else ''} |"
        )
        print(rows[-1], flush=True)
    return rows


# --- the projection ------------------------------------------------------------------------------

BILLION = Config(vocab=50304, width=2048, depth=16, heads=16, batch=256, seq=2048)
PROJECTED_MESHES = ((1, 1), (2, 4), (8, 8), (32, 8))


def _abstract_state(config, param_dtype):
    """Parameters and optimizer state of `config` as shapes (built by `eqx.filter_eval_shape`:
    nothing is allocated), the state from the library's own `init`."""
    model = eqx.filter_eval_shape(
        lambda: jax.tree.map(
            lambda x: x.astype(param_dtype) if eqx.is_inexact_array(x) else x,
            Decoder(config.vocab, config.width, config.depth, config.heads, jax.random.key(0)),
        )
    )
    tokens = jax.ShapeDtypeStruct((8, 8), jnp.int32)  # the state does not depend on the batch
    state = eqx.filter_eval_shape(_optimizer().init, model, jax.random.key(0), (tokens, tokens))
    return model, state


def _leaves(tree):
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.ShapeDtypeStruct)]


def _per_device(leaves, mesh_shape):
    """Bytes per device of `leaves` laid out by `sharding_by_size` over a (data, model) mesh."""
    sizes = {"data": mesh_shape[0], "model": mesh_shape[1]}
    total = 0
    for x in leaves:
        spec = _spec(tuple(x.shape), sizes)
        names = [n for part in spec if part for n in ((part,) if isinstance(part, str) else part)]
        split = math.prod(sizes[n] for n in names)
        total += x.size * x.dtype.itemsize // split
    return total


def projected_communication(param_bytes, factor_bytes, devices, inverse_update_period=5, gathers=4):
    """Bytes per device moved by one step, by the data movement of each layout (ring collectives:
    a reduce-scatter or an all-gather moves `(N - 1) / N` of the array per device, an all-reduce
    twice that).

    Sharded layout (`shard_state=True`):

    - each weight gathered whole where it is used: forward, backward, and with adaptive
      coefficients the quadratic model's forward-mode pass and the loss at the candidate
      (`gathers = 4`; 2 with given coefficients and no step rejection);
    - the gradient reduce-scattered into the parameters' layout, and moved once more for its
      products with the sharded inverses (the preconditioning);
    - the curvature statistics reduce-scattered into the factors' layout;
    - every `inverse_update_period` steps the factors gathered for their factorisation (an upper
      bound: stacked factors split along the stack are factorised where they lie).

    Replicated layout (`shard_map`, as kfac-jax): the gradient and the statistics all-reduced,
    and every `inverse_update_period` steps the inverses all-reduced from their owners
    (`distributed_inverses`).
    """
    ring = (devices - 1) / devices
    sharded = {
        "parameter gathers": gathers * param_bytes * ring,
        "gradient": 2 * param_bytes * ring,
        "statistics": factor_bytes * ring,
        "refresh (amortised)": factor_bytes * ring / inverse_update_period,
    }
    replicated = {
        "gradient": 2 * param_bytes * ring,
        "statistics": 2 * factor_bytes * ring,
        "refresh (amortised)": 2 * factor_bytes * ring / inverse_update_period,
    }
    return sharded, replicated


def projection_table(config):
    model, state = _abstract_state(config, jnp.bfloat16)
    params = [x for x in _leaves(model) if jnp.issubdtype(x.dtype, jnp.inexact)]
    velocities = _leaves(state.step_rule_state)
    factors = _leaves([getattr(b, "factors", ()) for b in state.estimator_state.block_states])
    rest = _leaves(state)
    count = sum(x.size for x in params)
    param_bytes = sum(x.size * x.dtype.itemsize for x in params)
    factor_bytes = sum(x.size * x.dtype.itemsize for x in factors)
    state_bytes = sum(x.size * x.dtype.itemsize for x in rest)
    head = [x for x in factors if x.shape == (config.vocab, config.vocab)]
    lines = [
        f"Projected: {config} ({count / 1e9:.2f}B parameters in bf16: {_bytes(param_bytes)}; "
        f"state {_bytes(state_bytes)}: velocities {_bytes(sum(x.size * 4 for x in velocities))}, "
        f"factors {_bytes(factor_bytes)} and as much again in cached inverses; the head's "
        f"{config.vocab}-row output factor alone {_bytes(sum(x.size * 4 for x in head))})",
        "",
        "| devices | mesh (data x model) | parameters + state / device: replicated | sharded "
        "| communication / device / step: replicated | sharded |",
        "|---|---|---|---|---|---|",
    ]
    for shape in PROJECTED_MESHES:
        n = math.prod(shape)
        sharded = _per_device(params + rest, shape)
        comm_sharded, comm_replicated = projected_communication(param_bytes, factor_bytes, n)
        lines.append(
            f"| {n} | {shape[0]} x {shape[1]} | {_bytes(param_bytes + state_bytes)} | "
            f"{_bytes(sharded)} | {_bytes(sum(comm_replicated.values()))} | "
            f"{_bytes(sum(comm_sharded.values()))} |"
        )
    n = math.prod(PROJECTED_MESHES[-1])
    for name, parts in zip(("sharded", "replicated"), projected_communication(param_bytes, factor_bytes, n)):
        lines.append("")
        lines.append(f"Communication on {n} devices, {name}: " + ", ".join(
            f"{k} {_bytes(v)}" for k, v in parts.items()))
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, 1 and 8 devices")
    args = parser.parse_args()
    config = QUICK if args.quick else SIMULATED
    counts = (1, 8) if args.quick else (1, 2, 4, 8)
    jax.config.update("jax_enable_x64", True)  # the agreement check in float64
    print(f"Simulated: {config}")
    print(f"sharded 2x4 step vs one device, relative to the update: {agreement(config, 8):.2e}")
    jax.config.update("jax_enable_x64", False)
    print("\n".join(simulation_table(config, counts)))
    print()
    print("\n".join(projection_table(BILLION)))


if __name__ == "__main__":
    main()
