"""The model zoo: idiomatic Equinox models that the tests and the benchmarks share.

`PROBLEMS` maps each model of the gallery (`benchmarks/zoo.py`, docs/gallery.md) to its problem's
builder, `builder(key, **options) -> benchmarks.harness.Problem`. Beside them: `tanh_mlp` (the main
job's full-batch digits problems and the tanh network of the timing benchmarks) and
`equinox_examples` (the models of Equinox's example notebooks, `benchmarks/examples.py`).
"""

from collections.abc import Callable

from ..harness import Problem
from . import cnn, frozen, mlp, mlp_norm, resnet, rnn, scan_mlp, transformer, vmc  # noqa: F401

PROBLEMS: dict[str, Callable[..., Problem]] = {
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
