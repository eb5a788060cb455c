"""The compiled entry points of `Optimizer.step`: jit, `shard_map`, the sharded state, and buffer
donation.

`Optimizer.step` calls `compiled_step`, which jits the pure `optimizer_step.step_body` once per
argument structure (Equinox's `filter_jit` cache), runs it under `shard_map` when `multi_device`
(or as one SPMD program over sharded state with `shard_state`, see `_core/distributed.py`), and
donates the argument buffers the optimizer was told to donate (kfac-jax's
`donate_parameters`, `donate_optimizer_state`, `donate_batch_inputs`, `donate_func_state`). A
donated argument's buffers are reused for the step's outputs, which saves a copy of the
parameters and of the whole optimizer state (curvature factors and cached inverses) per step, but
the caller's arrays are deleted: only donate what you replace with the step's outputs.

Each entry point is compiled with the optimizer's `compiler_options` (`jax.jit`'s). The default
(`eqx_kfac.COMPILER_OPTIONS`) turns off XLA's Triton GEMM kernels, a GPU option that XLA's other
backends ignore: on an H100 their autotuning was most of the K-FAC step's compilation (the MNIST
CNN example's K-FAC compile 24.3 s with them, 4.8 s without, through `XLA_FLAGS`;
docs/examples.md).

Before a first step with a burn-in, `compiling_step_meanwhile` compiles the step in a thread of
its own while the burn-in's update compiles and runs; a short burn-in's update compiles
`for_compile_time` (`burnin_options`). A warm start (`warm_start.py`) compiles both in threads
(`compiling_burnin_meanwhile` too) while its first-order steps run.
"""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._core import distributed as _distributed
from .._core.compiled import for_compile_time, ONE_OFF_COMPILER_OPTIONS
from .._core.flat_jit import Background, FlatJit
from .._tracing.host_constants import host_built
from .abstract_optimizer import AbstractOptimizer
from .arguments import tree_difference
from .optimizer_state import new_state, OptimizerState
from .optimizer_step import burnin_update, step_body


@functools.cache
def _jit(fn: Callable[..., Any], donate_args: frozenset[int], options: tuple[tuple[str, Any], ...]) -> FlatJit:
    """`fn` compiled over its arguments' arrays (`FlatJit`), donating those of the arguments at
    `donate_args`, with these XLA compiler options (one program cache per combination)."""
    return FlatJit(fn, donate_args, dict(options) or None)


def jit_program(fn: Callable[..., Any], options: tuple[tuple[str, Any], ...]) -> FlatJit:
    """`fn` compiled over its arguments' arrays with these XLA compiler options, donating
    nothing (one program per function and options; the warm start's step).

    **Arguments:**

    - `fn`: the function.
    - `options`: the compiler options, as sorted pairs.

    **Returns:**

    The `FlatJit`.
    """
    return _jit(fn, frozenset(), options)


# --- multi-device: the `shard_map` step, the sharded (SPMD) step and its initial state ---------


def device_mesh(optimizer: AbstractOptimizer) -> Any:
    """The optimizer's mesh: `mesh=` if given, else a 1-D mesh of all devices (the data axis)."""
    if optimizer.mesh is not None:
        return optimizer.mesh
    return _distributed.data_mesh(optimizer.pmap_axis_name)


def _is_state(x: Any) -> bool:
    return isinstance(x, OptimizerState)


def _maybe_sharded(optimizer: AbstractOptimizer, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(optimizer, *args)`, under `shard_map` with the batch (`args[3]`) split when
    `multi_device`, or as one SPMD program with the state sharded when also `shard_state`."""
    if not optimizer.multi_device:
        return fn(optimizer, *args)
    call = _distributed.sharded_call
    if optimizer.shard_state:
        call = functools.partial(_distributed.spmd_call, is_state=_is_state)
    return call(
        lambda *a: fn(optimizer, *a), device_mesh(optimizer), optimizer.pmap_axis_name, args,
        batch_index=3,
    )


def _placer(optimizer: AbstractOptimizer) -> Callable[[tuple[Any, ...]], tuple[Any, ...]] | None:
    """The placement of a program's arguments `(optimizer, params, state, rng, batch, ...)` on the
    mesh as the multi-device program returns its outputs (`placed_on_mesh`), or `None` on one
    device or with several processes. `FlatJit` places them before a call only when they do not
    lie there already: the first step (the caller's arrays) and the next (the first one's
    outputs) then run one compiled program; they compiled it twice."""
    if not optimizer.multi_device:
        return None
    mesh = device_mesh(optimizer)
    if not NamedSharding(mesh, PartitionSpec()).is_fully_addressable:
        # (Several processes: a process's arrays cannot be put on the global mesh here, and
        # `FlatJit` would put the step's outputs back where the caller's arrays were; `jit`
        # places them.)
        return None
    is_state = _is_state if optimizer.shard_state else None

    def place(args: tuple[Any, ...]) -> tuple[Any, ...]:
        placed = _distributed.placed_on_mesh(args[1:], mesh, optimizer.pmap_axis_name, 3, is_state)
        return (args[0], *placed)

    return place


def as_the_step_traces(
    optimizer: AbstractOptimizer, fn: Callable[[tuple[Any, ...]], Any], params: Any, func_state: Any,
    rng: Any, batch: Any,
) -> Any:
    """`fn(func_args)` of the function's arguments as the step traces them: under the
    multi-device step's `shard_map`, with a device's share of the batch (traced, not run), or
    plainly. What `fn` traces and caches there (the loss, the graph matcher's work, the estimator)
    the step finds cached: FermiNet's first step traced them all again under its mesh (and `init`
    traces no global batch the step never sees).

    **Arguments:**

    - `optimizer`: the `Optimizer`.
    - `fn`: a function of the value function's arguments `(params, [func_state], [rng], batch)`;
      its result may be any Python object.
    - `params`, `func_state`, `rng`, `batch`: as for `Optimizer.init`.

    **Returns:**

    `fn`'s result.
    """
    function = optimizer.function
    if not optimizer.multi_device or optimizer.shard_state:
        return fn(function.args(params, func_state, rng, function.process(batch)))
    result = []

    def body(params: Any, func_state: Any, rng: Any, batch: Any) -> tuple[()]:
        _, func_args = function.keyed_args(params, func_state, rng, function.process(batch), optimizer.axis_name)
        result.append(fn(func_args))
        return ()

    mesh, axis = device_mesh(optimizer), optimizer.pmap_axis_name
    eqx.filter_eval_shape(
        lambda *a: _distributed.sharded_call(body, mesh, axis, a, batch_index=3), params, func_state, rng, batch
    )
    return result[0]


def _build_state(
    optimizer: AbstractOptimizer, estimator: Any, filtered: Any, rng: Any, signatures: tuple[Any, Any],
    lay_out: Callable[[OptimizerState], Any] | None,
) -> Any:
    state = new_state(optimizer, estimator, filtered, rng, *signatures)
    return state if lay_out is None else lay_out(state)


# Built once per optimizer, estimator and signature, whatever the number of `init`s: its constants
# (zeros, identities, counters) made on the host, the rest compiled with
# `ONE_OFF_COMPILER_OPTIONS` (it runs once per state).
_STATE_PROGRAM = host_built(_build_state, dict(ONE_OFF_COMPILER_OPTIONS))


def initial_state(
    optimizer: AbstractOptimizer, estimator: Any, filtered: Any, rng: Any, signatures: tuple[Any, Any],
    lay_out: Callable[[OptimizerState], Any] | None = None,
) -> OptimizerState:
    """`new_state(optimizer, estimator, filtered, rng, *signatures)`, the optimizer's initial
    state. Its constants (zeros, identities, counters) are made on the host and put on the
    device (`host_built`), the rest by one compiled program (compiled with
    `ONE_OFF_COMPILER_OPTIONS`: it runs once; a later `init` of the same optimizer and shapes
    reuses it): run eagerly, every array of a new shape that it creates compiles a program of its
    own (the benchmark autoencoder's `init`: 1.8 s eagerly, 1.0 s compiled as one). With
    `shard_state` the state's arrays are laid out by `sharding_by_size` (no device holds the
    whole state, not even while it is created).

    **Arguments:**

    - `optimizer`: the `Optimizer`.
    - `estimator`: its curvature estimator.
    - `filtered`: the trained parameters.
    - `rng`: the blocks' PRNG key.
    - `signatures`: the batch's and the parameters' signatures (the state's static fields).
    - `lay_out`: a function of the state applied in the same program (the kfac-jax drop-in's
      copy per device), instead of `shard_state`'s layout.

    **Returns:**

    The state.
    """
    if lay_out is None and optimizer.multi_device and optimizer.shard_state:
        # (A `Partial`, equal for equal meshes: the program is not compiled again.)
        lay_out = jax.tree_util.Partial(_distributed.lay_out, mesh=device_mesh(optimizer), is_state=_is_state)
    return _STATE_PROGRAM(optimizer, estimator, filtered, rng, signatures, lay_out)


# --- the state's check, when a step is traced ------------------------------------------------

# The parts of the state, and the options that shape each.
_STATE_PARTS = {
    "estimator_state": "curvature blocks or their caches (PreconditionedGradient's exact_inverses, "
                       "CurvatureOptions' inverse_solver and layer_tag_to_block_ctor / "
                       "index_to_block_ctor, the refresh schedule)",
    "direction_state": "directions (direction=, e.g. EigenbasisAdam's moments)",
    "step_rule_state": "step rules (step_rule=: the momentum, an adapted learning rate or momentum)",
    "damping_state": "damping rules (damping_rule=; kfac_jax: use_adaptive_damping)",
    "guard_state": "step guards (guard=)",
}


def _structure_and_shapes(tree: Any) -> tuple[Any, list[tuple[int, ...]]]:
    return jax.tree.structure(tree), [np.shape(x) for x in jax.tree.leaves(tree)]


def check_state(
    optimizer: AbstractOptimizer, params: Any, state: OptimizerState, rng: Any, batch: Any, func_state: Any
) -> None:
    """Raises `ValueError` unless `state` has the structure and shapes of the state `optimizer.init`
    makes for these arguments (a state made by an optimizer of another configuration). Run
    where the step or the burn-in is traced: a state of another structure is traced anew.

    **Arguments:**

    - `optimizer`: the `Optimizer`.
    - `params`, `state`, `rng`, `batch`, `func_state`: the step's arguments (as the step's body
      sees them).
    """
    func_args = optimizer.function.args(params, func_state, rng, optimizer.function.process(batch))
    estimator, _ = optimizer.estimators(func_args)
    filtered = eqx.filter(params, eqx.is_inexact_array)
    expected = eqx.filter_eval_shape(
        new_state, optimizer, estimator, filtered, rng, state.batch_signature, state.params_signature
    )
    if _structure_and_shapes(state) == _structure_and_shapes(expected):
        return
    difference = tree_difference(state, expected, dtypes=False)
    if difference is not None:
        path, here, there = difference
        part = _STATE_PARTS.get(path.split(".")[0], "states")
        raise ValueError(
            "The state passed to step was made by an optimizer of another configuration (the two "
            f"optimizers' {part} differ): `{path}` is {here} in it, {there} in this optimizer's state. Call "
            "this optimizer's `init` for its state, or step with the optimizer that made it (load "
            "a saved state with `optimizer.load_state`)."
        )


def _checked_step_body(optimizer, params, state, rng, batch, func_state, *rest):
    check_state(optimizer, params, state, rng, batch, func_state)
    return step_body(optimizer, params, state, rng, batch, func_state, *rest)


def _checked_burnin_update(optimizer, params, state, rng, batch, func_state, index):
    check_state(optimizer, params, state, rng, batch, func_state)
    return burnin_update(optimizer, params, state, rng, batch, func_state, index)


# --- the compiled step ----------------------------------------------------------------------


def _jitted_step(optimizer, params, state, rng, batch, func_state, given, burnin_in_graph, calibrating):
    return _maybe_sharded(
        optimizer, _checked_step_body, params, state, rng, batch, func_state, given, burnin_in_graph, calibrating
    )


def _step_program(optimizer: AbstractOptimizer, calibrating: bool) -> FlatJit:
    """The compiled step, donating the arguments the optimizer donates (a calibration trial never
    donates; position 0 is the optimizer)."""
    donated = frozenset() if calibrating else frozenset(1 + i for i in optimizer.donated)
    return _jit(_jitted_step, donated, optimizer.compiler_options)


def compiled_step(
    optimizer: AbstractOptimizer,
    args: tuple[Any, ...],
    burnin_in_graph: bool,
    calibrating: bool = False,
) -> Any:
    """Runs `step_body(optimizer, *args, burnin_in_graph, calibrating)` compiled, donating as
    configured (a calibration trial never donates).

    **Arguments:**

    - `optimizer`: the `Optimizer`.
    - `args`: `(params, state, rng, batch, func_state, given)`.
    - `burnin_in_graph`: whether the burn-in runs inside the step (`batch=` inside a user's trace).
    - `calibrating`: the step is a trial of the initial damping's calibration.

    **Returns:**

    The step's outputs.
    """
    program = _step_program(optimizer, calibrating)
    return program(optimizer, *args, burnin_in_graph, calibrating, place=_placer(optimizer))


def compiling_step_meanwhile(optimizer: AbstractOptimizer, args: tuple[Any, ...]) -> Background:
    """Starts compiling the step of `compiled_step(optimizer, args, False)` in a thread of its
    own (`FlatJit.compile_in_background`), for a caller with other work to do first (the
    burn-in, the warm start). The step called later with arguments of the same structure, shapes
    and dtypes (their values may differ) waits for it instead of compiling again. XLA compiles
    without Python's lock, so two compilations overlap: the ViT of `benchmarks/examples.py`
    compiled its burn-in update in 11.2 s and its step in 14.8 s, and its first step took 28.7 s
    instead of 32.3 s on 2 CPU cores.

    **Arguments:**

    - `optimizer`: the `Optimizer`.
    - `args`: `(params, state, rng, batch, func_state, given)`, with the step's structure.

    **Returns:**

    The compilation's handle. An error in it is left to the step itself, which traces the same
    program and raises it.
    """
    program = _step_program(optimizer, False)
    return program.compile_in_background(optimizer, *args, False, False, place=_placer(optimizer))


def _jitted_burnin(optimizer, params, state, rng, batch, func_state, index):
    return _maybe_sharded(optimizer, _checked_burnin_update, params, state, rng, batch, func_state, index)


# A burn-in of at most this many updates compiles its update `for_compile_time`. Its kernels then
# run slower (LLVM does not optimise them), but it runs so few times that its compilation is most
# of its cost. On 2 CPU cores (`benchmarks/examples.py`'s models) the update compiled 1.7 s faster
# on the ViT and 0.8 s on the MNIST CNN, and each run took 134 ms and 23 ms longer: 13 and 35
# runs to break even. The first step with the default 10 took 26.0-26.2 s instead of
# 27.3-28.6 s on the ViT, 6.0-6.3 s instead of 7.2-7.3 s on the MNIST CNN.
_SHORT_BURNIN = 10


def burnin_options(optimizer: AbstractOptimizer) -> tuple[tuple[str, Any], ...]:
    """The compiler options of the burn-in's update: the step's, `for_compile_time` when the
    burn-in has at most `_SHORT_BURNIN` updates."""
    if optimizer.refresh.num_burnin_steps <= _SHORT_BURNIN:
        return for_compile_time(optimizer.compiler_options)
    return optimizer.compiler_options


def jitted_burnin(
    optimizer: AbstractOptimizer, params: Any, state: OptimizerState, rng: Any, batch: Any,
    func_state: Any, index: int,
) -> OptimizerState:
    """The burn-in's curvature update number `index` (`optimizer_step.burnin_update`), compiled
    once for every index with `burnin_options`, never donating."""
    index = np.asarray(index, np.int32)
    return _burnin_program(optimizer)(optimizer, params, state, rng, batch, func_state, index, place=_placer(optimizer))


def _burnin_program(optimizer: AbstractOptimizer) -> FlatJit:
    return _jit(_jitted_burnin, frozenset(), burnin_options(optimizer))


def compiling_burnin_meanwhile(
    optimizer: AbstractOptimizer, params: Any, state: OptimizerState, rng: Any, batch: Any, func_state: Any
) -> Background:
    """Starts compiling the burn-in's update of `jitted_burnin` in a thread of its own (as
    `compiling_step_meanwhile` does the step's).

    **Arguments:**

    - `optimizer`, `params`, `state`, `rng`, `batch`, `func_state`: as for `jitted_burnin`.

    **Returns:**

    The compilation's handle.
    """
    index = np.asarray(0, np.int32)
    return _burnin_program(optimizer).compile_in_background(
        optimizer, params, state, rng, batch, func_state, index, place=_placer(optimizer)
    )
