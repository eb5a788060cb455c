"""One problem's results across methods and seeds (`Outcome`), measured against its best baseline.

The target of a problem and seed is the lowest final loss of the methods other than K-FAC's two
forms (the best baseline); a method reaches it at the first step whose mean loss over the last
`WINDOW` steps is at or below it.
"""

import dataclasses

import numpy as np

from .methods import KFAC_METHODS
from .record import WINDOW, Reach, Run


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One problem's results.

    **Fields:**

    - `problem`: its name.
    - `steps`: the step budget.
    - `grids`: `method -> runs` of the learning-rate search (seed 0; one run when nothing was
      searched).
    - `seeds`: `method -> runs`, one per seed, at the chosen rate (seed 0's is the grid's best).
    - `exact`: the exact optimum when known (the VMC ground-state energy).
    """

    problem: str
    steps: int
    grids: dict[str, list[Run]]
    seeds: dict[str, list[Run]]
    exact: float | None = None

    def target(self, seed: int) -> float:
        """The lowest final loss of the baselines (methods other than K-FAC's) on a seed."""
        return min(
            r.final_loss(WINDOW) for m, runs in self.seeds.items() if m not in KFAC_METHODS
            for r in runs if r.seed == seed and np.isfinite(r.final_loss(WINDOW))
        )

    def reaches(self, method: str) -> list[Reach | None]:
        """When each seed's run of `method` reaches that seed's target."""
        return [r.reach(self.target(r.seed)) for r in self.seeds[method]]

    def median_wall(self, method: str) -> float:
        """The median over seeds of the seconds to the target from the first call (inf: never)."""
        return float(np.median([np.inf if r is None else r.wall for r in self.reaches(method)]))

    def median_compiled(self, method: str) -> float:
        """The median over seeds of the compiled seconds to the target (inf: never)."""
        return float(np.median([np.inf if r is None else r.compiled for r in self.reaches(method)]))
