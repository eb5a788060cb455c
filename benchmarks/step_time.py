"""Per-step time and peak memory of `eqx_kfac.Optimizer` vs optax Adam (and kfac-jax) (issue 10).

The model is the K-FAC paper's deep autoencoder 784-1000-500-250-30-250-500-1000-784 (tanh on
every hidden layer, linear output logits, sigmoid cross-entropy summed over the outputs and
averaged over the batch, `l2_reg / 2 * |θ|²` added), binary random inputs, B=512, float32. It is
the Equinox twin of `tests/reference/kfac_jax_step_time.py` (kfac-jax 0.0.8 + Haiku), which
`--peer-venv PATH` runs in that venv as a subprocess.

    python benchmarks/step_time.py                     # table
    python benchmarks/step_time.py --peer-venv /work/peervenv --plot breakdown.png
    python benchmarks/step_time.py --quick             # widths / 10, a smoke run
    python benchmarks/step_time.py --hugepage-malloc   # glibc's malloc on huge pages (see below)
    python benchmarks/step_time.py --sync-dispatch     # JAX's asynchronous dispatch off (see below)

Settings (`eqx_kfac.kfac_jax.Optimizer`, kfac-jax's keywords as the twin passes them, on the
recommended configuration's safeguards; both with `inverse_update_period=5`, `curvature_ema=0.95`,
`l2_reg=1e-5`, no burn-in):
- `kfac_adaptive`: adaptive learning rate, momentum and damping (initial 1.0, interval 5),
  `estimation_mode="ggn_curvature_prop"`, no step rejection (kfac-jax's default; the recommended
  `eqx_kfac.Optimizer` rejects, which costs one forward pass per step);
- `kfac_fixed`: learning rate 1e-3, momentum 0.9, damping 1e-2.

Methods run alternately (A B C A B C ...), `--steps-per-round` steps each (default 5: one inverse
update and one damping update per round); the table gives the median over rounds of the per-step
time and ratios to Adam. The first-call table gives the seconds of each method's first step call
(tracing, compilation and one step, as a user waits; `Optimizer.step` for ours, the jitted optax
step for Adam), taken once per process in the order of the table, after `init` (untimed); for
kfac-jax, the median over its runs (see `tests/reference/kfac_jax_step_time.py` for what its
first call includes). A second table gives the first `2 * --steps-per-round` steps (10 by
default) from the first call: every program a run compiles by then is in it (kfac-jax's
adaptive setting compiles a second variant of its step at its first damping adaptation, the
fifth step; ours compiles one). Peak memory is XLA's buffer assignment for one compiled step (arguments,
outputs and temporaries: parameters, optimizer state, batch, intermediates), for kfac-jax's
step too when it runs. The breakdown times every piece of the step alone (each jitted):
the gradient, the curvature statistics, the preconditioning with cached inverses, the quadratic
model's products, the inverses (divided by the period). The FLOP floor counts what a step must
compute (2 flops per multiply-add) from the layer shapes; the achieved fraction is
`(floor FLOPs / our time) / (Adam FLOPs / Adam time)`; `--breakdown-repeats 0` skips the
breakdown. `faults/step` counts the process's minor page faults per step: XLA's per-step scratch
buffer is faulted in anew at every step under glibc's defaults, which `--hugepage-malloc` avoids
(`use_hugepage_malloc`). The library keeps glibc's large blocks mapped itself (`mallopt`), but
only a program that runs on the calling thread allocates from the heap that keeps them, and JAX
runs a CPU program on a worker thread unless its dispatch is synchronous: `--sync-dispatch` turns
`jax_cpu_enable_async_dispatch` off here and in the kfac-jax process.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_kfac
from benchmarks.harness import RECOMMENDED_KFAC_JAX_KEYWORDS, step_parts
from benchmarks.model_zoo.tanh_mlp import (
    L2_REG,
    TanhMLP,
    autoencoder_data_loss as data_loss,
    autoencoder_loss as loss,
)

try:
    import resource
except ImportError:  # Windows has no `resource`: no page-fault counts
    resource = None


AUTOENCODER = (784, 1000, 500, 250, 30, 250, 500, 1000, 784)
PEER_SCRIPT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference", "kfac_jax_step_time.py"
)
METHODS = ("adam", "adam_donated", "kfac_adaptive", "kfac_fixed")
PEER_METHODS = ("adam", "kfac_adaptive", "kfac_fixed")


def _copy(tree):
    """A copy of `tree`'s arrays (each runner donates its own parameters)."""
    return jax.tree.map(lambda a: jnp.copy(a) if eqx.is_array(a) else a, tree)


def make_problem(sizes, batch_size):
    model = TanhMLP(sizes, jax.random.PRNGKey(0))
    x = (jax.random.uniform(jax.random.PRNGKey(1), (batch_size, sizes[0])) > 0.5)
    return model, x.astype(jnp.float32)


def make_kfac(adaptive):
    """`(optimizer, hyper)`: `eqx_kfac.kfac_jax.Optimizer` (kfac-jax's keywords, as the twin script
    passes them: `value_func_for_estimator` is one of kfac-jax's) on the recommended configuration's
    safeguards, and the hyperparameters `step` takes (fixed setting only)."""
    keywords = dict(RECOMMENDED_KFAC_JAX_KEYWORDS)
    keywords.update(
        estimation_mode="ggn_curvature_prop",
        inverse_update_period=5,
        curvature_ema=0.95,
        num_burnin_steps=0,
        # The training loop replaces both with the step's outputs (kfac-jax donates them too).
        donate_parameters=True,
        donate_optimizer_state=True,
        # kfac-jax's default: no step rejection (the recommended configuration rejects, one more
        # forward pass per step), so that both libraries take the same step.
        use_step_rejection=False,
        initial_damping=1.0,
        damping_adaptation_interval=5,
    )
    if not adaptive:
        for name in ("use_adaptive_learning_rate", "use_adaptive_momentum", "use_adaptive_damping"):
            keywords[name] = False
        keywords["initial_damping"] = None
    optimizer = eqx_kfac.kfac_jax.Optimizer(
        eqx.filter_value_and_grad(loss), L2_REG, value_func_for_estimator=data_loss, **keywords
    )
    if adaptive:
        return optimizer, {}
    hyper = dict(
        learning_rate=jnp.asarray(1e-3, jnp.float32),
        momentum=jnp.asarray(0.9, jnp.float32),
        damping=jnp.asarray(1e-2, jnp.float32),
    )
    return optimizer, hyper


def make_runner(method, model, x):
    """`(run, lower)`: `run(n)` takes `n` consecutive training steps of `method` (blocking at the
    end); `lower()` lowers one step with the current arguments."""
    if method.startswith("adam"):
        adam = optax.adam(1e-3)

        # "adam" is the step as optax's documentation writes it (plain jit, as in the kfac-jax
        # twin); "adam_donated" donates the model and optimizer state like our K-FAC runs do
        # (the batch, the first argument, is kept).
        @eqx.filter_jit(donate="all-except-first" if method == "adam_donated" else "none")
        def adam_step(batch, model, opt_state):
            value, grads = eqx.filter_value_and_grad(loss)(model, batch)
            updates, opt_state = adam.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state, value

        carry = [_copy(model), adam.init(eqx.filter(model, eqx.is_array))]

        def run(n):
            for _ in range(n):
                carry[0], carry[1], _ = adam_step(x, carry[0], carry[1])
            jax.block_until_ready(carry[0])

        return run, lambda: adam_step.lower(x, carry[0], carry[1])
    opt, hyper = make_kfac(method == "kfac_adaptive")
    carry = [_copy(model), opt.init(model, jax.random.PRNGKey(3), x), jax.random.PRNGKey(2)]

    def run(n):
        for _ in range(n):
            carry[2], key = jax.random.split(carry[2])
            carry[0], carry[1], _ = opt.step(carry[0], carry[1], key, batch=x, **hyper)
        jax.block_until_ready(carry[0])

    def lower():
        # The batch is an argument, as in Adam's step (a closed-over batch is a constant that
        # XLA spends seconds folding into the factor statistics), and the parameters and state
        # are donated, as the timed step donates them (else no output reuses an input's buffer).
        step = eqx.filter_jit(
            lambda bk, p, s: opt.step(p, s, bk[1], batch=bk[0], **hyper), donate="all-except-first"
        )
        return step.lower((x, carry[2]), carry[0], carry[1])

    return run, lower


# --- FLOP floor ---------------------------------------------------------------------------


def flop_floor(sizes, batch_size, adaptive, period=5):
    """Flops per step (2 per multiply-add) of the parts a K-FAC step cannot avoid."""
    shapes = list(zip(sizes[:-1], sizes[1:]))
    one_pass = sum(2 * batch_size * i * o for i, o in shapes)
    parts = {
        "gradient": 3 * one_pass,
        "curvature_vectors": one_pass,
        "factor_statistics": sum(2 * batch_size * ((i + 1) ** 2 + o**2) for i, o in shapes),
        "preconditioning": sum(2 * (o * o * (i + 1) + o * (i + 1) ** 2) for i, o in shapes),
        # A damped symmetric inverse (Cholesky and triangular solves) costs about n³ flops.
        "inverses": sum((i + 1) ** 3 + o**3 for i, o in shapes) / period,
    }
    if adaptive:
        parts["quadratic_model"] = 2 * 2 * one_pass
        parts["damping_update"] = one_pass / period
    return parts


# --- cost breakdown -----------------------------------------------------------------------


def breakdown(model, x, repeats):
    """Median seconds of each piece of an adaptive step, each jitted and timed alone."""
    opt, _ = make_kfac(True)
    state = opt.init(model, jax.random.PRNGKey(3), x)
    params = eqx.filter(model, eqx.is_inexact_array)
    key = jax.random.PRNGKey(4)
    weight = jnp.asarray(1.0 + L2_REG, jnp.float32)

    def estimators():
        return opt.estimators((model, x))

    # The batch is an argument (not a closed-over constant XLA would fold).
    @eqx.filter_jit
    def gradient(model, x):
        return eqx.filter_value_and_grad(loss)(model, x)

    @eqx.filter_jit
    def statistics_(model, s, x):
        return estimators()[0].update_curvature_matrix_estimate(
            s, 0.95, 1.0, x.shape[0], key, (model, x)
        )

    @eqx.filter_jit
    def inverses(s):
        return estimators()[0].update_cache(s, weight, None, -1)

    @eqx.filter_jit
    def precondition(s, g):
        return estimators()[0].multiply_matpower(s, g, weight, -1, False, True)

    @eqx.filter_jit
    def quad_model(model, s, vectors, g, x):
        return step_parts.quadratic_model(opt, s, (model, x), g, list(vectors))

    s = statistics_(model, state.estimator_state, x)
    s = inverses(s)
    g = gradient(model, x)[1]
    vectors = (g, params)
    pieces = {
        "gradient": lambda: gradient(model, x),
        "curvature_statistics": lambda: statistics_(model, s, x),
        "preconditioning": lambda: precondition(s, g),
        "quadratic_model": lambda: quad_model(model, s, vectors, g, x),
        "inverses": lambda: inverses(s),
    }
    times = {}
    for name, fn in pieces.items():
        jax.block_until_ready(fn())
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
    times["inverses"] /= opt.refresh.inverse_update_period
    return times


# --- peak memory ---------------------------------------------------------------------------


def step_memory(lower):
    """Bytes a compiled step holds at once: arguments + outputs + temporaries - aliased.

    This is XLA's static buffer assignment for the step (parameters, optimizer state, batch and
    every intermediate). The process's resident set size is no use on CPU: the runtime and the
    compiler dominate it, so it comes out the same for every method.
    """
    stats = lower().compile().compiled.memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes
            + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


# --- kfac-jax -------------------------------------------------------------------------------


# The columns of the peer script's table after the method's name.
PEER_COLUMNS = (
    "ms", "ms_x_adam", "mib", "mib_x_adam", "faults", "first_s", "first_x_adam", "steps_s", "steps_x_adam"
)


def parse_peer_table(out):
    """`{method: {column: value}}` from the peer script's output (columns `PEER_COLUMNS`);
    a `RuntimeError` showing the output if a method's row is missing."""
    rows = {}
    pattern = r"^(" + "|".join(PEER_METHODS) + r")" + len(PEER_COLUMNS) * r"\s+([0-9.]+)" + "$"
    for line in out.splitlines():
        match = re.match(pattern, line.strip())
        if match:
            rows[match.group(1)] = dict(zip(PEER_COLUMNS, map(float, match.groups()[1:])))
    if set(rows) != set(PEER_METHODS):
        raise RuntimeError(f"Could not parse the kfac-jax table:\n{out}")
    return rows


def run_peer(venv, quick, rounds, steps, batch_size, sync_dispatch=False):
    """Runs the peer script in `venv` (a fresh process) and parses its table (`parse_peer_table`)."""
    cmd = [os.path.join(venv, "bin", "python"), PEER_SCRIPT, "--rounds", str(rounds),
           "--steps-per-round", str(steps), "--batch-size", str(batch_size)]
    cmd += ["--quick"] if quick else []
    cmd += ["--sync-dispatch"] if sync_dispatch else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return parse_peer_table(out)


# --- allocator ------------------------------------------------------------------------------


def minor_faults():
    """The process's minor page faults so far (0 where `resource` is missing)."""
    return 0 if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# glibc (>= 2.35) reads its tunables when a process starts, so the script reruns itself.
HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb=1"


def use_hugepage_malloc():
    """Reruns this script with `HUGEPAGE_TUNABLE` added to `GLIBC_TUNABLES` (unless it is set).

    XLA allocates one scratch buffer per step for all its temporaries (60-80 MiB for the K-FAC
    steps here). glibc serves blocks above 32 MiB with a fresh `mmap` and unmaps them when
    freed, so every step faults the whole buffer in again, 4 KiB at a time. With the tunable,
    malloc asks for transparent huge pages (2 MiB) on those blocks.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if HUGEPAGE_TUNABLE in tunables.split(":"):
        return
    env = dict(os.environ, GLIBC_TUNABLES=":".join(t for t in (tunables, HUGEPAGE_TUNABLE) if t))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


# --- main -----------------------------------------------------------------------------------


def parse_args():
    """The command line (see `--help`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps-per-round", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="widths / 10, 2 rounds")
    parser.add_argument("--peer-venv", default=None, help="a venv with kfac-jax 0.0.8")
    parser.add_argument("--peer-repeats", type=int, default=2,
                        help="kfac-jax runs, alternated with blocks of our rounds")
    parser.add_argument("--no-memory", action="store_true", help="skip the step-memory analysis")
    parser.add_argument("--breakdown-repeats", type=int, default=10,
                        help="timed calls of each piece of the breakdown (0: no breakdown)")
    parser.add_argument("--plot", default=None, help="write a breakdown bar chart (PNG) here")
    parser.add_argument(
        "--hugepage-malloc", action="store_true",
        help=f"rerun under GLIBC_TUNABLES={HUGEPAGE_TUNABLE} (kfac-jax too): transparent huge "
             "pages for malloc's large blocks, such as XLA's per-step scratch buffer",
    )
    parser.add_argument(
        "--sync-dispatch", action="store_true",
        help="run every program on the calling thread (jax_cpu_enable_async_dispatch off; "
             "kfac-jax too), where glibc's heap holds its scratch buffer",
    )
    args = parser.parse_args()
    if args.breakdown_repeats < 0:
        parser.error("--breakdown-repeats must be at least 0")
    if args.plot and not args.breakdown_repeats:
        parser.error("--plot draws the breakdown: it needs --breakdown-repeats of at least 1")
    return args


def _peer_summary(peer_runs):
    """kfac-jax's seconds per step and of the first call (medians over its runs), faults (means),
    step memory (the same in every run)."""
    return {
        m: {
            "time": statistics.median(r["ms"] for r in rows) / 1e3,
            "first": statistics.median(r["first_s"] for r in rows),
            "steps": statistics.median(r["steps_s"] for r in rows),
            "faults": statistics.mean(r["faults"] for r in rows),
            "mib": rows[-1]["mib"],
        }
        for m, rows in peer_runs.items()
    }


def time_methods(args, rounds, runners):
    """`(from_first_call, ours, faults, peer)`: the seconds from each method's first call to the
    end of it and of its first `2 * steps_per_round` steps (`{"first": ..., "steps": ...}`), its
    seconds per step in every alternated round, its page faults per step, and kfac-jax's summary
    (with `--peer-venv`)."""
    from_first_call = {"first": {}, "steps": {}}
    for m, run in runners.items():
        start = time.perf_counter()
        run(1)
        from_first_call["first"][m] = time.perf_counter() - start
    for m, run in runners.items():
        start = time.perf_counter()
        run(2 * args.steps_per_round - 1)
        from_first_call["steps"][m] = from_first_call["first"][m] + time.perf_counter() - start
    blocks = args.peer_repeats if args.peer_venv else 1
    ours = {m: [] for m in METHODS}
    faults = dict.fromkeys(METHODS, 0)
    peer_runs = {m: [] for m in PEER_METHODS}
    for _ in range(blocks):
        for _ in range(max(1, rounds // blocks)):
            for m, run in runners.items():
                before = minor_faults()
                start = time.perf_counter()
                run(args.steps_per_round)
                ours[m].append((time.perf_counter() - start) / args.steps_per_round)
                faults[m] += minor_faults() - before
        if args.peer_venv:
            peer_table = run_peer(
                args.peer_venv, args.quick, max(2, rounds // blocks), args.steps_per_round,
                args.batch_size, args.sync_dispatch,
            )
            for m, row in peer_table.items():
                peer_runs[m].append(row)
    faults = {m: f / (len(ours[m]) * args.steps_per_round) for m, f in faults.items()}
    return from_first_call, ours, faults, _peer_summary(peer_runs) if args.peer_venv else {}


def print_step_table(med, faults, peer, memory, floors, adam_flops):
    """The per-step table: times, ratios to Adam and to the FLOP floor, memory, page faults."""
    header = f"{'method':<15}{'ms/step':>9}{'x Adam':>8}{'floor x':>9}{'of floor':>9}"
    if peer:
        header += f"{'kfac-jax ms':>12}{'x Adam':>8}{'ours/kfac-jax':>14}"
    if memory:
        header += f"{'step MiB':>10}{'x Adam':>8}"
    header += f"{'faults/step':>12}"
    if peer:
        header += f"{'kfac-jax MiB':>13}{'x Adam':>8}{'faults/step':>12}"
    print(header)
    for m in METHODS:
        floor_ratio = sum(floors[m].values()) / adam_flops if m in floors else 1.0
        ratio = med[m] / med["adam"]
        line = f"{m:<15}{1e3 * med[m]:>9.2f}{ratio:>8.2f}{floor_ratio:>9.2f}{floor_ratio / ratio:>9.2f}"
        if m in peer:
            peer_ratio = peer[m]["time"] / peer["adam"]["time"]
            line += f"{1e3 * peer[m]['time']:>12.2f}{peer_ratio:>8.2f}{med[m] / peer[m]['time']:>14.2f}"
        elif peer:
            line += " " * 34
        if memory:
            line += f"{memory[m] / 2**20:>10.0f}{memory[m] / memory['adam']:>8.2f}"
        line += f"{faults[m]:>12.0f}"
        if m in peer:
            line += f"{peer[m]['mib']:>13.0f}{peer[m]['mib'] / peer['adam']['mib']:>8.2f}"
            line += f"{peer[m]['faults']:>12.0f}"
        print(line)


def print_first_calls(from_first_call, peer, steps):
    """The first-call tables: the first call's seconds and the first `steps` steps' (from the
    first call), each with its ratio to Adam, and kfac-jax's."""
    for key, title in (
        ("first", "First call of the step (seconds: tracing, compilation and one step):"),
        ("steps", f"The first {steps} steps (seconds from the first call, every compilation included):"),
    ):
        print("\n" + title)
        header = f"{'method':<15}{'seconds':>9}{'x Adam':>8}"
        if peer:
            header += f"{'kfac-jax s':>12}{'x Adam':>8}{'ours/kfac-jax':>14}"
        print(header)
        ours = from_first_call[key]
        for m in METHODS:
            line = f"{m:<15}{ours[m]:>9.2f}{ours[m] / ours['adam']:>8.2f}"
            if m in peer:
                theirs = peer[m][key]
                line += f"{theirs:>12.2f}{theirs / peer['adam'][key]:>8.2f}{ours[m] / theirs:>14.2f}"
            print(line)


def print_breakdown(pieces, med, plot):
    """The breakdown of an adaptive step, and its bar chart written to `plot` (if given)."""
    print("\nBreakdown of an adaptive step (each piece jitted and timed alone, median ms):")
    total = med["kfac_adaptive"]
    for name, t in pieces.items():
        print(f"  {name:<22}{1e3 * t:>9.2f}")
    rest = total - sum(pieces.values())
    print(f"  {'rest (step - pieces)':<22}{1e3 * rest:>9.2f}")
    print(f"  {'whole step':<22}{1e3 * total:>9.2f}")
    if not plot:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(pieces) + ["rest"]
    values = [1e3 * pieces[n] for n in pieces] + [1e3 * max(rest, 0.0)]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(names, values)
    ax.axvline(1e3 * med["adam"], color="k", linestyle="--", label="Adam step")
    ax.set_xlabel("ms per step")
    ax.set_title("K-FAC adaptive step: cost breakdown")
    ax.invert_yaxis()
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot, dpi=120)


def main():
    args = parse_args()
    if args.hugepage_malloc:
        use_hugepage_malloc()
    if args.sync_dispatch:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    sizes = AUTOENCODER
    rounds = args.rounds
    if args.quick:
        sizes = tuple(max(2, s // 10) for s in sizes)
        rounds = min(rounds, 2)

    model, x = make_problem(sizes, args.batch_size)
    runners, lowerers = {}, {}
    for m in METHODS:
        runners[m], lowerers[m] = make_runner(m, model, x)
    from_first_call, ours, faults, peer = time_methods(args, rounds, runners)
    med = {m: statistics.median(ts) for m, ts in ours.items()}
    kfac_methods = ("kfac_adaptive", "kfac_fixed")
    floors = {m: flop_floor(sizes, args.batch_size, m == "kfac_adaptive") for m in kfac_methods}
    adam_flops = 3 * sum(2 * args.batch_size * i * o for i, o in zip(sizes[:-1], sizes[1:]))
    memory = {} if args.no_memory else {m: step_memory(lowerers[m]) for m in METHODS}

    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cores); sizes "
          f"{sizes}; B={args.batch_size}; {len(ours['adam'])} rounds x {args.steps_per_round} "
          f"steps, alternated; malloc: "
          f"{'GLIBC_TUNABLES=' + HUGEPAGE_TUNABLE if args.hugepage_malloc else 'glibc defaults'}; "
          f"dispatch: {'synchronous' if args.sync_dispatch else 'asynchronous'}")
    print_step_table(med, faults, peer, memory, floors, adam_flops)
    print_first_calls(from_first_call, peer, 2 * args.steps_per_round)
    print("\nFLOP floor per step (GFLOP):")
    for m in kfac_methods:
        parts = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in floors[m].items())
        print(f"  {m}: {sum(floors[m].values()) / 1e9:.1f} ({parts}); Adam {adam_flops / 1e9:.1f}")
    if args.breakdown_repeats:
        print_breakdown(breakdown(model, x, args.breakdown_repeats), med, args.plot)


if __name__ == "__main__":
    main()
