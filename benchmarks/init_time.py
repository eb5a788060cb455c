"""`Optimizer.init` and the first steps against kfac-jax's, on FermiNet and kfac-jax's examples (issue 49).

Not a test: kfac-jax and FermiNet are not dependencies. Each measurement runs in a fresh
subprocess, the libraries alternated, and the table gives medians over the repeats:

    python benchmarks/init_time.py --kfac-jax-python /path/to/venv-with-kfac-jax/bin/python \
        --kfac-jax /path/to/kfac-jax-checkout --ferminet /path/to/ferminet-checkout \
        [--deps /path/to/ferminet-deps] [--repeats 3] [--steps 6] [--cases he,li,classifier,autoencoder]

The libraries ("lib" in the table):

- `kfac-jax`: kfac-jax itself, run by `--kfac-jax-python` (a virtual environment with kfac-jax
  installed; its `distrax` needs a `tensorflow-probability` that imports on the installed JAX:
  `tfp-nightly` with `distrax` 0.1.9 does on JAX 0.10). Nothing of kfac-jax is stubbed; on JAX
  0.10, where `jax.device_put_replicated` is gone, the script puts back an equivalent, which
  kfac-jax HEAD's `replicate_all_local_devices(x)` calls without `axis_name` (FermiNet's MCMC
  width, outside the optimizer).
- `drop-in`: `sys.modules["kfac_jax"] = eqx_kfac.kfac_jax`, the same code otherwise.
- `core`: `eqx_kfac.Optimizer` built from the drop-in's parts (the same algorithm), called with
  plain values (one key, the global batch) instead of kfac-jax's replicated convention.

The cases, each built by the project's own code:

- `he`, `li`: FermiNet HEAD's `ferminet.train.train` on a small atom (64 walkers, two layers of
  widths (16, 4), two determinants, no pretraining). The optimizer's `init` and `step` are timed
  where FermiNet calls them (the methods wrapped on the class); for `core`, the drop-in's
  `init` builds the core optimizer instead, times it on the same arguments, and stops FermiNet.
- `classifier`, `autoencoder`: kfac-jax's `examples/` (`classifier_mnist`, `autoencoder_mnist`):
  their model and loss, the optimizer built as `examples/optimizers.py`'s `create_optimizer`
  builds it from the pipeline's K-FAC settings (`multi_device=True`), called as
  `examples/training.py` calls it
  (`data_iterator=`, `global_step_int=`), on random MNIST-shaped batches of `--batch-size`
  (the pipelines' own batch is the 60,000-image training set). The data loader's modules
  (`jaxline`, `tensorflow`, `tensorflow_datasets`, `more_itertools`) are stubbed; nothing of
  them runs. `examples/training.py` (the jaxline experiment, which the experiments' modules
  import) is imported unchanged by both libraries. FermiNet's `pyscf` is stubbed likewise (unused
  without pretraining).

Columns: `init` (to the state's arrays ready), `step 0` (trace, compile, burn-in and run: the
first call), `step 1` (the second call: a second compilation shows here), `later` (the median of
the calls after that), and each library's ratio to kfac-jax's; once in wall seconds, once in the
process's CPU seconds (all threads: on a shared, loaded machine the work done varies less than
the wall time).
"""

import argparse
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import types

LIBS = ("kfac-jax", "drop-in", "core")
CASES = ("he", "li", "classifier", "autoencoder")
_STUBBED = ("jaxline.experiment", "jaxline.utils", "tensorflow.compat.v2", "tensorflow_datasets", "more_itertools")


class _Done(Exception):
    """Raised to stop FermiNet's loop once the core optimizer was timed."""


class _Times:
    """The wall times of `init` and of each `step`, every output waited for."""

    def __init__(self):
        self.init = None
        self.steps: list[float] = []
        self.cpu_init = None
        self.cpu_steps: list[float] = []

    def timed(self, method, into_steps: bool):
        import jax

        @functools.wraps(method)
        def call(*args, **kwargs):
            start, cpu = time.perf_counter(), time.process_time()
            out = jax.block_until_ready(method(*args, **kwargs))
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            if into_steps:
                self.steps.append(elapsed)
                self.cpu_steps.append(cpu)
            else:
                self.init, self.cpu_init = elapsed, cpu
            return out

        return call

    def record(self) -> dict:
        return {"init": self.init, "steps": self.steps, "cpu_init": self.cpu_init, "cpu_steps": self.cpu_steps}


def _stub_modules(names) -> None:
    """Empty modules (every attribute a fresh class) for `names` and their parents where the
    real ones are missing."""
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            full = ".".join(parts[:i])
            if full in sys.modules:
                continue
            try:
                __import__(full)
                continue
            except ImportError:
                pass
            module = types.ModuleType(full)
            module.__path__ = []
            module.__getattr__ = lambda attr, full=full: type(f"{full}.{attr}", (), {})  # type: ignore
            sys.modules[full] = module
            if i > 1:
                setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], module)


def _device_put_replicated(tree, devices):
    """`jax.device_put_replicated` (removed in JAX 0.10), which kfac-jax HEAD's
    `replicate_all_local_devices` still calls without an `axis_name` (FermiNet's MCMC width):
    one copy per device along a new leading axis, as JAX's migration guide writes it."""
    import jax
    import jax.numpy as jnp

    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("d",)), jax.sharding.PartitionSpec("d"))
    return jax.tree.map(lambda x: jax.device_put(jnp.stack([x] * len(devices)), sharding), tree)


def _kfac_module(lib: str):
    if lib == "kfac-jax":
        import jax
        import kfac_jax

        if "device_put_replicated" not in vars(jax):
            jax.device_put_replicated = _device_put_replicated
        return kfac_jax
    import eqx_kfac.kfac_jax

    sys.modules["kfac_jax"] = eqx_kfac.kfac_jax
    return eqx_kfac.kfac_jax


def _core_like(dropin) -> "object":
    """`eqx_kfac.Optimizer` with the drop-in optimizer's parts."""
    import eqx_kfac

    f = dropin.function
    pre = dropin.preconditioner
    return eqx_kfac.Optimizer(
        f.value_and_grad, dropin.l2_reg, value_func_has_aux=f.has_aux, value_func_has_state=f.has_state,
        value_func_has_rng=f.has_rng, value_func=f.value, curvature=pre.curvature, refresh=pre.refresh,
        direction=pre.direction, step_rule=dropin.step_rule, damping_rule=dropin.damping_rule,
        guard=dropin.guard, devices=dropin.devices, options=dropin.options,
    )


def _time_core(times: _Times, dropin, params, rng, batches, func_state, steps: int, step_kwargs) -> None:
    """The core optimizer's `init` and `steps` steps, in the plain convention."""
    from eqx_kfac.kfac_jax._replicated import merged_batch
    from eqx_kfac.kfac_jax.utils import get_first

    core = _core_like(dropin)
    params, rng, func_state = get_first(params), get_first(rng), get_first(func_state)
    init, step = times.timed(core.init, False), times.timed(core.step, True)
    state = init(params, rng, merged_batch(next(batches)), func_state)
    plain = (merged_batch(b) for b in batches)
    for i in range(steps):
        out = step(params, state, rng, data_iterator=plain, func_state=func_state, global_step_int=i, **step_kwargs)
        params, state = out[0], out[1]


def _ferminet(lib: str, atom: str, steps: int, args) -> dict:
    kfac_jax = _kfac_module(lib)
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import ferminet_dropin  # its pyscf stubs

    for name in ("pyscf", "pandas"):
        ferminet_dropin._stub(name)
    sys.path.insert(0, str(args.ferminet))
    from ferminet import train

    times = _Times()
    cls = kfac_jax.Optimizer
    if lib == "core":
        def init(self, params, rng, batch, func_state=None):
            # FermiNet's step keeps its batch; the core's steps take the same one.
            batches = iter([batch] * (steps + 1))
            # FermiNet's step passes `damping=cfg.optim.kfac.damping` and `momentum=0`.
            _time_core(times, self, params, rng, batches, func_state, steps, dict(damping=1e-3, momentum=0.0))
            raise _Done

        cls.init = init
    else:
        cls.init, cls.step = times.timed(cls.init, False), times.timed(cls.step, True)
    with tempfile.TemporaryDirectory() as save_path:
        try:
            from ferminet.configs import atom as atom_config

            config = ferminet_dropin.ferminet_config(atom.capitalize(), steps, save_path, burn_in=2)
            train.train(atom_config.adjust_nuclear_charge(config))
        except _Done:
            pass
    return times.record()


def _example_problem(case: str, batch_size: int):
    """kfac-jax example's init function, loss and random batches (the replicated convention's
    leading device axis included)."""
    import jax
    import jax.numpy as jnp

    _stub_modules(_STUBBED)
    if case == "classifier":
        from examples.classifier_mnist import experiment

        net, loss, flat = experiment.convolutional_classifier(), experiment.classifier_loss, False
    else:
        from examples.autoencoder_mnist import experiment

        net, loss, flat = experiment.autoencoder(), experiment.autoencoder_loss, True
    devices = jax.local_device_count()

    def batch(i: int):
        key = jax.random.fold_in(jax.random.key(1), i)
        shape = (devices, batch_size // devices) + ((784,) if flat else (28, 28))
        images = jax.random.uniform(key, shape)
        labels = jax.random.randint(jax.random.fold_in(key, 1), shape[:2], 0, 10)
        return {"images": images, "labels": labels} if case == "classifier" else {"images": images}

    return net.init, functools.partial(loss, l2_reg=1e-5, is_training=True), batch


# The K-FAC settings of examples/classifier_mnist/pipeline.py and autoencoder_mnist/pipeline.py (the same).
_EXAMPLE_KFAC = dict(
    inverse_update_period=5, damping_adaptation_interval=5, num_burnin_steps=5, curvature_ema=0.95,
    use_adaptive_damping=True, use_adaptive_learning_rate=True, use_adaptive_momentum=True,
    damping_adaptation_decay=0.95, initial_damping=150.0, min_damping=1e-5, max_damping=1000.0,
)


def _example(lib: str, case: str, steps: int, args) -> dict:
    import jax

    kfac_jax = _kfac_module(lib)
    # kfac-jax's `examples` is a namespace package: this folder's examples.py would win.
    here = pathlib.Path(__file__).parent.resolve()
    sys.path[:] = [str(args.kfac_jax)] + [p for p in sys.path if pathlib.Path(p or ".").resolve() != here]
    init_fn, loss, batch = _example_problem(case, args.batch_size)
    # examples/optimizers.py's create_optimizer("kfac", ...) for these settings (no schedules,
    # batch norm "diag": no extra keywords).
    optimizer = kfac_jax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss, has_aux=True), l2_reg=1e-5, value_func_has_aux=True,
        value_func_has_state=False, value_func_has_rng=False, value_func_for_estimator=None,
        multi_device=True, pmap_axis_name="kfac_axis", **_EXAMPLE_KFAC,
    )
    rng = kfac_jax.utils.replicate_all_local_devices(jax.random.PRNGKey(0))
    params_rng, optimizer_rng = kfac_jax.utils.p_split(rng)
    params = jax.block_until_ready(jax.pmap(init_fn, axis_name="kfac_axis")(params_rng, batch(0)))
    batches = (batch(i) for i in range(10**6))
    times = _Times()
    if lib == "core":
        _time_core(times, optimizer, params, optimizer_rng, batches, None, steps, {})
        return times.record()
    init, step = times.timed(optimizer.init, False), times.timed(optimizer.step, True)
    state = init(params, optimizer_rng, next(batches), None)
    for i in range(steps):
        # examples/training.py: one key for every step (its `rng`), the batches from the iterator.
        params, state, _ = step(params=params, state=state, rng=optimizer_rng, data_iterator=batches,
                                global_step_int=i)
    return times.record()


def _worker(args) -> None:
    sys.path[:0] = [str(p) for p in args.deps]
    if args.case in ("he", "li"):
        record = _ferminet(args.lib, args.case, args.steps, args)
    else:
        record = _example(args.lib, args.case, args.steps, args)
    print("RESULT " + json.dumps(record))


def _run_one(args, lib: str, case: str) -> dict:
    python = args.kfac_jax_python if lib == "kfac-jax" else sys.executable
    command = [
        str(python), __file__, "--worker", "--lib", lib, "--case", case, "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--kfac-jax", str(args.kfac_jax), "--ferminet", str(args.ferminet),
    ] + [x for d in args.deps for x in ("--deps", str(d))]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(pathlib.Path(__file__).parents[1]) if lib != "kfac-jax" else "")
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{lib} on {case} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _columns(records: list[dict], clock: str) -> dict[str, float]:
    """Medians over the repeats of init, step 0, step 1 and the later steps' median, in wall
    seconds (`clock=""`) or the process's CPU seconds, all threads (`clock="cpu_"`)."""
    return {
        "init": statistics.median(r[f"{clock}init"] for r in records),
        "step 0": statistics.median(r[f"{clock}steps"][0] for r in records),
        "step 1": statistics.median(r[f"{clock}steps"][1] for r in records),
        "later": statistics.median(statistics.median(r[f"{clock}steps"][2:]) for r in records),
    }


def _table(results: dict[tuple[str, str], list[dict]], cases, libs, clock: str = "") -> str:
    names = ("init", "step 0", "step 1", "later")
    unit = "CPU s" if clock else "s"
    rows = ["| case | lib | " + " | ".join(f"{n} ({unit}) | x" for n in names) + " |",
            "|---|---|" + "---:|---:|" * len(names)]
    for case in cases:
        reference = _columns(results[(case, "kfac-jax")], clock)
        for lib in libs:
            col = _columns(results[(case, lib)], clock)
            cells = " | ".join(f"{col[n]:.3f} | {col[n] / reference[n]:.2f}" for n in names)
            rows.append(f"| {case} | {lib} | {cells} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kfac-jax-python", type=pathlib.Path, default=pathlib.Path(sys.executable))
    parser.add_argument("--kfac-jax", type=pathlib.Path, required=True, help="a kfac-jax checkout (its examples/)")
    parser.add_argument("--ferminet", type=pathlib.Path, required=True, help="a FermiNet checkout")
    parser.add_argument("--deps", type=pathlib.Path, action="append", default=[], help="FermiNet's (and the examples') dependencies: sys.path entries")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="steps per run (at least 3)")
    parser.add_argument("--batch-size", type=int, default=1000, help="the examples' batch")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--libs", default=",".join(LIBS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lib", choices=LIBS, help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    cases, libs = args.cases.split(","), args.libs.split(",")
    results: dict[tuple[str, str], list[dict]] = {(c, lib): [] for c in cases for lib in libs}
    for repeat in range(args.repeats):
        for case in cases:
            for lib in libs if repeat % 2 == 0 else reversed(libs):
                results[(case, lib)].append(_run_one(args, lib, case))
                print(f"repeat {repeat} {case} {lib}: {results[(case, lib)][-1]}", file=sys.stderr, flush=True)
    print("Wall seconds:\n" + _table(results, cases, libs))
    # On a shared machine the CPU time (the work done) varies less than the wall time.
    print("\nCPU seconds (the process, all threads):\n" + _table(results, cases, libs, "cpu_"))


if __name__ == "__main__":
    main()
