"""A step compiled in JAX's stages, each timed: where the seconds of a first call go.

`jax.jit(f).trace(*args)` runs the Python of `f` (for K-FAC: the loss traced again inside the step,
its layers found and matched) and gives a jaxpr; `.lower()` turns it into StableHLO; `.compile()`
is XLA's compilation. A user's first call of a jitted step does the three and then runs the
compiled program; `compile_in_stages` does the same, one stage at a time, and keeps the compiled
program for the steps after. Arguments and results may be any PyTree (an `eqx.Module` with
functions and other non-array leaves): the arrays are the program's inputs and outputs, the rest
is fixed at the first call, as under `eqx.filter_jit`.
"""

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax


@dataclasses.dataclass(frozen=True)
class FirstCall:
    """The seconds of a run's first call, by stage (wall clock).

    **Fields:**

    - `setup`: building the optimizer and its state (for K-FAC, `Optimizer.init` or
      `kfac_optax`: tracing the loss, registering its layers, the curvature's first statistics).
    - `trace`: tracing the step to a jaxpr (Python: the loss, the optimizer's logic).
    - `lower`: lowering the jaxpr to StableHLO.
    - `compile`: XLA's compilation.
    - `run`: running the compiled first step.
    """

    setup: float
    trace: float
    lower: float
    compile: float
    run: float

    @property
    def total(self) -> float:
        """The whole first call: what a user waits for before the first step's result."""
        return self.setup + self.trace + self.lower + self.compile + self.run


@dataclasses.dataclass(frozen=True)
class CompileTimes:
    """Seconds of the three stages of `compile_in_stages`: `trace`, `lower`, `compile`."""

    trace: float
    lower: float
    compile: float


def _timed(function: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = function()
    return out, time.perf_counter() - start


def compile_in_stages(
    function: Callable[..., Any],
    *args: Any,
    on_stage: Callable[[str, float], None] | None = None,
    compiler_options: dict[str, Any] | None = None,
) -> tuple[Callable[..., Any], CompileTimes]:
    """Compiles `function` for `args` stage by stage, timing each.

    **Arguments:**

    - `function`: a pure function of PyTrees.
    - `*args`: example arguments (the arrays' shapes and dtypes and every non-array leaf are
      those of every later call).
    - `on_stage`: called with each stage's name and seconds as it ends (`None`: not called).
    - `compiler_options`: XLA's compiler options (`jax.jit`'s; `None`: XLA's defaults).

    **Returns:**

    `(compiled, times)`: `compiled(*args)` runs the compiled program on new arguments of the same
    structure (it does not block), and the `CompileTimes`.
    """
    dynamic, static = eqx.partition(args, eqx.is_array)
    out_static = []

    def on_arrays(dynamic: Any) -> Any:
        out_dynamic, out_rest = eqx.partition(function(*eqx.combine(dynamic, static)), eqx.is_array)
        out_static.append(out_rest)
        return out_dynamic

    jitted = jax.jit(on_arrays, compiler_options=compiler_options)
    stage = on_stage or (lambda name, seconds: None)
    traced, trace = _timed(lambda: jitted.trace(dynamic))
    stage("trace", trace)
    lowered, lower = _timed(traced.lower)
    stage("lower", lower)
    _, compile_ = _timed(lowered.compile)
    stage("compile", compile_)

    # Later calls go through `jitted`, which finds the program compiled above in JAX's caches (no
    # second trace or compilation) and dispatches it on JAX's fast path (calling the `Compiled`
    # object costs about 0.15 ms more per call, a third of a small model's step).
    def compiled(*args: Any) -> Any:
        return eqx.combine(jitted(eqx.filter(args, eqx.is_array)), out_static[0])

    return compiled, CompileTimes(trace, lower, compile_)


# JAX's monitoring events of the three stages (`jax._src.dispatch`), innermost first: a nested
# `jit` is traced, lowered and compiled while its caller traces, so a moment counts for the
# innermost stage running then.
_EVENTS = (
    ("compile", "/jax/core/compile/backend_compile_duration"),
    ("lower", "/jax/core/compile/jaxpr_to_mlir_module_duration"),
    ("trace", "/jax/core/compile/jaxpr_trace_duration"),
)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The disjoint intervals covering `spans`, sorted."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length_outside(spans: list[tuple[float, float]], covered: list[tuple[float, float]]) -> float:
    """The length of the union of `spans` not inside the (disjoint) intervals `covered`."""
    total = 0.0
    for start, end in _union(spans):
        total += end - start
        for c_start, c_end in covered:
            total -= max(0.0, min(end, c_end) - max(start, c_start))
    return total


def call_in_stages(function: Callable[..., Any], *args: Any) -> tuple[Any, CompileTimes, float]:
    """Calls `function(*args)` once, as it is (for a function that compiles itself, such as
    `Optimizer.step`), and splits the call's wall clock into JAX's stages from its monitoring
    events: the seconds spent tracing, lowering and compiling (every program the call compiled,
    each moment counted once, for the innermost stage) and the rest (Python outside the stages and
    the run of the compiled programs).

    **Arguments:**

    - `function`: any function.
    - `*args`: its arguments.

    **Returns:**

    `(out, times, rest)`: the outputs (ready), the `CompileTimes` and the remaining seconds.
    """
    spans: dict[str, list[tuple[float, float]]] = {stage: [] for stage, _ in _EVENTS}
    stage_of = {event: stage for stage, event in _EVENTS}

    def listener(event: str, start: float, end: float, **kwargs: Any) -> None:
        if event in stage_of:
            spans[stage_of[event]].append((start, end))

    jax.monitoring.register_event_time_span_listener(listener)
    try:
        out, total = _timed(lambda: jax.block_until_ready(function(*args)))
    finally:
        jax.monitoring.unregister_event_time_span_listener(listener)
    seconds, covered = {}, []
    for stage, _ in _EVENTS:
        seconds[stage] = _length_outside(spans[stage], covered)
        covered = _union(covered + spans[stage])
    times = CompileTimes(seconds["trace"], seconds["lower"], seconds["compile"])
    return out, times, total - sum(seconds.values())
