"""FermiNet HEAD's own training loop with `kfac_jax` replaced by `eqx_kfac.kfac_jax` (issue 49).

Not a test: FermiNet is not a dependency. Give a FermiNet checkout (the directory holding the
`ferminet` package, e.g. `git archive HEAD ferminet | tar -x -C checkout`) and, if its
dependencies are not installed, a directory of them:

    python benchmarks/ferminet_dropin.py --ferminet /path/to/ferminet-checkout \
        [--deps /path/to/site-dir] [--iterations 20] [--atom He] [--envelope full]

What it does, in order:

1. `sys.modules["kfac_jax"] = eqx_kfac.kfac_jax`: every `import kfac_jax` of FermiNet gets the
   drop-in; nothing of FermiNet is changed. `pyscf` (and `pandas`) are stubbed when they are not
   installed: a config without Hartree-Fock pretraining never calls them.
2. Imports `ferminet.train` from the checkout as it is. FermiNet registers its own blocks
   (`RepeatedDenseBlock` for its `"repeated_dense"` layers, `QmcBlockedDense` for the `"qmc"`
   full envelope), written against kfac-jax's block interface; the drop-in adapts them (the
   "Migrating from kfac-jax" page), so every dense layer of the network gets `RepeatedDenseBlock`.
3. Runs `ferminet.train.train` on a small atom (FermiNet's `atom` config, 64 walkers, two layers
   of widths (16, 4), two determinants, no pretraining, seed 23), with its pmap-replicated
   calling convention, and prints the energies FermiNet logs and the time per iteration.
   `--envelope full` selects FermiNet's `make_full_envelope` (the `"qmc"` route), whose block
   does not run on kfac-jax HEAD either; the script prints where it stops.
"""

import argparse
import importlib
import logging
import math
import statistics
import pathlib
import sys
import tempfile
import time
import types


class _MissingMeta(type):
    """Attributes of a stubbed name are stubbed names too (`pyscf.lib.exceptions.X`)."""

    def __getattr__(cls, attr: str) -> type:
        return _missing(f"{cls.__name__}.{attr}")


def _missing(name: str) -> type:
    """A stubbed name: a class (so annotations such as `pyscf.gto.Mole | None` work) that raises
    when instantiated."""

    def refuse(self, *args, **kwargs):
        raise NotImplementedError(f"{name} is stubbed by benchmarks/ferminet_dropin.py and was called")

    return _MissingMeta(name, (Exception,), {"__init__": refuse})


def _stub(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError:
        for full in (name, f"{name}.gto", f"{name}.lib", f"{name}.scf"):
            module = types.ModuleType(full)
            module.__path__ = []  # a package, for `from pyscf.lib import exceptions`
            module.__getattr__ = lambda attr, full=full: _missing(f"{full}.{attr}")  # type: ignore[attr-defined]
            sys.modules[full] = module


def _import_train(checkout: pathlib.Path):
    sys.path.insert(0, str(checkout))
    return importlib.import_module("ferminet.train")


def ferminet_config(atom: str, iterations: int, save_path: str, envelope: str = "default", burn_in: int = 10):
    """FermiNet's `atom` config, small: 64 walkers, two layers of widths (16, 4), two
    determinants, no pretraining, `burn_in` MCMC burn-in steps, seed 23; the full envelope with
    `envelope="full"`. Shared with `benchmarks/init_time.py`."""
    from ferminet.configs import atom as atom_config

    cfg = atom_config.get_config()
    cfg.system.atom = atom
    cfg.batch_size = 64
    cfg.pretrain.iterations = 0
    cfg.mcmc.burn_in = burn_in
    cfg.optim.iterations = iterations
    cfg.network.ferminet.hidden_dims = ((16, 4), (16, 4))
    cfg.network.determinants = 2
    cfg.debug.deterministic = True  # seed 23: runs comparable with kfac-jax's
    cfg.log.save_path = save_path
    cfg.log.save_frequency = 1e6
    if envelope == "full":
        cfg.network.make_envelope_fn = "ferminet.envelopes.make_full_envelope"
        cfg.network.make_envelope_kwargs = {}
    return cfg.lock() if hasattr(cfg, "lock") else cfg


class _StepTimes(logging.Handler):
    """The times at which FermiNet logs its iterations (`Step 00001: ...`)."""

    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Step "):
            self.times.append(record.created)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ferminet", type=pathlib.Path, required=True, help="a FermiNet checkout")
    parser.add_argument("--deps", type=pathlib.Path, action="append", default=[], help="extra sys.path entries")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--atom", default="He")
    parser.add_argument("--envelope", choices=("isotropic", "full"), default="isotropic")
    args = parser.parse_args()
    sys.path[:0] = [str(p) for p in args.deps]

    import jax

    import eqx_kfac.kfac_jax

    jax.config.update("jax_enable_x64", False)
    sys.modules["kfac_jax"] = eqx_kfac.kfac_jax
    for name in ("pyscf", "pandas"):
        _stub(name)
    train = _import_train(args.ferminet)
    from ferminet.configs import atom as atom_config

    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.INFO)  # FermiNet logs each iteration at INFO
    steps = _StepTimes()
    logging.getLogger().addHandler(steps)  # absl's records propagate to the root logger
    with tempfile.TemporaryDirectory() as save_path:
        cfg = atom_config.adjust_nuclear_charge(ferminet_config(args.atom, args.iterations, save_path, args.envelope))
        start = time.perf_counter()
        try:
            train.train(cfg)
        except Exception as error:  # FermiNet's full-envelope block: see the docstring
            print(f"FermiNet's {args.envelope} envelope stopped: {type(error).__name__}: {error}")
            raise SystemExit(1) from None
        elapsed = time.perf_counter() - start
        stats = (pathlib.Path(save_path) / "train_stats.csv").read_text().splitlines()
    intervals = [b - a for a, b in zip(steps.times, steps.times[1:])]
    print(f"FermiNet HEAD (unmodified) on {args.atom}, {args.envelope} envelope ({jax.local_device_count()} devices): {args.iterations} "
          f"iterations in {elapsed:.1f} s; median iteration after the first "
          f"{1e3 * statistics.median(intervals[1:] or intervals or [math.nan]):.2f} ms")
    print("\n".join(stats[:3] + ["..."] + stats[-3:]))


if __name__ == "__main__":
    main()
