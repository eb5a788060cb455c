"""`AbstractOptimizer`: what the step body and its compilation read of an optimizer.

`Optimizer` (the parts-based core) and `eqx_kfac.kfac_jax.Optimizer` (kfac-jax's keywords) are
its two final implementations, through `optimizer.AbstractKFACOptimizer`; the step body
(`optimizer_step.py`) and the compiled entry points (`compilation.py`) are written against this
contract, so the parts they use are named and typed in one place.
"""

import abc
from collections.abc import Sequence
from typing import Any

import equinox as eqx

from .._curvature.estimators import BlockDiagonalCurvature, ImplicitExactCurvature
from .damping import AbstractDampingRule
from .direction import AbstractDirection
from .execution import MultiDevice, StepOptions
from .guard import StepGuard
from .preconditioner import Preconditioner
from .refresh import AbstractRefreshSchedule
from .step_rule import AbstractStepRule
from .value_function import ValueFunction
from .warm_start import WarmStart


class AbstractOptimizer(eqx.Module):
    """The parts and settings a K-FAC step is made of.

    **Fields:**

    - `function`: the value function and its forms (aux, state, rng).
    - `l2_reg`: the L2 coefficient of the loss.
    - `preconditioner`: the curvature estimate, its refresh schedule and the direction.
    - `step_rule`, `damping_rule`, `guard`: the other parts.
    - `devices`: a `MultiDevice`, or `None` for one device.
    - `options`: the `StepOptions` (donation, compiler options, norms in `stats`).
    - `warm_start`: a `WarmStart` (first-order steps while the K-FAC programs compile), or `None`.
    """

    function: eqx.AbstractVar[ValueFunction]
    l2_reg: eqx.AbstractVar[float]
    preconditioner: eqx.AbstractVar[Preconditioner]
    step_rule: eqx.AbstractVar[AbstractStepRule]
    damping_rule: eqx.AbstractVar[AbstractDampingRule]
    guard: eqx.AbstractVar[StepGuard]
    devices: eqx.AbstractVar[MultiDevice | None]
    options: eqx.AbstractVar[StepOptions]
    warm_start: eqx.AbstractVar[WarmStart | None]

    @property
    def refresh(self) -> AbstractRefreshSchedule:
        """The preconditioner's refresh schedule."""
        return self.preconditioner.refresh

    @property
    def direction(self) -> AbstractDirection:
        """The preconditioner's direction."""
        return self.preconditioner.direction

    @property
    def multi_device(self) -> bool:
        """Whether the step runs on several devices."""
        return self.devices is not None

    @property
    def shard_state(self) -> bool:
        """Whether the state is sharded over the devices (`MultiDevice.shard_state`)."""
        return self.devices is not None and self.devices.shard_state

    @property
    def mesh(self) -> Any:
        """The user's mesh, `None` for all devices (or one device)."""
        return None if self.devices is None else self.devices.mesh

    @property
    def pmap_axis_name(self) -> str:
        """The data axis's name."""
        return "kfac_axis" if self.devices is None else self.devices.axis_name

    @property
    def distributed_inverses(self) -> bool:
        """Whether each block's factorisation runs on one device (under `multi_device`)."""
        return self.devices is not None and self.devices.distributed_inverses

    @property
    def axis_name(self) -> str | None:
        """The data axis inside the step, `None` on one device (and in the SPMD program of
        `shard_state`, which is written for global arrays)."""
        return self.pmap_axis_name if self.multi_device and not self.shard_state else None

    @property
    def donated(self) -> tuple[int, ...]:
        """The positions of the step's arguments whose buffers are donated."""
        return self.options.donated

    @property
    def compiler_options(self) -> tuple[tuple[str, Any], ...]:
        """The XLA compiler options of the compiled step, as sorted pairs."""
        return self.options.compiler_options

    @property
    def include_norms_in_stats(self) -> bool:
        """Whether `stats` holds the vectors' norms."""
        return self.options.include_norms_in_stats

    @property
    def include_per_param_norms_in_stats(self) -> bool:
        """Whether `stats` holds the norms per parameter leaf."""
        return self.options.include_per_param_norms_in_stats

    @abc.abstractmethod
    def estimators(
        self, func_args: Sequence[Any]
    ) -> tuple[BlockDiagonalCurvature, ImplicitExactCurvature]:
        """The curvature estimators for function arguments of this structure and these shapes."""
