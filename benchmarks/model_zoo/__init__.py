"""The model zoo: idiomatic Equinox models that the tests and `benchmarks/zoo.py` share.

`make_zoo(key)` builds every problem; `PROBLEMS` maps each name to its builder. See `_problem` for
what a problem provides.
"""

from collections.abc import Callable

import jax
from jaxtyping import PRNGKeyArray

from . import cnn, frozen, mlp, mlp_norm, resnet, rnn, scan_mlp, transformer, vmc
from ._problem import ZooProblem as ZooProblem, digits as digits

PROBLEMS: dict[str, Callable[..., ZooProblem]] = {
    "cnn": cnn.problem,
    "resnet": resnet.problem,
    "mlp_norm_dropout": mlp_norm.problem,
    "transformer": transformer.problem,
    "gru": lambda key, **kw: rnn.problem(key, "gru", **kw),
    "lstm": lambda key, **kw: rnn.problem(key, "lstm", **kw),
    "scan_mlp": scan_mlp.problem,
    "frozen_part": frozen.problem,
    "vmc_rule": lambda key, **kw: vmc.problem(key, "rule", **kw),
    "vmc_loss": lambda key, **kw: vmc.problem(key, "loss", **kw),
}


def make_zoo(key: PRNGKeyArray, names: tuple[str, ...] | None = None) -> dict[str, ZooProblem]:
    """Builds the named zoo problems (all by default), each from its own key.

    **Arguments:**

    - `key`: a PRNG key.
    - `names`: which problems (keys of `PROBLEMS`); all by default.

    **Returns:**

    A dict from name to `ZooProblem`.
    """
    names = tuple(PROBLEMS) if names is None else names
    # Each problem's key depends on its name only, not on which others are built.
    order = sorted(PROBLEMS)
    return {name: PROBLEMS[name](jax.random.fold_in(key, order.index(name))) for name in names}
