"""Learning-rate tuning by one rule for every method: a ladder of rates and a bracketing rule.

The ladder is ..., 1e-4, 3e-4, 1e-3, 3e-3, ...; a method starts from its reference rate and the
two neighbours, and while its best score is at an end of the rates tried (a diverged run scoring
worst), the next rate beyond that end is added, up to a most number of rates.
"""

from collections.abc import Mapping

import numpy as np


def neighbour(learning_rate: float, up: bool) -> float:
    """The next rate on the ladder above or below `learning_rate` (e.g. 3e-3 -> 1e-2 going up)."""
    mantissa = learning_rate / 10 ** np.floor(np.log10(learning_rate) + 1e-9)
    factor = (3.0 if mantissa < 2 else 10 / 3) if up else (1 / 3 if mantissa > 2 else 0.3)
    return float(f"{learning_rate * factor:.0e}")


def initial_grid(reference: float | None, max_grid: int) -> list[float | None]:
    """The first rates of a method: its reference rate and, if `max_grid >= 3`, its two
    neighbours (`[None]` for a method without a rate, `reference=None`)."""
    if reference is None:
        return [None]
    if max_grid == 1:
        return [reference]
    return [neighbour(reference, up=False), reference, neighbour(reference, up=True)]


def extension(scores: Mapping[float, float], max_grid: int) -> float | None:
    """The next rate to try, or `None` when the best rate is inside the grid.

    **Arguments:**

    - `scores`: each rate tried and its score, lower is better (NaN or infinite: diverged).
    - `max_grid`: the most rates to try.

    **Returns:**

    The rate beyond the end of the grid where the best score is (below the lowest rate if every
    run diverged), or `None` if the best is inside the grid, there is no rate or the grid is full.
    """
    rates = sorted(scores)
    if not rates or len(rates) >= max_grid:
        return None
    winner = min(rates, key=lambda rate: (not np.isfinite(scores[rate]), scores[rate]))
    if not np.isfinite(scores[winner]) or winner == rates[0]:
        return neighbour(rates[0], up=False)
    if winner == rates[-1]:
        return neighbour(rates[-1], up=True)
    return None
