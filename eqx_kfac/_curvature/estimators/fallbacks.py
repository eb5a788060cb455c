"""Reporting parameters that fall back to a generic (per-parameter, diagonal) block.

A parameter gets a generic tag when no layer accounts for it: the registered losses do not depend
on it (origin `"unused"`), no graph pattern matched its one use (`"unmatched"`), it is used in
more than one place that the losses depend on (`"shared"`: tied weights, a weight normalised by a
function of itself, a scan carry), or automatic registration is off and nothing registered it
(`"unregistered"`). Its curvature is then approximated per parameter, which is a silent loss of
structure; estimators report it as `on_unmatched` says, with the primitives that use it. A generic
tag registered by hand (`register_generic`, origin `"manual"`) is a choice, not a fallback.
"""

import collections

import os
import sys
import types
import warnings
from collections.abc import Sequence

import beartype
import equinox
import jax
import jaxtyping

from ..._tracing.graph_matcher import SCAN_CARRY
from ..._tracing.layer_data import LayerSpec

ON_UNMATCHED = ("warn", "error", "ignore")

_FALLBACKS = ("unused", "unmatched", "shared", "unregistered")


def _listed(uses: Sequence[str]) -> str:
    """`"`dot_general` x2, `div`"`: the uses, primitives in code font, repeats counted."""
    counts = collections.Counter(uses)
    return ", ".join(
        (u if " " in u else f"`{u}`") + (f" x{n}" if n > 1 else "") for u, n in counts.items()
    )


def _why(spec: LayerSpec) -> str:
    """What happened to the parameter of a fallback spec, in words."""
    uses = tuple(spec.get("uses", ()))
    if spec.origin == "unused":
        return (
            "the registered losses do not depend on it (it is unused, or used only in what they "
            "do not depend on, e.g. a regulariser added to the loss value or a returned metric), "
            "so its curvature is zero"
        )
    if spec.origin == "unmatched":
        return f"it is used once, by {_listed(uses)}, and no layer pattern matched the computation there"
    if spec.origin == "shared" and SCAN_CARRY in uses:
        return (
            f"it is carried from step to step of a `jax.lax.scan` (uses: {_listed(uses)}), so no "
            "layer sees all of its uses"
        )
    if spec.origin == "shared":
        return (
            f"it is used in {len(uses)} places that the registered losses depend on "
            f"({_listed(uses)}): tied weights, or a weight used again in a function of itself "
            "(as `eqx.nn.SpectralNorm` divides a weight by its spectral norm); a layer block "
            "accounts for one use only"
        )
    return (
        "automatic layer registration is off (`register_only_generic=True` or "
        "`auto_register_tags=False`) and no `register_*` call covers it"
    )

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
    fallbacks = [s for s in specs if s.tag == "generic" and s.origin in _FALLBACKS]
    if not fallbacks or on_unmatched == "ignore":
        return
    lines = "\n".join(f"  - `{', '.join(s.param_paths)}` ({s.origin}): {_why(s)}" for s in fallbacks)
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
