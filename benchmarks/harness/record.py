"""The record of one training run (`Run`), and when it reaches a target loss (`Reach`).

`losses[t]` is the training loss of step `t`'s batch at the parameters before step `t` (for a
full batch: the objective after `t` steps). The first call (`FirstCall`: building the optimizer and
its state, tracing, lowering, compiling and running step 0) is timed by stage; `times` are the
compiled steps after it, `batch_times` the sampling of their batches. Seconds *from the first call*
count all of it, as a user waits; *compiled* seconds count the steps only, step 0 at the median
step time.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .methods import label
from .staging import FirstCall

# The final loss of a run is its mean training loss over the last `WINDOW` steps.
WINDOW = 10


@dataclasses.dataclass(frozen=True)
class Reach:
    """When a run first reaches a target loss.

    **Fields:**

    - `steps`: the number of steps whose parameters reach it.
    - `wall`: seconds from the first call: building the optimizer, the first step (compilation
      included), the steps and batches after it.
    - `compiled`: the same without building and compiling (the first step at the median).
    """

    steps: int
    wall: float
    compiled: float


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run.

    **Fields:**

    - `problem`, `method`: names (e.g. `"cnn"`, `"adam"`).
    - `learning_rate`: the learning rate (`None` for the adaptive `"kfac"`).
    - `seed`: the seed of the batch stream's keys (Monte Carlo moves, dropout, K-FAC's sampling).
    - `losses`: `(steps,)`, the training loss of each step's batch before the step (fewer when the
      run stopped early).
    - `times`: `(steps - 1,)`, seconds of each compiled step after the first.
    - `batch_times`: `(steps - 1,)`, seconds of `next_batch` before each step after the first.
    - `first_call`: the first call's seconds by stage.
    - `stats`: for `"kfac"`, the step statistics of every step (`learning_rate`, `momentum`,
      `damping`, `skipped`, `rejected`); empty for the other methods.
    - `model`, `state`: the model and the method's state after the last step, when the loop was
      asked to keep them (else `None`).
    """

    problem: str
    method: str
    learning_rate: float | None
    seed: int
    losses: np.ndarray
    times: np.ndarray
    batch_times: np.ndarray
    first_call: FirstCall
    stats: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    model: Any = None
    state: Any = None

    @property
    def label(self) -> str:
        """The method and its learning rate, e.g. `adam lr=0.001`."""
        return label(self.method, self.learning_rate)

    @property
    def ms_per_step(self) -> float:
        """The median milliseconds of a compiled step."""
        return float(np.median(self.times) * 1e3) if len(self.times) else float("nan")

    def smoothed(self, window: int = WINDOW) -> np.ndarray:
        """The mean loss of the last `window` steps (fewer at the start), at every step."""
        sums = np.cumsum(self.losses)
        lagged = np.concatenate([np.zeros(window), sums])[: len(sums)]
        return (sums - lagged) / np.minimum(np.arange(1, len(sums) + 1), window)

    def final_loss(self, window: int = WINDOW) -> float:
        """The mean training loss of the last `window` steps (NaN if the run diverged)."""
        if len(self.losses) == 0 or not np.all(np.isfinite(self.losses[-window:])):
            return float("nan")
        return float(np.mean(self.losses[-window:]))

    def elapsed(self) -> np.ndarray:
        """`(len(losses),)`: seconds from the first call until the parameters of each loss exist."""
        work = np.cumsum(self.times + self.batch_times[: len(self.times)])
        return np.concatenate([[0.0], self.first_call.total + np.concatenate([[0.0], work])])[
            : len(self.losses)
        ]

    def compiled_elapsed(self) -> np.ndarray:
        """`(len(losses),)`: the same counting compiled steps (and batches) only, the first step at
        the median step time."""
        elapsed = self.elapsed() - self.first_call.total + self.ms_per_step / 1e3
        return np.concatenate([[0.0], elapsed[1:]])

    @property
    def wall(self) -> float:
        """Seconds of the whole run from the first call (batches included)."""
        return self.first_call.total + float(np.sum(self.times) + np.sum(self.batch_times))

    @property
    def compiled(self) -> float:
        """Seconds of the whole run's compiled steps (and batches), the first at the median."""
        return self.wall - self.first_call.total + self.ms_per_step / 1e3

    def reach(self, target: float, window: int = WINDOW) -> Reach | None:
        """When the mean loss of the last `window` steps first is at most `target` (`None`: never)."""
        reached = np.flatnonzero(self.smoothed(window) <= target)
        if not reached.size:
            return None
        steps = int(reached[0])
        return Reach(steps, float(self.elapsed()[steps]), float(self.compiled_elapsed()[steps]))


def best(runs: Sequence[Run], window: int = WINDOW) -> Run:
    """The run with the lowest final loss (a diverged run never wins)."""
    return min(runs, key=lambda r: (not np.isfinite(r.final_loss(window)), r.final_loss(window)))
