"""Learning-rate tuning by one rule for every method: a ladder of rates and a bracketing rule.

The ladder is ..., 1e-4, 3e-4, 1e-3, 3e-3, ...; a method starts from its reference rate and the
two neighbours, and while its best score is at an end of the rates tried (a diverged run scoring
worst), the next rate beyond that end is added, up to a most number of rates. `tune` runs the
rounds; `add_arguments` and `settle_arguments` give the benchmarks' `--seeds` and `--max-grid`.
"""

import argparse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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


def tune(
    first: Mapping[str, Sequence[float | None]],
    run: Callable[[list[tuple[str, float | None]]], Sequence[Any]],
    extend: Callable[[str, list[Any]], float | None],
) -> dict[str, list[Any]]:
    """Tunes the rates of several methods in rounds: each method's first rates together, then,
    while `extend` names a next rate for some methods, those together.

    **Arguments:**

    - `first`: each method's first rates (e.g. `initial_grid`'s).
    - `run`: `run([(method, rate), ...])` trains one run per pair (in one round) and returns
      their results in order.
    - `extend`: `extend(method, results)` is the method's next rate after its results so far
      (e.g. `extension` of their scores), or `None`.

    **Returns:**

    `method -> results`, in the order they were run.
    """
    grids = {name: [] for name in first}
    pending = [(name, rate) for name, rates in first.items() for rate in rates]
    while pending:
        for (name, _), result in zip(pending, run(pending), strict=True):
            grids[name].append(result)
        pending = [(name, rate) for name in grids if (rate := extend(name, grids[name])) is not None]
    return grids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `--seeds` and `--max-grid` (see `settle_arguments` for their defaults)."""
    parser.add_argument("--seeds", type=int, help="number of seeds (default 3, 1 with --quick)")
    parser.add_argument("--max-grid", type=int, help="most learning rates per method (default 5, 1 with --quick)")


def settle_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Sets `args.seeds` and `args.max_grid` when not given (3 and 5; 1 and 1 with `--quick`),
    and refuses fewer than one seed and a `--max-grid` that is not 1 (the reference rate) or at
    least 3."""
    if args.seeds is None:
        args.seeds = 1 if args.quick else 3
    if args.max_grid is None:
        args.max_grid = 1 if args.quick else 5
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    if args.max_grid == 2 or args.max_grid < 1:
        parser.error("--max-grid is 1 (the reference rate) or at least 3 (it and its neighbours)")
