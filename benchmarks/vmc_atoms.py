"""FermiNet-style variational Monte Carlo for He and Li: `eqx_kfac.Optimizer` against Adam.

    python benchmarks/vmc_atoms.py                 # He and Li, 3 seeds, writes docs/img/vmc_atoms.png
    python benchmarks/vmc_atoms.py --quick         # He only, one seed, 300 iterations, 256 walkers
    python benchmarks/vmc_atoms.py --atoms Li --seeds 0 --iterations 500 --adam-lrs 1e-2

The ansatz is FermiNet's architecture (Pfau et al., 2020), written here from the paper's
description (FermiNet itself is not a dependency), as plain JAX functions of a dict of parameters:

- one-electron features `(r_i - R, |r_i - R|)` and two-electron features
  `(r_i - r_j, |r_i - r_j|)`;
- per-electron layers: the one-electron stream takes `[h_i, mean over up-spin h_j, mean over
  down-spin h_j, mean over up-spin h_ij, mean over down-spin h_ij]` through a dense layer and
  `tanh` (with a residual connection where the widths agree), the two-electron stream its own
  dense layer;
- orbitals `(h_j @ w + g) * sum_I pi_I exp(-r_jI sigma_I)` per spin and determinant (dense
  layers and exponential envelopes), and `psi = sum_k det(phi_k^up) det(phi_k^down)`; the
  determinants of He's and Li's at most two same-spin electrons are written out.

The energy is FermiNet's loss: a `jax.custom_jvp` function whose rule returns the VMC gradient
`E[(E_L - E) grad log|psi|]` (FermiNet leaves out its factor 2; local energies clipped at 5 mean
absolute deviations from the median, as FermiNet does) and registers `log|psi|` with
`register_normal_predictive_distribution`; it is handed straight to `jax.value_and_grad`. The
local energy is `-(1/2) (lap log|psi| + |grad log|psi||^2) + V` with the Laplacian from
`jax.hessian`, and walkers move by Metropolis-Hastings (all electrons at once, Gaussian
proposals whose width adapts to an acceptance of about 0.5).

Methods, from the same parameters and the same burnt-in walkers:

- `eqx_kfac.Optimizer` with kfac-jax's FermiNet settings: learning rate `lr / (1 + t/10^4)`, no
  momentum, damping `1e-3`, a norm constraint, `curvature_ema=0.95`, `inverse_update_period=1`,
  `estimation_mode="fisher_exact"`, no burn-in steps; `--kfac` lists the `lr:norm_constraint`
  pairs, by default FermiNet's own `0.05:1e-3` and `0.2:1e-2`;
- Adam (`optax.adam`) with the learning rate `lr / (1 + t/10^4)`, for each `lr` of
  `--adam-lrs` (default 3e-3 and 1e-2).

For each family the summary takes the setting that gets within 10 mHa first (on the mean over the
seeds).

The energy of an iteration is the mean local energy of its walkers; results are means of the last
50 iterations, against the exact energies He -2.90372 and Li -7.47806 Ha. The summary gives, per
atom, the first iteration at which Adam's 50-iteration mean (averaged over the seeds) is within
10 mHa, and K-FAC's there (the acceptance: within 2 mHa for He, 5 mHa for Li).
"""

import argparse
import dataclasses
import functools
import json
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_kfac

EXACT = {"He": -2.90372, "Li": -7.47806}
# The acceptance: K-FAC's error where Adam's first gets within 10 mHa.
TARGETS = {"He": 0.002, "Li": 0.005}
WINDOW = 50


@dataclasses.dataclass(frozen=True)
class Atom:
    """An atom at the origin: nuclear charge and electrons per spin."""

    name: str
    charge: float
    n_up: int
    n_down: int

    @property
    def n(self) -> int:
        return self.n_up + self.n_down


ATOMS = {"He": Atom("He", 2.0, 1, 1), "Li": Atom("Li", 3.0, 2, 1)}


@dataclasses.dataclass(frozen=True)
class Config:
    """Network and sampling sizes."""

    single: int = 32
    pair: int = 8
    layers: int = 2
    determinants: int = 4
    walkers: int = 512
    mcmc_steps: int = 10


# ----------------------------------------------------------------------------------------------
# The ansatz


def _dense(key, n_in: int, n_out: int) -> dict:
    return {"w": jax.random.normal(key, (n_in, n_out)) / np.sqrt(n_in), "b": jnp.zeros(n_out)}


def _spins(atom: Atom) -> list[slice]:
    """The electrons of each spin that has any."""
    return [s for s in (slice(0, atom.n_up), slice(atom.n_up, atom.n)) if s.stop > s.start]


def init_params(key, atom: Atom, config: Config) -> dict:
    """FermiNet's parameters: one- and two-electron streams, orbitals and envelopes per spin."""
    keys = iter(jax.random.split(key, 2 * config.layers + 2))
    n_spins = len(_spins(atom))
    single, pair = [], []
    width_in, pair_in = 4, 4
    for layer in range(config.layers):
        single.append(_dense(next(keys), width_in + n_spins * (width_in + pair_in), config.single))
        width_in = config.single
        if layer < config.layers - 1:
            pair.append(_dense(next(keys), pair_in, config.pair))
            pair_in = config.pair
    orbitals, envelopes = [], []
    for spin in _spins(atom):
        k = config.determinants * (spin.stop - spin.start)
        orbitals.append(_dense(next(keys), config.single, k))
        envelopes.append({"pi": jnp.ones((1, k)), "sigma": jnp.ones((1, k))})
    return {"single": single, "pair": pair, "orbitals": orbitals, "envelopes": envelopes}


def _features(x):
    """One- and two-electron features of the positions `x: (n, 3)` (nucleus at the origin)."""
    n = x.shape[0]
    r_ae = jnp.linalg.norm(x, axis=-1, keepdims=True)
    ee = x[:, None, :] - x[None, :, :]
    eye = jnp.eye(n)[..., None]
    # The norm's derivative is undefined at 0: shift the diagonal before, zero it after.
    r_ee = jnp.linalg.norm(ee + eye, axis=-1, keepdims=True) * (1.0 - eye)
    return jnp.concatenate([x, r_ae], -1), jnp.concatenate([ee, r_ee], -1), r_ae


def _det(m):
    """Determinants of `(..., n, n)` matrices for n <= 2, written out (no LAPACK call)."""
    if m.shape[-1] == 1:
        return m[..., 0, 0]
    if m.shape[-1] == 2:
        return m[..., 0, 0] * m[..., 1, 1] - m[..., 0, 1] * m[..., 1, 0]
    return jnp.linalg.det(m)


def log_psi(params: dict, x, atom: Atom):
    """`log|psi(x)|` for the positions `x: (n, 3)` of one walker."""
    h, h_pair, r_ae = _features(x)
    spins = _spins(atom)
    for layer, dense in enumerate(params["single"]):
        means = [jnp.broadcast_to(jnp.mean(h[s], axis=0), (atom.n, h.shape[-1])) for s in spins]
        means += [jnp.mean(h_pair[:, s], axis=1) for s in spins]
        new = jnp.tanh(jnp.concatenate([h, *means], -1) @ dense["w"] + dense["b"])
        h = new + h if new.shape == h.shape else new
        if layer < len(params["pair"]):
            dense_pair = params["pair"][layer]
            new_pair = jnp.tanh(h_pair @ dense_pair["w"] + dense_pair["b"])
            h_pair = new_pair + h_pair if new_pair.shape == h_pair.shape else new_pair
    psi = 1.0
    for s, orbital, envelope in zip(spins, params["orbitals"], params["envelopes"]):
        n_s = s.stop - s.start
        env = jnp.sum(jnp.exp(-r_ae[s][..., None] * envelope["sigma"]) * envelope["pi"], axis=1)
        phi = (h[s] @ orbital["w"] + orbital["b"]) * env
        phi = jnp.transpose(jnp.reshape(phi, (n_s, -1, n_s)), (1, 0, 2))
        psi = psi * _det(phi)
    return jnp.log(jnp.abs(jnp.sum(psi)))


def local_energy(params: dict, x, atom: Atom):
    """`-(1/2)(lap log|psi| + |grad log|psi||^2) + V` at one walker."""
    flat = x.reshape(-1)
    f = lambda y: log_psi(params, y.reshape(x.shape), atom)
    grad = jax.grad(f)(flat)
    laplacian = jnp.trace(jax.hessian(f)(flat))
    r = jnp.linalg.norm(x, axis=-1)
    r_ee = jnp.linalg.norm(x[:, None] - x[None], axis=-1)
    upper = jnp.triu(jnp.ones((atom.n, atom.n)), 1)
    potential = -atom.charge * jnp.sum(1.0 / r) + jnp.sum(upper / jnp.where(upper > 0, r_ee, 1.0))
    return -0.5 * (laplacian + grad @ grad) + potential


def make_energy(atom: Atom, clip: float = 5.0):
    """FermiNet's loss: `(mean local energy, local energies)`, with the VMC gradient as the
    custom JVP rule, which registers `log|psi|`."""
    batch_log_psi = jax.vmap(functools.partial(log_psi, atom=atom), (None, 0))
    batch_local_energy = jax.vmap(functools.partial(local_energy, atom=atom), (None, 0))

    @jax.custom_jvp
    def total_energy(params, walkers):
        energies = batch_local_energy(params, walkers)
        return jnp.mean(energies), energies

    @total_energy.defjvp
    def total_energy_jvp(primals, tangents):
        params, walkers = primals
        loss, energies = total_energy(params, walkers)
        median = jnp.median(energies)
        spread = jnp.mean(jnp.abs(energies - median))
        clipped = jnp.clip(energies, median - clip * spread, median + clip * spread)
        log_abs, log_abs_tangent = jax.jvp(lambda p: batch_log_psi(p, walkers), (params,), (tangents[0],))
        eqx_kfac.register_normal_predictive_distribution(log_abs[:, None])
        # FermiNet leaves out the gradient's factor 2 (its learning rates are for this scale).
        gradient = jnp.mean((clipped - jnp.mean(clipped)) * log_abs_tangent)
        return (loss, energies), (gradient, jnp.zeros_like(energies))

    return total_energy


@functools.partial(jax.jit, static_argnames=("atom", "steps"))
def mcmc(params, walkers, key, width, atom: Atom, steps: int):
    """`steps` Metropolis-Hastings moves of all electrons of every walker under `|psi|^2`;
    returns the walkers and the fraction of accepted moves."""
    batch_log_psi = jax.vmap(functools.partial(log_psi, atom=atom), (None, 0))

    def move(carry, key):
        x, log_p, accepted = carry
        k1, k2 = jax.random.split(key)
        proposal = x + width * jax.random.normal(k1, x.shape, x.dtype)
        log_q = 2.0 * batch_log_psi(params, proposal)
        accept = jnp.log(jax.random.uniform(k2, log_q.shape, x.dtype)) < log_q - log_p
        x = jnp.where(accept[:, None, None], proposal, x)
        return (x, jnp.where(accept, log_q, log_p), accepted + jnp.mean(accept)), None

    start = (walkers, 2.0 * batch_log_psi(params, walkers), 0.0)
    (walkers, _, accepted), _ = jax.lax.scan(move, start, jax.random.split(key, steps))
    return walkers, accepted / steps


# ----------------------------------------------------------------------------------------------
# Training


def schedule(rate: float):
    """FermiNet's learning-rate schedule `rate / (1 + t / 10^4)`."""
    return lambda t: rate / (1.0 + t / 1e4)


@dataclasses.dataclass(frozen=True)
class Method:
    """`"kfac"` (with its learning rate and norm constraint) or `"adam"` (with its rate)."""

    name: str
    learning_rate: float
    norm_constraint: float | None = None

    @property
    def label(self) -> str:
        if self.name == "adam":
            return f"Adam, lr {self.learning_rate:g}"
        return f"K-FAC, lr {self.learning_rate:g}, norm constraint {self.norm_constraint:g}"


def make_kfac(energy, method: Method) -> eqx_kfac.Optimizer:
    """`eqx_kfac.Optimizer` with kfac-jax's FermiNet settings, at the method's learning rate and
    norm constraint (FermiNet's: 0.05 and 1e-3)."""
    return eqx_kfac.Optimizer(
        jax.value_and_grad(energy, has_aux=True),
        value_func_has_aux=True,
        step_rule=eqx_kfac.MomentumStep(
            eqx_kfac.ScheduledHyperparameter(schedule(method.learning_rate)),
            eqx_kfac.ScheduledHyperparameter(lambda t: 0.0),
        ),
        damping_rule=eqx_kfac.ScheduledDamping(lambda t: 1e-3),
        direction=eqx_kfac.PreconditionedGradient(norm_constraint=method.norm_constraint),
        refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=0, inverse_update_period=1, curvature_ema=0.95),
        curvature=eqx_kfac.CurvatureOptions(estimation_mode="fisher_exact", on_unmatched="error"),
    )


def _adam_step(energy, rate: float):
    transform = optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(schedule(rate)), optax.scale(-1.0))
    value_and_grad = jax.value_and_grad(energy, has_aux=True)

    @jax.jit
    def step(params, opt_state, walkers):
        (loss, _), grads = value_and_grad(params, walkers)
        updates, opt_state = transform.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, transform.init


def _kfac_step(energy, method: Method):
    optimizer = make_kfac(energy, method)

    def step(params, state, walkers, key):
        params, state, stats = optimizer.step(params, state, key, batch=walkers)
        return params, state, stats["loss"]

    return step, lambda params, key, walkers: optimizer.init(params, key, walkers)


def start(atom: Atom, config: Config, seed: int):
    """The initial parameters and walkers (after 100 burn-in moves) of a seed."""
    key = jax.random.key(seed)
    params = init_params(jax.random.fold_in(key, 0), atom, config)
    walkers = jax.random.normal(jax.random.fold_in(key, 1), (config.walkers, atom.n, 3))
    walkers, _ = mcmc(params, walkers, jax.random.fold_in(key, 2), 0.3, atom, 100)
    return params, walkers


def train(method: Method, atom: Atom, config: Config, seed: int, iterations: int) -> dict:
    """One run; returns its energies per iteration, seconds and first-call seconds."""
    params, walkers = start(atom, config, seed)
    energy = make_energy(atom)
    key = jax.random.fold_in(jax.random.key(seed), 3)
    if method.name == "kfac":
        step, init = _kfac_step(energy, method)
        state = init(params, key, walkers)
    else:
        adam_step, adam_init = _adam_step(energy, method.learning_rate)
        step, state = (lambda p, s, w, k: adam_step(p, s, w)), adam_init(params)
    width, energies, times = 0.3, [], []
    for _ in range(iterations):
        tic = time.perf_counter()
        key, k_mcmc, k_step = jax.random.split(key, 3)
        walkers, accepted = mcmc(params, walkers, k_mcmc, width, atom, config.mcmc_steps)
        params, state, loss = step(params, state, walkers, k_step)
        energies.append(float(loss))
        width *= 1.02 if float(accepted) > 0.55 else 0.98 if float(accepted) < 0.5 else 1.0
        times.append(time.perf_counter() - tic)
    return dict(energies=energies, seconds=float(np.sum(times)), first_call=times[0])


def generic_parameters(atom: Atom, config: Config) -> list[str]:
    """The parameters K-FAC gives no structured block (the benchmark requires none)."""
    params, walkers = start(atom, config, 0)
    optimizer = make_kfac(make_energy(atom), Method("kfac", 0.05, 1e-3))
    estimator = optimizer.estimators((params, walkers))[0]
    return [path for path, reg in estimator.registrations().items() if reg.tag == "generic"]


# ----------------------------------------------------------------------------------------------
# Summary


def window_means(energies: Sequence[float]) -> np.ndarray:
    """The mean of the last `WINDOW` energies at every iteration from `WINDOW` on."""
    return np.convolve(np.asarray(energies), np.ones(WINDOW) / WINDOW, mode="valid")


def errors(atom: str, runs: Sequence[dict]) -> np.ndarray:
    """`E - E_exact` (Ha) of the 50-iteration means, averaged over the seeds' runs."""
    return np.mean([window_means(r["energies"]) for r in runs], axis=0) - EXACT[atom]


def first_within(error: np.ndarray, tolerance: float) -> int | None:
    """The first iteration whose 50-iteration mean is within `tolerance` (None: never)."""
    within = np.nonzero(error <= tolerance)[0]
    return int(within[0]) + WINDOW if len(within) else None


def best(atom: str, runs: dict[Method, list[dict]], name: str) -> Method:
    """The method of a family that gets within 10 mHa first (the lowest final error if none)."""

    def key(method):
        error = errors(atom, runs[method])
        at = first_within(error, 0.010)
        return (at is None, at or 0, error[-1])

    return min((m for m in runs if m.name == name), key=key)


def summarize(atom: str, runs: dict[Method, list[dict]]) -> dict:
    """Adam's (best rate's) first iteration within 10 mHa, and every method's error there."""
    adam, kfac = best(atom, runs, "adam"), best(atom, runs, "kfac")
    reached = first_within(errors(atom, runs[adam]), 0.010)
    at = (reached or len(errors(atom, runs[adam])) - 1 + WINDOW) - WINDOW
    return dict(
        atom=atom,
        adam=adam,
        kfac=kfac,
        adam_reaches_10mha=reached is not None,
        iteration=at + WINDOW,
        kfac_per_seed=[float(window_means(r["energies"])[at] - EXACT[atom]) for r in runs[kfac]],
        methods={
            m: dict(
                there=float(errors(atom, r)[at]),
                within_10mha=first_within(errors(atom, r), 0.010),
                final=float(errors(atom, r)[-1]),
                seconds=float(np.mean([x["seconds"] for x in r])),
                first_call=float(np.mean([x["first_call"] for x in r])),
            )
            for m, r in runs.items()
        },
    )


def plot(results: dict, path: str) -> None:
    """Per atom, every seed's error (50-iteration means) of the best K-FAC and Adam settings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 3.8), squeeze=False)
    for ax, (atom, (runs, row)) in zip(axes.flat, results.items()):
        for method, color in ((row["kfac"], "C3"), (row["adam"], "C0")):
            for k, run in enumerate(runs[method]):
                error = (window_means(run["energies"]) - EXACT[atom]) * 1e3
                x = np.arange(WINDOW, WINDOW + len(error))
                ax.plot(x, error, color=color, lw=0.8, alpha=0.7, label=method.label if k == 0 else None)
        ax.axhline(10, color="k", ls=":", lw=1, label="10 mHa")
        ax.axhline(TARGETS[atom] * 1e3, color="k", ls="--", lw=1, label=f"{TARGETS[atom] * 1e3:g} mHa")
        ax.axhline(0, color="0.6", lw=0.8)
        ax.axvline(row["iteration"], color="C0", ls=":", lw=1)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_title(f"{atom}: E - E_exact, mean of the last {WINDOW} iterations")
        ax.set_xlabel("iteration")
        ax.set_ylabel("mHa")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _report(rows: Sequence[dict], iterations: int) -> None:
    print(f"| atom | method | within 10 mHa at | error where Adam first is (mHa) | at {iterations} (mHa) "
          "| s per run (first call) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        for method, m in row["methods"].items():
            chosen = " (best)" if method in (row["adam"], row["kfac"]) else ""
            print(
                f"| {row['atom']} | {method.label}{chosen} | {m['within_10mha'] or 'not reached'} "
                f"| {m['there'] * 1e3:.2f} | {m['final'] * 1e3:.2f} | {m['seconds']:.0f} ({m['first_call']:.0f}) |"
            )
    for row in rows:
        there = row["methods"][row["kfac"]]["there"]
        seeds = ", ".join(f"{e * 1e3:.2f}" for e in row["kfac_per_seed"])
        print(
            f"{row['atom']}: Adam within 10 mHa at {row['iteration']} (reached: {row['adam_reaches_10mha']}); "
            f"{row['kfac'].label} there: {there * 1e3:.2f} mHa (seeds {seeds}); within "
            f"{TARGETS[row['atom']] * 1e3:g} mHa: {row['adam_reaches_10mha'] and there <= TARGETS[row['atom']]}"
        )


def _methods(kfac: Sequence[str], adam: Sequence[float]) -> list[Method]:
    settings = [tuple(map(float, k.split(":"))) for k in kfac]
    return [Method("kfac", lr, nc) for lr, nc in settings] + [Method("adam", lr) for lr in adam]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", nargs="+", choices=sorted(ATOMS), default=["He", "Li"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=1500)
    parser.add_argument("--walkers", type=int, default=Config.walkers)
    parser.add_argument("--kfac", nargs="+", default=["0.05:1e-3", "0.2:1e-2"], help="K-FAC lr:norm_constraint settings")
    parser.add_argument("--adam-lrs", type=float, nargs="+", default=[3e-3, 1e-2])
    parser.add_argument("--quick", action="store_true", help="He, one seed, 300 iterations, 256 walkers")
    parser.add_argument("--plot", default="docs/img/vmc_atoms.png")
    parser.add_argument("--json", help="write the energies of every run to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.atoms, args.seeds, args.iterations, args.walkers = ["He"], [0], 300, 256
    config, methods = Config(walkers=args.walkers), _methods(args.kfac, args.adam_lrs)
    tic = time.perf_counter()
    results, rows = {}, []
    for name in args.atoms:
        atom = ATOMS[name]
        generic = generic_parameters(atom, config)
        print(f"{name}: parameters without a structured block: {generic or 'none'}", flush=True)
        runs = {m: [] for m in methods}
        for seed in args.seeds:
            for method in methods:
                run = train(method, atom, config, seed, args.iterations)
                runs[method].append(run)
                final = np.mean(run["energies"][-WINDOW:])
                print(
                    f"{name} seed {seed} {method.label}: {final:.5f} Ha ({(final - EXACT[name]) * 1e3:+.2f} mHa), "
                    f"{run['seconds']:.0f} s (first call {run['first_call']:.1f} s)",
                    flush=True,
                )
        rows.append(summarize(name, runs))
        results[name] = (runs, rows[-1])
    print(f"\n{args.iterations} iterations, {config.walkers} walkers, seeds {args.seeds}, "
          f"{jax.devices()[0].platform}, total {time.perf_counter() - tic:.0f} s\n")
    _report(rows, args.iterations)
    if args.plot:
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        plot(results, args.plot)
        print(f"\nwrote {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({a: {m.label: r for m, r in runs.items()} for a, (runs, _) in results.items()}, f)


if __name__ == "__main__":
    main()
