"""Where and how `Optimizer`'s step runs: `MultiDevice` (the devices) and `StepOptions` (buffer
donation, XLA options, extra statistics). Neither changes what a step computes."""

from collections.abc import Mapping
from typing import Any

import equinox as eqx

from .._core import distributed as _distributed
from .._core.compiled import COMPILER_OPTIONS


class MultiDevice(eqx.Module):
    """Run the step on several devices (final): the batch is the *global* batch, split along its
    first axis over the data axis of a mesh; the results equal one device's on the same batch
    (see the "Multi-device" page).

    **Fields:**

    - `mesh`: a `jax.sharding.Mesh` with an axis called `axis_name`, or `None` for a 1-D mesh of
      all devices.
    - `axis_name`: the data axis (kfac-jax's `pmap_axis_name`).
    - `distributed_inverses`: each block's factorisation runs on one device and is shared.
    - `shard_state`: the state sharded over the mesh and the step one SPMD program (no device
      holds the whole state), instead of the state replicated and the step under `shard_map`.
    """

    mesh: Any = eqx.field(static=True, default=None)
    axis_name: str = eqx.field(static=True, default="kfac_axis")
    distributed_inverses: bool = eqx.field(static=True, default=True)
    shard_state: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        if self.mesh is not None:
            _distributed.check_mesh(self.mesh, self.axis_name)


class StepOptions(eqx.Module):
    """How the directly called step is compiled, and what else it reports (final).

    **Fields:**

    - `donated`: the positions of `step`'s arguments `(params, state, rng, batch, func_state)`
      whose buffers the step reuses for its outputs (saves a copy of the parameters and of the
      state per step, but deletes the caller's arrays: donate only what you replace with the
      step's outputs). Build it with the keywords below.
    - `compiler_options`: the XLA options of the step `step` compiles (`jax.jit`'s; ignored
      inside your own `jit`), as sorted pairs. The default, `eqx_kfac.COMPILER_OPTIONS`, turns
      off XLA's Triton GEMM kernels on GPUs, whose autotuning was most of the step's GPU
      compilation.
    - `include_norms_in_stats`: the norms of the parameters, gradient, direction and update in
      `stats`; `include_per_param_norms_in_stats`: the same per parameter leaf.
    """

    donated: tuple[int, ...] = eqx.field(static=True)
    compiler_options: tuple[tuple[str, Any], ...] = eqx.field(static=True)
    include_norms_in_stats: bool = eqx.field(static=True)
    include_per_param_norms_in_stats: bool = eqx.field(static=True)

    def __init__(
        self,
        *,
        donate_parameters: bool = False,
        donate_optimizer_state: bool = False,
        donate_batch_inputs: bool = False,
        donate_func_state: bool = False,
        compiler_options: Mapping[str, Any] | None = COMPILER_OPTIONS,
        include_norms_in_stats: bool = False,
        include_per_param_norms_in_stats: bool = False,
    ):
        """**Arguments:** the `donate_*` flags (kfac-jax's names) for the parameters, the
        optimizer state, the batch and the function state; `compiler_options` as a mapping
        (`None`: XLA's defaults); the two norm flags."""
        flags = (donate_parameters, donate_optimizer_state, False, donate_batch_inputs, donate_func_state)
        self.donated = tuple(i for i, flag in enumerate(flags) if flag)
        self.compiler_options = tuple(sorted((compiler_options or {}).items()))
        self.include_norms_in_stats = include_norms_in_stats
        self.include_per_param_norms_in_stats = include_per_param_norms_in_stats
