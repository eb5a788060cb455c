"""Physics-informed networks: K-FAC against Adam, L-BFGS and dense ENGD at equal wall-clock time.

    python benchmarks/pinn.py --plot-dir docs/img      # the four problems, full budgets (~95 min)
    python benchmarks/pinn.py --quick                  # a third of the budgets, fewer points
    python benchmarks/pinn.py --problems new           # three PDEs the defaults were not tuned on
    python benchmarks/pinn.py --compilation-cache DIR  # a second run loads the compiled programs
    python benchmarks/pinn.py --problems poisson2d --budget 60 --methods ENGD K-FAC* --seed 1

The problems of Dangel, Müller and Zeinhofer (2024), with tanh MLPs in float64:

- `poisson2d`: `-Δu = 2π² sin(πx) sin(πy)` on `[0, 1]²`, `u = 0` on the boundary
  (`u* = sin(πx) sin(πy)`), 900 interior and 120 boundary points, a 2-40-40-40-1 MLP
  (3,441 parameters), 150 s per method;
- `poisson5d`: `-Δu = π² Σ_i cos(πx_i)` on `[0, 1]⁵`, `u = u*` on the boundary
  (`u* = Σ_i cos(πx_i)`), 4,000 interior and 1,000 boundary points, a 5-64-64-48-48-1 MLP
  (10,065 parameters, the paper's), 360 s per method (with 1,000 and 250 points every method
  that fits them stalls at the same error, about 5e-3: the points, not the optimizer, set it);
- `poisson5d_wide`: the same problem with a 5-128-128-96-96-1 MLP (39,073 parameters), where
  dense ENGD no longer fits (its Gramian alone is 12.2 GB), 360 s per method;
- `heat1d`: `∂_t u = ¼ ∂²_x u` on `(t, x) ∈ [0, 1]²`, `u(0, x) = sin(πx)`, `u(t, 0) = u(t, 1) = 0`
  (`u* = exp(-π² t / 4) sin(πx)`), 900 interior and 120 initial and boundary points (one point
  set), a 2-32-32-32-1 MLP (2,241 parameters), 90 s per method.

Three more (`--problems new`), which the defaults of `engd` and `pinn_kfac` were chosen on and
no method was tuned on, 60 s per method, all methods (each docstring gives the problem):
`poisson2d_mixed` (a mixed-frequency solution), `heat2d` (`∂_t u = κ Δu` in two space
dimensions) and `reaction_diffusion` (Fisher-KPP with a source), each with a network of about
2,250 parameters.

The training points are drawn once and kept (`--resample` draws fresh ones at every step, for
every method but L-BFGS, whose line search and curvature pairs assume one loss); the relative L2
error `‖u - u*‖ / ‖u*‖` is measured on separate uniform points. The methods, all from the same
initial network (`--seed`):

- Adam at three learning rates;
- L-BFGS (`optax.lbfgs`, its zoom line search);
- dense ENGD (`eqx_kfac.engd`: the Gauss-Newton matrix over all parameters, a Cholesky solve,
  the grid line search, its default damping: from 1, adapted to the line search);
- K-FAC with the grid line search (`eqx_kfac.pinn_kfac` with its defaults: one Kronecker product
  per point set, expand, the same damping, no moving average), on `poisson2d` and the new
  problems only;
- K-FAC* (`eqx_kfac.Optimizer` with the same blocks and adaptive learning rate, momentum and
  Levenberg-Marquardt damping from the exact quadratic model; the curvature of the step's
  points, no moving average and the momentum unbounded, or a moving average with decay 0.95 and
  the default momentum bounds with `--resample`).

Every method gets the same wall-clock budget, counted from before its first call (compilation
included), and the methods run alternately in slices of the budget in one process, so a load
on the machine falls on all of them alike. The error is measured at the end of every slice
(not timed). The table gives each method's error after the step that crossed a quarter, half
and all of the budget; the ratios at the end compare K-FAC with the others at equal time.
"""

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import lineax as lx  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import eqx_kfac  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Problem:
    """A PINN problem: its network, training points, loss and exact solution."""

    name: str
    title: str
    model: Any
    batch: tuple[jax.Array, ...]
    draw: Callable[[jax.Array], tuple[jax.Array, ...]]
    loss: Callable[[Any, Any], jax.Array]
    eval_points: jax.Array
    exact: jax.Array
    budget: float
    resample: bool = False
    """Draw fresh training points (`draw(key)`) at every step instead of keeping `batch`."""

    def batch_at(self, key: jax.Array) -> tuple[jax.Array, ...]:
        """Step `key`'s training points: fresh ones when resampling, else the fixed ones."""
        return self.draw(key) if self.resample else self.batch

    def error(self, model: Any) -> float:
        """The relative L2 error on the evaluation points."""
        u = jax.vmap(model)(self.eval_points)
        return float(jnp.linalg.norm(u - self.exact) / jnp.linalg.norm(self.exact))


def _boundary_points(key: jax.Array, count: int, dim: int) -> jax.Array:
    """Uniform points on the faces of `[0, 1]^dim`: a random coordinate set to 0 or 1."""
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.uniform(k1, (count, dim))
    axis = jax.random.randint(k2, (count,), 0, dim)
    side = jax.random.bernoulli(k3, 0.5, (count,)).astype(x.dtype)
    return jnp.where(jnp.arange(dim)[None, :] == axis[:, None], side[:, None], x)


def parameter_count(model: Any) -> int:
    """The number of trained numbers in `model` (its inexact arrays)."""
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


def _mlp(sizes: tuple[int, ...], seed: int) -> Any:
    """A tanh MLP `sizes[0] -> ... -> 1` (scalar output), initialised from `jax.random.key(seed)`."""
    key = jax.random.key(seed)
    hidden = sizes[1:-1]
    if len(set(hidden)) == 1:
        return eqx.nn.MLP(sizes[0], "scalar", hidden[0], len(hidden), activation=jnp.tanh, key=key)
    layers = []
    keys = jax.random.split(key, len(sizes))
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(eqx.nn.Linear(n_in, n_out if i < len(sizes) - 2 else "scalar", key=keys[i]))
        if i < len(sizes) - 2:
            layers.append(eqx.nn.Lambda(jnp.tanh))
    return eqx.nn.Sequential(layers)


def _loss(laplacian_weights: tuple[float, ...] | None, operator: Callable) -> Callable:
    """The PINN loss: `operator(interior) = f` inside, `u = g` on the boundary points."""

    def loss(model, batch):
        x_in, f, x_bd, g = batch
        weights = None if laplacian_weights is None else jnp.asarray(laplacian_weights)
        inner, edge = eqx_kfac.taylor_forward(
            model,
            [eqx_kfac.TaylorInput(x_in, laplacian_weights=weights), eqx_kfac.TaylorInput(x_bd, order=0)],
        )
        return eqx_kfac.register_residual_loss((operator(inner), f), (edge.value, g))

    return loss


def poisson2d(quick: bool, budget: float, seed: int = 0) -> Problem:
    solution = lambda x: jnp.prod(jnp.sin(jnp.pi * x), axis=-1)  # noqa: E731

    def draw(key):
        k_in, k_bd, _ = jax.random.split(key, 3)
        x_in = jax.random.uniform(k_in, (900, 2))
        x_bd = _boundary_points(k_bd, 120, 2)
        return (x_in, 2 * jnp.pi**2 * solution(x_in), x_bd, jnp.zeros(len(x_bd)))

    key = jax.random.key(0)
    x_ev = jax.random.uniform(jax.random.split(key, 3)[2], (2000 if quick else 9000, 2))
    return Problem(
        "poisson2d", "2-D Poisson (2-40-40-40-1, 3,441 parameters)", _mlp((2, 40, 40, 40, 1), seed),
        draw(key), draw, _loss(None, lambda o: -o.laplacian), x_ev, solution(x_ev), budget,
    )


# Interior and boundary points of the 5-D problem (see its docstring).
POISSON5D_POINTS = (4000, 1000)


def poisson5d(
    quick: bool, budget: float, seed: int = 0, sizes: tuple[int, ...] = (5, 64, 64, 48, 48, 1),
    name: str = "poisson5d",
) -> Problem:
    solution = lambda x: jnp.sum(jnp.cos(jnp.pi * x), axis=-1)  # noqa: E731
    n_in, n_bd = (1000, 250) if quick else POISSON5D_POINTS

    def draw(key):
        k_in, k_bd, _ = jax.random.split(key, 3)
        x_in = jax.random.uniform(k_in, (n_in, 5))
        x_bd = _boundary_points(k_bd, n_bd, 5)
        return (x_in, jnp.pi**2 * solution(x_in), x_bd, solution(x_bd))

    key = jax.random.key(1)
    x_ev = jax.random.uniform(jax.random.split(key, 3)[2], (3000 if quick else 30000, 5))
    model = _mlp(sizes, seed)
    title = f"5-D Poisson ({'-'.join(map(str, sizes))}, {parameter_count(model):,} parameters)"
    return Problem(
        name, title, model, draw(key), draw, _loss(None, lambda o: -o.laplacian), x_ev,
        solution(x_ev), budget,
    )


def poisson5d_wide(quick: bool, budget: float, seed: int = 0) -> Problem:
    """The 5-D problem with every hidden layer twice as wide: 39,073 parameters."""
    return poisson5d(quick, budget, seed, sizes=(5, 128, 128, 96, 96, 1), name="poisson5d_wide")


KAPPA = 0.25


def heat1d(quick: bool, budget: float, seed: int = 0) -> Problem:
    solution = lambda tx: jnp.exp(-KAPPA * jnp.pi**2 * tx[..., 0]) * jnp.sin(jnp.pi * tx[..., 1])  # noqa: E731

    def draw(key):
        k_in, k_t, k_x, _ = jax.random.split(key, 4)
        x_in = jax.random.uniform(k_in, (900, 2))
        # Initial points (t = 0) and boundary points (x = 0 or 1) form one point set of values.
        x0 = jnp.stack([jnp.zeros(40), jax.random.uniform(k_x, (40,))], axis=1)
        t = jax.random.uniform(k_t, (80,))
        edges = jnp.stack([t, (jnp.arange(80) % 2).astype(t.dtype)], axis=1)
        x_bd = jnp.concatenate([x0, edges])
        return (x_in, jnp.zeros(len(x_in)), x_bd, solution(x_bd))

    key = jax.random.key(2)
    x_ev = jax.random.uniform(jax.random.split(key, 4)[3], (2000 if quick else 9000, 2))
    # `laplacian_weights=(0, κ)` gives κ ∂²u/∂x² in the Laplacian channel, ∂u/∂t in the gradient.
    return Problem(
        "heat1d", "1-D heat equation (2-32-32-32-1, 2,241 parameters)", _mlp((2, 32, 32, 32, 1), seed),
        draw(key), draw, _loss((0.0, KAPPA), lambda o: o.gradient[:, 0] - o.laplacian), x_ev, solution(x_ev),
        budget,
    )


def poisson2d_mixed(quick: bool, budget: float, seed: int = 0) -> Problem:
    """`-Δu = f` on `[0, 1]²`, `u = 0` on the boundary, with a mixed-frequency solution
    `u* = sin(πx) sin(πy) + ½ sin(4πx) sin(2πy)`; a 2-32-32-32-1 MLP (2,241 parameters)."""
    modes = ((1.0, 1.0, 1.0), (0.5, 4.0, 2.0))  # (amplitude, x frequency, y frequency)

    def solution(x, scale=lambda a, p, q: a):
        return sum(
            scale(a, p, q) * jnp.sin(p * jnp.pi * x[..., 0]) * jnp.sin(q * jnp.pi * x[..., 1])
            for a, p, q in modes
        )

    def draw(key):
        k_in, k_bd, _ = jax.random.split(key, 3)
        x_in = jax.random.uniform(k_in, (900, 2))
        x_bd = _boundary_points(k_bd, 120, 2)
        f = solution(x_in, lambda a, p, q: a * jnp.pi**2 * (p**2 + q**2))
        return (x_in, f, x_bd, jnp.zeros(len(x_bd)))

    key = jax.random.key(3)
    x_ev = jax.random.uniform(jax.random.split(key, 3)[2], (2000 if quick else 9000, 2))
    return Problem(
        "poisson2d_mixed", "2-D Poisson, mixed frequencies (2-32-32-32-1, 2,241 parameters)",
        _mlp((2, 32, 32, 32, 1), seed), draw(key), draw, _loss(None, lambda o: -o.laplacian),
        x_ev, solution(x_ev), budget,
    )


HEAT2D_KAPPA = 0.1


def heat2d(quick: bool, budget: float, seed: int = 0) -> Problem:
    """`∂_t u = κ Δu` on `(t, x, y) ∈ [0, 1]³` with `κ = 0.1`, `u(0) = sin(πx) sin(πy)` and `u = 0`
    on the sides (`u* = exp(-2κπ² t) sin(πx) sin(πy)`); a 3-32-32-32-1 MLP (2,273 parameters)."""

    def solution(txy):
        space = jnp.sin(jnp.pi * txy[..., 1]) * jnp.sin(jnp.pi * txy[..., 2])
        return jnp.exp(-2 * HEAT2D_KAPPA * jnp.pi**2 * txy[..., 0]) * space

    def draw(key):
        k_in, k_0, k_t, k_bd = jax.random.split(key, 4)
        x_in = jax.random.uniform(k_in, (1000, 3))
        # Initial points (t = 0) and points on the four sides, one point set of values.
        x0 = jnp.concatenate([jnp.zeros((60, 1)), jax.random.uniform(k_0, (60, 2))], axis=1)
        sides = jnp.concatenate([jax.random.uniform(k_t, (120, 1)), _boundary_points(k_bd, 120, 2)], axis=1)
        x_bd = jnp.concatenate([x0, sides])
        return (x_in, jnp.zeros(len(x_in)), x_bd, solution(x_bd))

    key = jax.random.key(4)
    x_ev = jax.random.uniform(jax.random.split(key, 5)[4], (3000 if quick else 9000, 3))
    weights = (0.0, HEAT2D_KAPPA, HEAT2D_KAPPA)
    return Problem(
        "heat2d", "2-D heat equation (3-32-32-32-1, 2,273 parameters)", _mlp((3, 32, 32, 32, 1), seed),
        draw(key), draw, _loss(weights, lambda o: o.gradient[:, 0] - o.laplacian), x_ev, solution(x_ev),
        budget,
    )


REACTION = (0.05, 3.0)  # ν, ρ


def reaction_diffusion(quick: bool, budget: float, seed: int = 0) -> Problem:
    """`∂_t u = ν ∂²_x u + ρ u (1 - u) + f` on `(t, x) ∈ [0, 1]²` (Fisher-KPP with a source), `ν =
    0.05`, `ρ = 3`, `f` such that `u* = exp(-t) (sin(πx) + ½ sin(3πx))`, its initial and boundary
    values given; a 2-32-32-32-1 MLP (2,241 parameters)."""
    nu, rho = REACTION

    def solution(tx, p=lambda q: 1.0):
        space = p(1) * jnp.sin(jnp.pi * tx[..., 1]) + 0.5 * p(3) * jnp.sin(3 * jnp.pi * tx[..., 1])
        return jnp.exp(-tx[..., 0]) * space

    def draw(key):
        k_in, k_t, k_x, _ = jax.random.split(key, 4)
        x_in = jax.random.uniform(k_in, (900, 2))
        u = solution(x_in)
        # f = u*_t - ν u*_xx - ρ u* (1 - u*), with u*_t = -u* and u*_xx from the modes.
        f = -u + nu * jnp.pi**2 * solution(x_in, lambda q: q**2) - rho * u * (1 - u)
        x0 = jnp.stack([jnp.zeros(40), jax.random.uniform(k_x, (40,))], axis=1)
        t = jax.random.uniform(k_t, (80,))
        x_bd = jnp.concatenate([x0, jnp.stack([t, (jnp.arange(80) % 2).astype(t.dtype)], axis=1)])
        return (x_in, f, x_bd, solution(x_bd))

    key = jax.random.key(5)
    x_ev = jax.random.uniform(jax.random.split(key, 4)[3], (2000 if quick else 9000, 2))
    residual = lambda o: o.gradient[:, 0] - o.laplacian - rho * o.value * (1 - o.value)  # noqa: E731
    return Problem(
        "reaction_diffusion", "Reaction-diffusion, Fisher-KPP (2-32-32-32-1, 2,241 parameters)",
        _mlp((2, 32, 32, 32, 1), seed), draw(key), draw, _loss((0.0, nu), residual), x_ev,
        solution(x_ev), budget,
    )


# Each problem's constructor, budget in seconds, and the methods left out by default (the
# line-search K-FAC trails K-FAC* on the 2-D problem; dense ENGD's Gramian of the wide 5-D
# network is 39,073² float64 numbers, 12.2 GB, formed and factorised at every step).
PROBLEMS = {
    "poisson2d": (poisson2d, 150.0, ()),
    "poisson5d": (poisson5d, 360.0, ("K-FAC",)),
    "poisson5d_wide": (poisson5d_wide, 360.0, ("K-FAC", "ENGD")),
    "heat1d": (heat1d, 90.0, ("K-FAC",)),
    "poisson2d_mixed": (poisson2d_mixed, 60.0, ()),
    "heat2d": (heat2d, 60.0, ()),
    "reaction_diffusion": (reaction_diffusion, 60.0, ()),
}
# The problems run by default; `--problems new` runs the others, on which the defaults of `engd`
# and `pinn_kfac` were chosen (none of them was tuned on these four).
DEFAULT_PROBLEMS = ("poisson2d", "poisson5d", "poisson5d_wide", "heat1d")
NEW_PROBLEMS = ("poisson2d_mixed", "heat2d", "reaction_diffusion")
ADAM_GRID = (1e-4, 1e-3, 1e-2)


# --- methods: each returns `(state, step)` with `step(params, state, key) -> (params, state, loss)`


def _split(problem: Problem) -> tuple[Any, Any]:
    return eqx.partition(problem.model, eqx.is_inexact_array)


def _optax_method(make: Callable[[Problem], optax.GradientTransformation], extra: str) -> Callable:
    """A method built on an optax transformation; `extra` names what its `update` needs."""

    def build(problem: Problem):
        params, static = _split(problem)
        optimizer = make(problem)

        @jax.jit
        def step(params, state, key):
            # L-BFGS keeps the fixed points: its line search and curvature pairs assume one loss.
            batch = problem.batch if extra == "lbfgs" else problem.batch_at(key)
            value_fn = lambda p: problem.loss(eqx.combine(p, static), batch)  # noqa: E731
            value, grads = jax.value_and_grad(value_fn)(params)
            kwargs = dict(value=value, value_fn=value_fn)
            if extra == "lbfgs":
                kwargs["grad"] = grads
            elif extra == "batch":
                kwargs["batch"] = batch
            else:
                kwargs = {}
            updates, state = optimizer.update(grads, state, params, **kwargs)
            return optax.apply_updates(params, updates), state, value

        state = optimizer.init(params)
        if extra == "lbfgs":
            # optax.lbfgs starts some state entries weakly typed and returns them strongly typed:
            # without this, its second call compiles again.
            out = jax.eval_shape(step, params, state, jax.random.key(0))[1]
            state = jax.tree.map(lambda x, s: x if s.weak_type else jnp.asarray(x, s.dtype), state, out)
        return state, step

    return build


# K-FAC*'s step rule on fixed points: the default's adapted learning rate and trust region, the
# momentum adapted without bounds (kfac-jax's default).
PINN_STEP_RULE = eqx_kfac.MomentumStep(
    eqx_kfac.AdaptiveHyperparameter(0.0, 10.0), eqx_kfac.AdaptiveHyperparameter(), max_predicted_decrease=0.5
)


def _kfac_star(problem: Problem):
    params, static = _split(problem)
    refresh_period = 1 if problem.resample else 5
    optimizer = eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(problem.loss),
        # The recommended damping rule, from 1e-3 and with a floor of 1e-12.
        damping_rule=eqx_kfac.LevenbergMarquardtDamping(1e-3, minimum=1e-12, fault_increase=2.0),
        # On fixed points the curvature is exact and deterministic, and a moving average of it
        # only lags behind the parameters; fresh points at every step make it noisy. On fixed
        # points it also changes only as the parameters do: refreshing it (a second backward
        # pass through the Taylor network) every fifth step buys more steps than it costs.
        refresh=eqx_kfac.RefreshSchedule(
            num_burnin_steps=0, curvature_update_period=refresh_period,
            inverse_update_period=refresh_period, curvature_ema=0.95 if problem.resample else 0.0,
        ),
        curvature=eqx_kfac.CurvatureOptions(
            estimation_mode="ggn_exact",
            layer_tag_to_block_ctor={"taylor_dense": eqx_kfac.TaylorDenseKroneckerSum},
        ),
        # On fixed points the loss is deterministic and the adapted momentum is the conjugate
        # direction's coefficient, which settles near 1: bounding it by the default's 0.95 slowed
        # every problem (docs/pinn.md, "The momentum on fixed points"). Fresh points keep the bounds.
        **({} if problem.resample else {"step_rule": PINN_STEP_RULE}),
    )
    state = optimizer.init(problem.model, jax.random.key(0), problem.batch)

    draw = jax.jit(problem.draw)

    def step(params, state, key):
        # On fixed points, no call of a jitted draw per step (a dispatch the others do not pay).
        batch = draw(key) if problem.resample else problem.batch
        model, state, stats = optimizer.step(eqx.combine(params, static), state, key, batch=batch)
        return eqx.filter(model, eqx.is_inexact_array), state, stats["loss"]

    return state, step


def methods(problem: Problem) -> dict[str, Callable]:
    """The methods compared on `problem`, by name."""
    found = {f"Adam {lr:g}": _optax_method(lambda p, lr=lr: optax.adam(lr), "none") for lr in ADAM_GRID}
    found["L-BFGS"] = _optax_method(lambda p: optax.lbfgs(), "lbfgs")
    # Their defaults: the damping starts at 1 and adapts to the line search (docs/pinn.md).
    found["ENGD"] = _optax_method(
        lambda p: eqx_kfac.engd(p.loss, (p.model, p.batch), solver=lx.Cholesky()), "batch"
    )
    found["K-FAC"] = _optax_method(lambda p: eqx_kfac.pinn_kfac(p.loss, (p.model, p.batch)), "batch")
    found["K-FAC*"] = _kfac_star
    return found


@dataclasses.dataclass
class Run:
    """One method's run: its state and the checkpoints `(seconds, steps, error, loss)`."""

    name: str
    params: Any
    state: Any
    step: Callable
    elapsed: float = 0.0
    steps: int = 0
    first_call: float = float("nan")
    checkpoints: list = dataclasses.field(default_factory=list)

    def advance(self, problem: Problem, until: float) -> None:
        """Takes steps until the run's own clock reaches `until`, then records a checkpoint."""
        static = _split(problem)[1]
        loss = jnp.nan
        while self.elapsed < until:
            start = time.perf_counter()
            self.params, self.state, loss = self.step(self.params, self.state, jax.random.key(self.steps))
            jax.block_until_ready((self.params, loss))
            self.elapsed += time.perf_counter() - start
            if self.steps == 0:
                self.first_call = self.elapsed
            self.steps += 1
        model = eqx.combine(self.params, static)
        self.checkpoints.append((self.elapsed, self.steps, problem.error(model), float(loss)))

    def error_at(self, seconds: float) -> float:
        """The error after the step that took the run's clock past `seconds` (the slice's end)."""
        return next((e for t, _, e, _ in self.checkpoints if t >= seconds), self.checkpoints[-1][2])


def run_problem(problem: Problem, slices: int, names: list[str]) -> list[Run]:
    """The methods `names` on `problem`, alternating in `slices` slices of the budget."""
    params = _split(problem)[0]
    runs = []
    for name, build in methods(problem).items():
        if name not in names:
            continue
        start = time.perf_counter()
        state, step = build(problem)  # tracing for the registrations is part of the method's time
        run = Run(name, params, state, step, elapsed=time.perf_counter() - start)
        run.checkpoints.append((0.0, 0, problem.error(problem.model), float("nan")))
        runs.append(run)
    for k in range(1, slices + 1):
        for run in runs:
            run.advance(problem, problem.budget * k / slices)
        print(f"  {problem.name}: slice {k}/{slices}: " + ", ".join(f"{r.name} {r.checkpoints[-1][2]:.2e}" for r in runs), flush=True)
    return runs


def table(problem: Problem, runs: list[Run]) -> str:
    """A markdown table of the runs: steps, first call, and the error at fractions of the budget."""
    budget = problem.budget
    lines = [
        f"**{problem.title}**, budget {budget:g} s",
        "",
        "| method | steps | first call (s) | error at 25% | error at 50% | error at 100% |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        errors = " | ".join(f"{run.error_at(budget * f):.2e}" for f in (0.25, 0.5, 1.0))
        lines.append(f"| {run.name} | {run.steps} | {run.first_call:.1f} | {errors} |")
    return "\n".join(lines)


def ratios(problem: Problem, runs: list[Run]) -> str:
    """K-FAC's error over each other method's, at the budget (below 1: K-FAC is ahead)."""
    at_end = {r.name: r.error_at(problem.budget) for r in runs}
    adam = min((v for k, v in at_end.items() if k.startswith("Adam")), default=float("nan"))
    lines = []
    for kfac in ("K-FAC", "K-FAC*"):
        if kfac not in at_end:
            continue
        others = {"best Adam": adam, **{k: v for k, v in at_end.items() if k in ("L-BFGS", "ENGD")}}
        parts = [f"{at_end[kfac] / v:.3g}x {k}" for k, v in others.items() if np.isfinite(v)]
        lines.append(f"{kfac} error at {problem.budget:g} s: " + ", ".join(parts))
    return "\n".join(lines)


def plot(problem: Problem, runs: list[Run], path: str) -> None:
    """The relative L2 error over seconds and over steps (log scales), one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), dpi=90)
    names = list(methods(problem))
    for run in runs:
        t, s, e, _ = map(np.asarray, zip(*run.checkpoints))
        style = dict(linestyle="-" if "K-FAC" in run.name else "--", color=f"C{names.index(run.name)}")
        axes[0].plot(t[1:], e[1:], label=run.name, **style)
        axes[1].plot(np.maximum(s[1:], 1), e[1:], label=run.name, **style)
    for ax, xlabel in zip(axes, ("seconds (from the first call)", "steps")):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("relative L2 error")
    axes[1].legend(fontsize=7)
    fig.suptitle(problem.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short budgets and fewer points")
    parser.add_argument(
        "--problems", nargs="+", default=list(DEFAULT_PROBLEMS), choices=[*PROBLEMS, "new"],
        help="the problems to run (default: the paper's four; 'new': " + ", ".join(NEW_PROBLEMS) + ")",
    )
    parser.add_argument("--methods", nargs="+", default=None, help="only these methods (by name)")
    parser.add_argument("--budget", type=float, default=None, help="seconds per method (default per problem)")
    parser.add_argument("--slices", type=int, default=None, help="alternation slices per budget")
    parser.add_argument("--plot-dir", default=None, help="write pinn_<problem>.png here")
    parser.add_argument("--json", default=None, help="write the checkpoints here")
    parser.add_argument("--seed", type=int, default=0, help="the network's initialisation key")
    parser.add_argument(
        "--compilation-cache", default=None,
        help="a persistent compilation cache directory: a later run loads what an earlier compiled",
    )
    parser.add_argument(
        "--resample", nargs="*", default=None, choices=list(PROBLEMS),
        help="draw fresh training points at every step on these problems (no names: all)",
    )
    args = parser.parse_args()
    if args.compilation_cache:
        eqx_kfac.enable_compilation_cache(args.compilation_cache)
    results = {}
    for name in [n for p in args.problems for n in (NEW_PROBLEMS if p == "new" else (p,))]:
        make, default_budget, skipped = PROBLEMS[name]
        budget = args.budget or (default_budget / 3 if args.quick else default_budget)
        problem = make(args.quick, budget, args.seed)
        if args.resample is not None and (not args.resample or name in args.resample):
            problem = dataclasses.replace(problem, resample=True)
        names = args.methods or [m for m in methods(problem) if m not in skipped]
        print(f"{problem.title}: {parameter_count(problem.model)} parameters", flush=True)
        runs = run_problem(problem, args.slices or (6 if args.quick else 20), names)
        print(table(problem, runs))
        print(ratios(problem, runs), flush=True)
        if args.plot_dir:
            plot(problem, runs, os.path.join(args.plot_dir, f"pinn_{name}.png"))
        results[name] = {r.name: {"first_call": r.first_call, "checkpoints": r.checkpoints} for r in runs}
        jax.clear_caches()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
