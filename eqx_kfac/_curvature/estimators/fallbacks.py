"""Reporting parameters that fall back to a generic (per-parameter, diagonal) block.

A parameter gets a generic tag when no layer accounts for it: no graph pattern matched its use
(origin `"unmatched"`), it is used in more than one place that the losses depend on
(`"shared"`: tied weights, a scan carry), or automatic registration is off and nothing registered
it (`"unregistered"`). Its curvature is then approximated per parameter, which is a silent loss of
structure; estimators report it as `on_unmatched` says. A generic tag registered by hand
(`register_generic`, origin `"manual"`) is a choice, not a fallback.
"""

import os
import sys
import types
import warnings
from collections.abc import Sequence

import beartype
import equinox
import jax
import jaxtyping

from ..._tracing.layer_data import LayerSpec

ON_UNMATCHED = ("warn", "error", "ignore")

_WHY = {
    "unmatched": "no layer pattern matched the computation it is used in",
    "shared": (
        "it is used in more than one place that the losses depend on (tied weights, or a value "
        "carried from step to step of a scan), which one layer cannot account for"
    ),
    "unregistered": "automatic registration is off and no `register_*` call covers it",
}

# Frames inside these packages (and the run-time type checkers wrapping calls) are not the user's.
_INTERNAL = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (sys.modules[__package__.split(".")[0]], jax, equinox, jaxtyping, beartype)
)


def user_stacklevel(warning_frame: types.FrameType) -> int:
    """The `stacklevel` for a `warnings.warn` called in `warning_frame` that points at the first
    frame outside eqx_kfac, JAX, Equinox and the type checkers (the user's call).

    **Arguments:**

    - `warning_frame`: the frame calling `warnings.warn` (`sys._getframe()` there).

    **Returns:**

    The stack level.
    """
    frame, level = warning_frame, 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def check_on_unmatched(on_unmatched: str, where: str) -> str:
    """Raises `ValueError` unless `on_unmatched` is `"warn"`, `"error"` or `"ignore"`.

    **Arguments:**

    - `on_unmatched`: the value to check.
    - `where`: the function or class taking it, for the message.

    **Returns:**

    `on_unmatched`.
    """
    if on_unmatched not in ON_UNMATCHED:
        raise ValueError(f"{where}: on_unmatched must be one of {ON_UNMATCHED}, got {on_unmatched!r}.")
    return on_unmatched


def report_fallbacks(specs: Sequence[LayerSpec], on_unmatched: str) -> None:
    """Warns about (or raises for) parameters that fall back to a generic block.

    **Arguments:**

    - `specs`: the traced function's layer specs.
    - `on_unmatched`: `"warn"` (a `UserWarning` naming the parameter paths, pointing at the
      user's call), `"error"` (a `ValueError`) or `"ignore"`.
    """
    fallbacks = [s for s in specs if s.tag == "generic" and s.origin in _WHY]
    if not fallbacks or on_unmatched == "ignore":
        return
    lines = "\n".join(f"  - `{', '.join(s.param_paths)}` ({s.origin}): {_WHY[s.origin]}" for s in fallbacks)
    message = (
        f"eqx_kfac: {len(fallbacks)} parameter(s) fall back to a generic per-parameter (diagonal) "
        f"curvature block instead of a structured one:\n{lines}\n"
        "Register their layers by hand (`eqx_kfac.register_dense`, `register_conv2d`, ...) or add a "
        "`GraphPattern` for them; `register_generic` marks a fallback as intended. Pass "
        "`on_unmatched='ignore'` to accept the fallback silently, or `'error'` to make it an error."
    )
    if on_unmatched == "error":
        raise ValueError(message)
    warnings.warn(message, UserWarning, stacklevel=user_stacklevel(sys._getframe()))
