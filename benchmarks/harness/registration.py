"""What K-FAC makes of a problem's model: its curvature blocks, and the parameters left generic."""

import collections

import numpy as np

import eqx_kfac

from .problem import Problem


def registration_summary(problem: Problem) -> tuple[str, int]:
    """The blocks K-FAC gives a problem's parameters.

    **Arguments:**

    - `problem`: the problem (traced at its initial model and first batch).

    **Returns:**

    `("3 DenseTwoKroneckerFactored, 2 ScaleAndShiftDiagonal", n)`: how many blocks of each kind,
    and the number of parameters that fell back to a generic (diagonal) block.
    """
    estimator = eqx_kfac.BlockDiagonalCurvature(problem.loss, problem.first_args(), on_unmatched="ignore")
    kinds = collections.Counter(type(b).__name__ for b in estimator.blocks)
    generic = sum(
        int(np.prod(s)) for b in estimator.blocks if b.spec.tag == "generic" for s in b.param_shapes
    )
    return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())), generic
