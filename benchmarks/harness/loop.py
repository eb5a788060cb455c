"""The training loop every benchmark uses: `run_round` trains several methods side by side, `train`
one.

Every run starts from the problem's model and sees the problem's batch stream for the seed (the
same keys, the same data; a run's Monte Carlo batches follow its own model). The runs of a round
advance one step each in turn, so load from other processes falls on all of them alike. Each run's
first call is timed by stage (`FirstCall`): building the optimizer and its state, then tracing,
lowering and compiling its step (`compile_in_stages`), then running step 0. `Optimizer`'s step,
which compiles itself, is called directly, as its docs tell users to call it, and its first call
is split into the same stages by JAX's monitoring events (`call_in_stages`; `run` is the rest of
the call). Every later step is timed from its call until its result is ready, and so is the
sampling of its batch.
"""

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .methods import JIT_COMPILER_OPTIONS, Method, make_step, quiet, SELF_COMPILING
from .problem import Problem
from .progress import Progress
from .record import Run
from .staging import call_in_stages, compile_in_stages, FirstCall


@dataclasses.dataclass
class _Training:
    """A run in progress."""

    method: Method
    step: Callable
    state: Any
    model: Any
    batch: Any
    first_call: FirstCall
    records: list
    times: list = dataclasses.field(default_factory=list)
    batch_times: list = dataclasses.field(default_factory=list)
    stopped: bool = False


def _timed(function: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = jax.block_until_ready(function())
    return out, time.perf_counter() - start


def _start(
    problem: Problem, method: Method, batch: Any, key: Any, on_stage: Callable[[str, float], None] | None = None
) -> _Training:
    """Builds a method's step and state and takes its first step, timing each stage."""
    stage = on_stage or (lambda name, seconds: None)
    (step, state), setup = _timed(lambda: quiet(make_step, problem, method, batch))
    stage("setup", setup)
    args = (problem.model, state, key, batch)
    if method.name in SELF_COMPILING:
        compiled = step
        (model, state, record), compile_times, run = call_in_stages(step, *args)
        for name in ("trace", "lower", "compile"):
            stage(name, getattr(compile_times, name))
    else:
        compiled, compile_times = compile_in_stages(
            step, *args, on_stage=on_stage, compiler_options=JIT_COMPILER_OPTIONS.get(method.name)
        )
        (model, state, record), run = _timed(lambda: compiled(*args))
    stage("run", run)
    stages = FirstCall(setup, compile_times.trace, compile_times.lower, compile_times.compile, run)
    return _Training(method, compiled, state, model, batch, stages, [jax.device_get(record)])


def _keys(seed: int, steps: int) -> Any:
    """`(steps, 2)` keys: step `t`'s batch's and its step's."""
    return jax.random.split(jax.random.key(seed), 2 * steps).reshape(steps, 2)


def first_call(
    problem: Problem, method: Method, seed: int = 0, on_stage: Callable[[str, float], None] | None = None
) -> FirstCall:
    """Times one method's first call on a problem (the first call of `run_round`'s runs), stage by
    stage.

    **Arguments:**

    - `problem`, `method`, `seed`: as for `train`.
    - `on_stage`: called with each stage's name (`setup`, `trace`, `lower`, `compile`, `run`) and
      seconds as it ends, e.g. to see how far a first call that does not end has come.

    **Returns:**

    The `FirstCall`.
    """
    keys = _keys(seed, 1)
    batch = problem.next_batch(problem.model, 0, keys[0, 0], None)
    return _start(problem, method, batch, keys[0, 1], on_stage).first_call


def _advance(problem: Problem, run: _Training, t: int, keys: Any, perturb: Callable | None) -> None:
    """Samples step `t`'s batch and takes the step."""
    run.batch, seconds = _timed(lambda: problem.next_batch(run.model, t, keys[t, 0], run.batch))
    run.batch_times.append(seconds)
    batch = run.batch if perturb is None else perturb(t, run.batch)
    (run.model, run.state, record), seconds = _timed(lambda: run.step(run.model, run.state, keys[t, 1], batch))
    run.times.append(seconds)
    run.records.append(jax.device_get(record))


def _finish(problem: Problem, run: _Training, seed: int, keep_final: bool) -> Run:
    losses = np.asarray([r["loss"] for r in run.records], float)
    stats = {k: np.asarray([r[k] for r in run.records]) for k in run.records[0] if k != "loss"}
    return Run(
        problem=problem.name, method=run.method.name, learning_rate=run.method.learning_rate,
        seed=seed, losses=losses, times=np.asarray(run.times), batch_times=np.asarray(run.batch_times),
        first_call=run.first_call, stats=stats, model=run.model if keep_final else None,
        state=run.state if keep_final else None,
    )


def run_round(
    problem: Problem,
    methods: Sequence[Method],
    steps: int | Sequence[int],
    seed: int = 0,
    *,
    perturb: Callable[[int, Any], Any] | None = None,
    stop_at_nonfinite: bool = True,
    stop_below: float | None = None,
    keep_final: bool = False,
    observe: Callable[[int, int, Any], None] | None = None,
) -> list[Run]:
    """Trains one run per method, the runs taking one step each in turn.

    **Arguments:**

    - `problem`: the problem.
    - `methods`: the runs' methods.
    - `steps`: the most steps of each run, or one number per method.
    - `seed`: seeds the batch stream's keys.
    - `perturb`: `perturb(step, batch) -> batch`, applied to every batch before its step (e.g. to
      inject an outlier batch).
    - `stop_at_nonfinite`: stop a run at its first non-finite loss.
    - `stop_below`: stop a run once a loss is at most this (`None`: run every step).
    - `keep_final`: keep each run's last model and state in its `Run`.
    - `observe`: `observe(index, step, model)`, called after every step of the run of
      `methods[index]` with its new model, outside the timed work (e.g. to evaluate a validation
      loss now and then).

    **Returns:**

    One `Run` per method, in order.
    """
    budgets = [steps] * len(methods) if isinstance(steps, int) else list(steps)
    if len(budgets) != len(methods):
        raise ValueError(f"run_round: {len(budgets)} step budgets for {len(methods)} methods.")
    observe = observe or (lambda index, step, model: None)
    keys = _keys(seed, max(budgets))
    first_batch = problem.next_batch(problem.model, 0, keys[0, 0], None)
    # Sampling's own compilation (the Monte Carlo moves) is charged to no run.
    jax.block_until_ready(problem.next_batch(problem.model, 1, keys[0, 0], first_batch))
    step_batch = first_batch if perturb is None else perturb(0, first_batch)
    runs = []
    for index, method in enumerate(methods):
        runs.append(_start(problem, method, step_batch, keys[0, 1]))
        runs[-1].batch = first_batch
        observe(index, 0, runs[-1].model)
    progress = Progress(max(budgets), f"{problem.name} seed {seed}")
    for t in range(1, max(budgets)):
        for index, (run, budget) in enumerate(zip(runs, budgets)):
            loss = run.records[-1]["loss"]
            run.stopped |= t >= budget or (stop_at_nonfinite and not np.isfinite(loss)) or (
                stop_below is not None and loss <= stop_below
            )
            if not run.stopped:
                _advance(problem, run, t, keys, perturb)
                observe(index, t, run.model)
        progress.update(t + 1, ", ".join(f"{r.method.label}: {r.records[-1]['loss']:.4g}" for r in runs))
    progress.close()
    # A warm start's compilation that the round ended before needing runs on in its thread; it
    # would slow the next round's first call (a kfac_optax warm start's setup took 44 s instead
    # of 2 s after the round of an Optimizer's warm start on Flax's ImageNet example).
    for thread in threading.enumerate():
        if thread.name == "eqx_kfac-compile":
            thread.join()
    # The round's compiled steps are not used again. XLA on CPU maps each compiled kernel into the
    # process (a K-FAC step has about a thousand), and a process that keeps every round's programs
    # reaches Linux's limit on memory mappings and dies in the compiler.
    jax.clear_caches()
    return [_finish(problem, run, seed, keep_final) for run in runs]


def train(problem: Problem, method: Method, steps: int, seed: int = 0, **options: Any) -> Run:
    """Trains a problem with one method: `run_round` with one run.

    **Arguments:**

    - `problem`, `steps`, `seed`: as for `run_round`.
    - `method`: the method.
    - `**options`: `run_round`'s keywords.

    **Returns:**

    The `Run`.
    """
    return run_round(problem, [method], steps, seed, **options)[0]
