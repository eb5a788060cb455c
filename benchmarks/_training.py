"""Full-batch training loops (optax and K-FAC) that record the loss and the wall-clock time per step.

Each loop compiles its step (`eqx.filter_jit`) with one warm-up call on the initial parameters,
timed on its own as the compile time and then discarded (the steps are pure, so it changes
nothing). Then every step is timed from its call until its loss is ready, so the per-step times
include Python dispatch but no compilation. `losses[t]` is the objective at the parameters after
`t` steps (the last entry is evaluated after the loop, untimed); `times[t]` is the wall-clock time
of step `t`. A run whose loss stops being finite ends there, with a NaN final loss. What a user
waits for `losses[t]`, compilation included, is the first call (which computes step 1) and the
compiled steps 2 to `t` after it (`Run.elapsed_from_first_call`).
"""

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from tqdm.auto import tqdm

import eqx_kfac

from _problems import L2_REG, Problem


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run.

    **Fields:**

    - `problem`, `optimizer`: names, e.g. `"autoencoder"`, `"adam"`.
    - `learning_rate`: the fixed learning rate, or `None` for K-FAC (adaptive).
    - `seed`: the seed of the model initialisation (and of K-FAC's random keys).
    - `losses`: `(steps + 1,)`, the objective before each step and after the last (fewer steps
      when the run stopped early).
    - `times`: `(steps,)`, seconds per step (compiled).
    - `compile_time`: seconds of the first call (tracing, compilation and one step; that step
      runs again, compiled, as `times[0]`).
    """

    problem: str
    optimizer: str
    learning_rate: float | None
    seed: int
    losses: np.ndarray
    times: np.ndarray
    compile_time: float

    @property
    def label(self) -> str:
        """The optimizer and its learning rate, e.g. `adam lr=0.001`."""
        return _label(self.optimizer, self.learning_rate)

    @property
    def final_loss(self) -> float:
        """The objective after the last step (NaN if the run diverged)."""
        return float(self.losses[-1])

    @property
    def elapsed(self) -> np.ndarray:
        """`(steps + 1,)`: seconds spent in compiled steps before `losses[t]` was reached."""
        return np.concatenate([[0.0], np.cumsum(self.times)])

    @property
    def elapsed_from_first_call(self) -> np.ndarray:
        """`(steps + 1,)`: seconds a user waits for `losses[t]`, compilation included.

        The first call (`compile_time`) computes step 1 and the compiled steps 2, 3, ... follow:
        `0` for `t = 0`, then `compile_time + times[1] + ... + times[t - 1]`.
        """
        return np.concatenate([[0.0], self.compile_time + np.cumsum(self.times) - self.times[0]])

    def first_reaching(self, target: float) -> int | None:
        """The first step count `t` with `losses[t] <= target`, or `None` if never."""
        reached = np.flatnonzero(self.losses <= target)
        return int(reached[0]) if reached.size else None


def _label(optimizer: str, learning_rate: float | None) -> str:
    return optimizer if learning_rate is None else f"{optimizer} lr={learning_rate:g}"


def _train(
    problem: Problem,
    optimizer: str,
    learning_rate: float | None,
    seed: int,
    steps: int,
    step_fn: Callable[[Any, Any, Any], tuple[Any, Any, Any]],
    model: Any,
    opt_state: Any,
    stop_below: float | None = None,
    dense_block: str = "kfac",
) -> Run:
    """Runs `step_fn(model, opt_state, batch) -> (model, opt_state, loss)` (already jitted)."""
    label = _label(optimizer, learning_rate)
    start = time.perf_counter()
    jax.block_until_ready(step_fn(model, opt_state, problem.batch))
    compile_time = time.perf_counter() - start

    losses, times = [], []
    progress = tqdm(range(steps), desc=f"{problem.name:<11} {label:<15}", leave=False)
    for t in progress:
        start = time.perf_counter()
        model, opt_state, loss = jax.block_until_ready(step_fn(model, opt_state, problem.batch))
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if t % 25 == 0:
            progress.set_postfix(loss=f"{losses[-1]:.4g}", refresh=False)
        if not np.isfinite(losses[-1]) or (stop_below is not None and losses[-1] <= stop_below):
            break
    progress.close()
    losses.append(float(_objective(problem, model)) if np.isfinite(losses[-1]) else np.nan)
    return Run(
        problem=problem.name,
        optimizer=optimizer,
        learning_rate=learning_rate,
        seed=seed,
        losses=np.asarray(losses),
        times=np.asarray(times),
        compile_time=compile_time,
    )


@eqx.filter_jit
def _objective_jit(loss: Callable[[Any, Any], jax.Array], model: Any, batch: Any) -> jax.Array:
    return loss(model, batch)


def _objective(problem: Problem, model: Any) -> jax.Array:
    return _objective_jit(problem.loss, model, problem.batch)


def train_optax(
    problem: Problem,
    optimizer: str,
    learning_rate: float,
    seed: int,
    steps: int,
) -> Run:
    """Trains `problem` with Adam or SGD (momentum 0.9) at a fixed learning rate.

    **Arguments:**

    - `problem`: the problem.
    - `optimizer`: `"adam"` or `"sgd"`.
    - `learning_rate`: the learning rate.
    - `seed`: the seed of the model initialisation.
    - `steps`: the number of steps.

    **Returns:**

    The `Run`.
    """
    if optimizer == "adam":
        tx = optax.adam(learning_rate)
    elif optimizer == "sgd":
        tx = optax.sgd(learning_rate, momentum=0.9)
    else:
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}.")
    model = problem.make_model(jax.random.key(seed))
    value_and_grad = eqx.filter_value_and_grad(problem.loss)

    @eqx.filter_jit
    def step(model, opt_state, batch):
        loss, grads = value_and_grad(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    return _train(problem, optimizer, learning_rate, seed, steps, step, model, opt_state)


DENSE_BLOCKS = {
    "kfac": eqx_kfac.DenseTwoKroneckerFactored,
    "ekfac": eqx_kfac.DenseEigenbasisKFAC,
}


def make_kfac(
    problem: Problem, estimation_mode: str, num_burnin_steps: int, dense_block: str = "kfac"
) -> Any:
    """K-FAC with adaptive learning rate, momentum and damping (initial damping 1.0).

    **Arguments:**

    - `problem`: the problem (its objective is trained, its data loss gives the curvature).
    - `estimation_mode`: the curvature estimation mode, e.g. `"ggn_curvature_prop"`.
    - `num_burnin_steps`: curvature updates on the first batch before the first step.
    - `dense_block`: `"kfac"` (Kronecker factors) or `"ekfac"` (eigenvalue-corrected K-FAC) for
      the dense layers.

    **Returns:**

    An `eqx_kfac.Optimizer`.
    """
    return eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(problem.loss),
        l2_reg=L2_REG,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
        estimation_mode=estimation_mode,
        curvature_ema=0.95,
        inverse_update_period=5,
        damping_adaptation_interval=5,
        num_burnin_steps=num_burnin_steps,
        layer_tag_to_block_ctor={"dense": DENSE_BLOCKS[dense_block]},
    )


def train_kfac(
    problem: Problem,
    seed: int,
    steps: int,
    estimation_mode: str = "ggn_curvature_prop",
    num_burnin_steps: int = 10,
    stop_below: float | None = None,
    dense_block: str = "kfac",
) -> Run:
    """Trains `problem` with K-FAC (adaptive learning rate, momentum and damping).

    **Arguments:**

    - `problem`: the problem.
    - `seed`: the seed of the model initialisation and of K-FAC's random keys.
    - `steps`: the largest number of steps.
    - `estimation_mode`, `num_burnin_steps`, `dense_block`: as for `make_kfac`.
    - `stop_below`: stop as soon as the objective is at most this (`None`: run all steps).

    **Returns:**

    The `Run`.
    """
    kfac = make_kfac(problem, estimation_mode, num_burnin_steps, dense_block)
    model = problem.make_model(jax.random.key(seed))
    init_key, step_key = jax.random.split(jax.random.fold_in(jax.random.key(seed), 1))
    state = (kfac.init(model, init_key, problem.batch), step_key)

    @eqx.filter_jit
    def step(model, state, batch):
        kfac_state, key = state
        key, subkey = jax.random.split(key)
        model, kfac_state, stats = kfac.step(model, kfac_state, subkey, batch=batch)
        return model, (kfac_state, key), stats["loss"]

    return _train(problem, "kfac", None, seed, steps, step, model, state, stop_below)
