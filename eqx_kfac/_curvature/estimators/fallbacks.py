"""Reporting parameters that fall back to a generic (per-parameter, diagonal) block.

A parameter gets a generic tag when no layer accounts for it: no graph pattern matched its one
use (`"unmatched"`), it is used in more than one place that the losses depend on (`"shared"`: tied
weights, a weight normalised by a function of itself, a scan carry), or automatic registration is
off and nothing registered it (`"unregistered"`). Its curvature is then approximated per
parameter, which is a silent loss of structure; estimators report it as `on_unmatched` says, with
the primitives that use it. A parameter the registered losses do not depend on (`"unused"`: frozen
behind `stop_gradient`, unused, or used only in a regulariser) needs no curvature: it is reported
apart, as such, and is never an error. A generic tag registered by hand (`register_generic`,
origin `"manual"`) is a choice, not a fallback.
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

_FALLBACKS = ("unmatched", "shared", "unregistered")


def _listed(uses: Sequence[str]) -> str:
    """`"`dot_general` x2, `div`"`: the uses, primitives in code font, repeats counted."""
    counts = collections.Counter(uses)
    return ", ".join(
        (u if " " in u else f"`{u}`") + (f" x{n}" if n > 1 else "") for u, n in counts.items()
    )


def _why(spec: LayerSpec) -> str:
    """What happened to the parameter of a fallback spec, in words."""
    uses = tuple(spec.get("uses", ()))
    if spec.origin == "unused" and uses:
        return "it is frozen: the registered losses reach it only through `jax.lax.stop_gradient`"
    if spec.origin == "unused":
        return (
            "the registered losses do not depend on it (it is unused, or used only in what they "
            "do not depend on, e.g. a regulariser added to the loss value or a returned metric)"
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


def _listing(specs: Sequence[LayerSpec]) -> str:
    return "\n".join(f"  - `{', '.join(s.param_paths)}` ({s.origin}): {_why(s)}" for s in specs)


def report_fallbacks(specs: Sequence[LayerSpec], on_unmatched: str) -> None:
    """Warns about (or raises for) parameters that fall back to a generic block, and reports
    (apart, never as an error) those the registered losses do not depend on (frozen or unused).

    **Arguments:**

    - `specs`: the traced function's layer specs.
    - `on_unmatched`: `"warn"` (a `UserWarning` naming the parameter paths, pointing at the
      user's call), `"error"` (a `ValueError` for fallbacks; parameters the losses do not depend
      on still warn) or `"ignore"`.
    """
    generic = [s for s in specs if s.tag == "generic"]
    fallbacks = [s for s in generic if s.origin in _FALLBACKS]
    unused = [s for s in generic if s.origin == "unused"]
    if not (fallbacks or unused) or on_unmatched == "ignore":
        return
    sections = []
    if fallbacks:
        sections.append(
            f"{len(fallbacks)} parameter(s) fall back to a generic per-parameter (diagonal) "
            f"curvature block instead of a structured one:\n{_listing(fallbacks)}\nRegister their "
            "layers by hand (`eqx_kfac.register_dense`, `register_conv2d`, ...) or add a "
            "`GraphPattern` for them; `register_generic` marks a fallback as intended."
        )
    if unused:
        sections.append(
            f"{len(unused)} parameter(s) are not reached by the registered losses (frozen or "
            "unused): they need no curvature, and this is no fallback. Their curvature is zero, so "
            "the damping alone scales their gradient (none for a frozen parameter):\n"
            f"{_listing(unused)}"
        )
    message = (
        "eqx_kfac: " + "\n".join(sections) + "\nPass `on_unmatched='ignore'` to silence this "
        "report, or `'error'` to make a fallback an error."
    )
    if on_unmatched == "error" and fallbacks:
        raise ValueError(message)
    warnings.warn(message, UserWarning, stacklevel=user_stacklevel(sys._getframe()))
