"""`AbstractOptimizer`: what the step body and its compilation read of an optimizer.

`Optimizer` is the one implementation; the step body (`optimizer_step.py`) and the compiled entry
points (`compilation.py`) are written against this contract, so the parts they use are named and
typed in one place.
"""

import abc
from collections.abc import Sequence
from typing import Any

import equinox as eqx

from .._curvature.estimators import BlockDiagonalCurvature, ImplicitExactCurvature
from .damping import AbstractDampingRule
from .guard import StepGuard
from .preconditioner import Preconditioner
from .step_rule import AbstractStepRule
from .value_function import ValueFunction


class AbstractOptimizer(eqx.Module):
    """The parts and settings a K-FAC step is made of (the contract `Optimizer` implements).

    **Fields:**

    - `function`: the value function and its forms (aux, state, rng).
    - `l2_reg`: the L2 coefficient of the loss.
    - `preconditioner`: the curvature estimate, its refresh schedule and the direction.
    - `step_rule`, `damping_rule`, `guard`: the other parts.
    - `multi_device`, `shard_state`, `mesh`, `pmap_axis_name`, `distributed_inverses`: where the
      step runs (see the "Multi-device" page).
    - `include_norms_in_stats`, `include_per_param_norms_in_stats`: the norms in `stats`.
    - `donated`: the positions of the step's arguments whose buffers are donated.
    - `compiler_options`: the XLA compiler options of the compiled step, as sorted pairs.
    """

    function: eqx.AbstractVar[ValueFunction]
    l2_reg: eqx.AbstractVar[float]
    preconditioner: eqx.AbstractVar[Preconditioner]
    step_rule: eqx.AbstractVar[AbstractStepRule]
    damping_rule: eqx.AbstractVar[AbstractDampingRule]
    guard: eqx.AbstractVar[StepGuard]
    multi_device: eqx.AbstractVar[bool]
    shard_state: eqx.AbstractVar[bool]
    mesh: eqx.AbstractVar[Any]
    pmap_axis_name: eqx.AbstractVar[str]
    distributed_inverses: eqx.AbstractVar[bool]
    include_norms_in_stats: eqx.AbstractVar[bool]
    include_per_param_norms_in_stats: eqx.AbstractVar[bool]
    donated: eqx.AbstractVar[tuple[int, ...]]
    compiler_options: eqx.AbstractVar[tuple[tuple[str, Any], ...]]

    @property
    def axis_name(self) -> str | None:
        """The data axis inside the step, `None` on one device (and in the SPMD program of
        `shard_state`, which is written for global arrays)."""
        return self.pmap_axis_name if self.multi_device and not self.shard_state else None

    @abc.abstractmethod
    def estimators(
        self, func_args: Sequence[Any]
    ) -> tuple[BlockDiagonalCurvature, ImplicitExactCurvature]:
        """The curvature estimators for function arguments of this structure and these shapes."""
