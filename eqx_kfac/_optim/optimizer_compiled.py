"""The compiled entry points of `Optimizer.step` (jit, `shard_map`, buffer donation).

`Optimizer.step` calls `compiled_step`, which jits the pure `step.step_body` once per argument
structure (Equinox's `filter_jit` cache), runs it under `shard_map` when `multi_device`, and
donates the argument buffers the optimizer was told to donate (kfac-jax's `donate_parameters`,
`donate_optimizer_state`, `donate_batch_inputs`, `donate_func_state`). A donated argument's
buffers are reused for the step's outputs, which saves a copy of the parameters and of the
whole optimizer state (curvature factors and cached inverses) per step, but the caller's arrays
are deleted: only donate what you replace with the step's outputs.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx

from .._core import distributed as _distributed
from .step import burnin_update, step_body


# Compilation


# The positions of (params, state, rng, batch, func_state, hyper) in a step's arguments that
# each donation flag covers.
_DONATION_FLAGS = (
    ("donate_parameters", 0),
    ("donate_optimizer_state", 1),
    ("donate_batch_inputs", 3),
    ("donate_func_state", 4),
)


def _maybe_sharded(optimizer: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, under `shard_map` with the batch (`args[3]`) split when `multi_device`."""
    if not optimizer.multi_device:
        return fn(*args)
    mesh = optimizer.mesh
    if mesh is None:
        mesh = _distributed.data_mesh(optimizer.pmap_axis_name)
    return _distributed.sharded_call(fn, mesh, optimizer.pmap_axis_name, args, batch_index=3)


def _run_step(optimizer: Any, args: tuple[Any, ...], burnin_in_graph: bool) -> Any:
    return _maybe_sharded(optimizer, lambda *a: step_body(optimizer, *a, burnin_in_graph), *args)


@eqx.filter_jit
def _jitted_step(optimizer, args, burnin_in_graph):
    return _run_step(optimizer, args, burnin_in_graph)


@eqx.filter_jit(donate="all-except-first")
def _jitted_donating_step(kept, donated, optimizer, burnin_in_graph):
    # `filter_jit` donates every array argument but the first: the kept arguments travel there.
    args = tuple(d if k is None else k for k, d in zip(kept, donated))
    return _run_step(optimizer, args, burnin_in_graph)


def compiled_step(optimizer: Any, args: tuple[Any, ...], burnin_in_graph: bool) -> Any:
    """Runs `step_body(optimizer, *args, burnin_in_graph)` compiled, donating as configured.

    **Arguments:**

    - `optimizer`: the `Optimizer`.
    - `args`: `(params, state, rng, batch, func_state, hyper)`.
    - `burnin_in_graph`: whether the burn-in runs inside the step (no `data_iterator`).

    **Returns:**

    The step's outputs.
    """
    donate = {i for flag, i in _DONATION_FLAGS if getattr(optimizer, flag)}
    if not donate:
        return _jitted_step(optimizer, args, burnin_in_graph)
    kept = tuple(None if i in donate else a for i, a in enumerate(args))
    donated = tuple(a if i in donate else None for i, a in enumerate(args))
    return _jitted_donating_step(kept, donated, optimizer, burnin_in_graph)


@eqx.filter_jit
def jitted_burnin(optimizer, params, state, key, batch, func_state):
    """One compiled burn-in curvature update (`step.burnin_update`), never donating."""
    return _maybe_sharded(
        optimizer, lambda *a: burnin_update(optimizer, *a), params, state, key, batch, func_state
    )
