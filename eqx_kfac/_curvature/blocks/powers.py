"""Matrix powers as blocks take them: one power, several, or none, normalised."""

from collections.abc import Sequence


Power = float | int
PowersLike = float | int | Sequence[float | int] | None


def normalize_powers(powers: PowersLike) -> tuple[float, ...]:
    """Turns `None`, one power or several powers into a sorted tuple of distinct floats.

    **Arguments:**

    - `powers`: `None`, a real number, or a sequence of real numbers.

    **Returns:**

    A sorted tuple of distinct Python floats (empty for `None`).
    """
    if powers is None:
        return ()
    if isinstance(powers, (int, float)):
        powers = (powers,)
    return tuple(sorted({float(p) for p in powers}))
