"""Training a zoo problem with Adam, `eqx_kfac.Optimizer` or the optax K-FAC recipe.

`train(problem, method, steps, ...)` runs one method for `steps` steps on the problem's batch
stream, the same stream for every method, and records the loss of every step, the wall-clock time
of every compiled step and the time of the first call (tracing, compilation and one step, as a user
waits for it). All three methods train the same function: the problem's loss, whose registrations
are identities for Adam.

- `"adam"`: `optax.adam(learning_rate)`.
- `"kfac"`: `eqx_kfac.Optimizer` in its recommended configuration: adaptive learning rate,
  momentum and damping, everything else at its default (bounded coefficients, step rejection).
- `"recipe"`: the documented optax recipe, `eqx_kfac.kfac_optax(loss, example_args,
  learning_rate)` (K-FAC preconditioning, a norm constraint, momentum).
"""

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax

import eqx_kfac

from ._problem import ZooProblem

METHODS = ("adam", "kfac", "recipe")
# The step statistics of `Optimizer` a `ZooRun` keeps.
KFAC_STATS = ("learning_rate", "momentum", "damping", "skipped", "rejected")


@dataclasses.dataclass(frozen=True)
class ZooRun:
    """One training run of a zoo problem.

    **Fields:**

    - `problem`, `method`: names.
    - `learning_rate`: the learning rate (`None` for the adaptive `"kfac"`).
    - `losses`: `(steps,)`, the training loss of each step's batch, before the step (fewer
      entries when the run stopped early at a non-finite loss).
    - `times`: `(steps - 1,)`, seconds of each compiled step after the first.
    - `first_call`: seconds of the first step, compilation included.
    - `stats`: for `"kfac"`, the step statistics `learning_rate`, `momentum`, `damping`,
      `skipped`, `rejected` of every step (empty for the other methods).
    - `model`, `state`: the model and the method's state after the last step.
    """

    problem: str
    method: str
    learning_rate: float | None
    losses: np.ndarray
    times: np.ndarray
    first_call: float
    stats: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    model: Any = None
    state: Any = None

    def final_loss(self, window: int = 10) -> float:
        """The mean training loss of the last `window` steps (NaN if the run diverged)."""
        if len(self.losses) == 0 or not np.all(np.isfinite(self.losses[-window:])):
            return float("nan")
        return float(np.mean(self.losses[-window:]))

    @property
    def ms_per_step(self) -> float:
        """The median milliseconds of a compiled step."""
        return float(np.median(self.times) * 1e3) if len(self.times) else float("nan")


def _func_args(problem: ZooProblem, model: Any, func_state: Any, key: Any, batch: Any) -> tuple:
    args = (model,)
    if problem.has_state:
        args += (func_state,)
    if problem.has_rng:
        args += (key,)
    return args + (batch,)


def _split(problem: ZooProblem, out: Any) -> tuple[Any, Any]:
    """`(loss, func_state)` of the loss function's output."""
    return out if problem.has_state else (out, None)


def _adam(problem: ZooProblem, learning_rate: float) -> tuple[Callable, Any]:
    transform = optax.adam(learning_rate)
    value_and_grad = eqx.filter_value_and_grad(
        lambda *args: problem.loss(*args), has_aux=problem.has_state
    )

    @eqx.filter_jit
    def step(model, state, key, batch):
        opt_state, func_state = state
        out, grads = value_and_grad(*_func_args(problem, model, func_state, key, batch))
        loss, func_state = out if problem.has_state else (out, func_state)
        updates, opt_state = transform.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), (opt_state, func_state), loss

    return step, (transform.init(eqx.filter(problem.model, eqx.is_inexact_array)), problem.func_state)


def make_optimizer(problem: ZooProblem, **overrides: Any) -> eqx_kfac.Optimizer:
    """`eqx_kfac.Optimizer` in its recommended configuration for a problem: adaptive learning rate,
    momentum and damping, the other keywords at their defaults.

    **Arguments:**

    - `problem`: the zoo problem.
    - `**overrides`: `Optimizer` keywords replacing the defaults here.

    **Returns:**

    The optimizer.
    """
    options = dict(
        l2_reg=0.0,
        value_func_has_state=problem.has_state,
        value_func_has_rng=problem.has_rng,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
    )
    options.update(overrides)
    return eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(problem.loss, has_aux=problem.has_state), **options
    )


def _kfac(problem: ZooProblem, batch: Any, **overrides: Any) -> tuple[Callable, Any]:
    optimizer = make_optimizer(problem, **overrides)

    @eqx.filter_jit
    def step(model, state, key, batch):
        kfac_state, func_state = state
        out = optimizer.step(model, kfac_state, key, batch=batch, func_state=func_state)
        if problem.has_state:
            model, kfac_state, func_state, stats = out
        else:
            model, kfac_state, stats = out
        return model, (kfac_state, func_state), {k: stats[k] for k in ("loss", *KFAC_STATS)}

    init = optimizer.init(problem.model, jax.random.key(0), batch, func_state=problem.func_state)
    return step, (init, problem.func_state)


def _recipe(problem: ZooProblem, batch: Any, learning_rate: float, **options: Any) -> tuple[Callable, Any]:
    example = _func_args(problem, problem.model, problem.func_state, jax.random.key(0), batch)
    transform = eqx_kfac.kfac_optax(problem.loss, example, learning_rate, **options)
    value_and_grad = eqx.filter_value_and_grad(
        lambda *args: problem.loss(*args), has_aux=problem.has_state
    )

    @eqx.filter_jit
    def step(model, state, key, batch):
        opt_state, func_state = state
        args = _func_args(problem, model, func_state, key, batch)
        out, grads = value_and_grad(*args)
        loss, new_func_state = out if problem.has_state else (out, func_state)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = transform.update(grads, opt_state, params, loss_args=args[1:], key=key)
        return eqx.apply_updates(model, updates), (opt_state, new_func_state), loss

    return step, (transform.init(eqx.filter(problem.model, eqx.is_inexact_array)), problem.func_state)


def train(
    problem: ZooProblem,
    method: str,
    steps: int,
    learning_rate: float | None = None,
    seed: int = 0,
    perturb: Callable[[int, Any], Any] | None = None,
    stop_at_nonfinite: bool = True,
    **kfac_overrides: Any,
) -> ZooRun:
    """Trains a zoo problem with one method.

    **Arguments:**

    - `problem`: the problem (its model is the initial point of every method).
    - `method`: `"adam"`, `"kfac"` or `"recipe"`.
    - `steps`: the number of steps.
    - `learning_rate`: for `"adam"` and `"recipe"`.
    - `seed`: seeds the batch stream's keys (Monte Carlo moves, dropout, K-FAC's sampling).
    - `perturb`: `perturb(step, batch) -> batch`, applied to every batch before the step (e.g. to
      inject an outlier batch).
    - `stop_at_nonfinite`: stop at the first non-finite loss.
    - `**kfac_overrides`: `Optimizer` keywords for `"kfac"`, `kfac_optax` keywords for
      `"recipe"`.

    **Returns:**

    The `ZooRun`.
    """
    keys = jax.random.split(jax.random.key(seed), 2 * steps).reshape(steps, 2)
    batch = problem.next_batch(problem.model, 0, keys[0, 0], None)
    if method == "adam":
        step, state = _adam(problem, learning_rate)
    elif method == "kfac":
        step, state = _kfac(problem, batch, **kfac_overrides)
    elif method == "recipe":
        step, state = _recipe(problem, batch, learning_rate, **kfac_overrides)
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    model, records, times, first_call = problem.model, [], [], 0.0
    for t in range(steps):
        if t:
            batch = problem.next_batch(model, t, keys[t, 0], batch)
        step_batch = batch if perturb is None else perturb(t, batch)
        start = time.perf_counter()
        model, state, record = jax.block_until_ready(step(model, state, keys[t, 1], step_batch))
        elapsed = time.perf_counter() - start
        if t == 0:
            first_call = elapsed
        else:
            times.append(elapsed)
        records.append(jax.device_get(record))
        loss = records[-1]["loss"] if isinstance(records[-1], dict) else records[-1]
        if stop_at_nonfinite and not np.isfinite(loss):
            break
    losses = np.asarray([r["loss"] if isinstance(r, dict) else r for r in records], float)
    stats = {k: np.asarray([r[k] for r in records]) for k in KFAC_STATS} if method == "kfac" else {}
    return ZooRun(
        problem.name, method, learning_rate, losses, np.asarray(times), first_call, stats, model,
        state,
    )
