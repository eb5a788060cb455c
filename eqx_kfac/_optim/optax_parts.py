"""A part given directly or built from the keywords it replaces (giving both raises `ValueError`):
`given_or_built`, shared by `eqx_kfac.kfac_jax.Optimizer`; and the parts of `kfac_preconditioner`
and `kfac_optax` (`curvature=`, `refresh=`, `direction=`)."""

from collections.abc import Callable, Mapping
from typing import Any

import jax

from .direction import PreconditionedGradient
from .preconditioner import CurvatureOptions, Preconditioner
from .refresh import RefreshSchedule


def _check_int(name: str, value: Any, who: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{who}: {name} must be a Python integer >= 1, got {value!r}. Under "
            f"`optax.inject_hyperparams`, list it in `static_args`."
        )
    return value


# Which keywords of `kfac_preconditioner` build which part (their defaults are the signature's).
PART_KEYWORDS: Mapping[str, tuple[str, ...]] = {
    "curvature": (
        "estimation_mode", "layer_tag_to_block_ctor", "index_to_block_ctor", "auto_register_kwargs",
        "inverse_solver", "on_unmatched", "batch_size_extractor", "graph_patterns",
        "patterns_to_skip", "register_only_generic",
    ),
    "refresh": ("curvature_ema", "curvature_update_period", "inverse_update_period", "max_statistics_growth"),
    "direction": ("use_exact_inverses", "norm_constraint"),
}


def keyword_given(value: Any, default: Any) -> bool:
    """Whether a keyword was given: its value is not its default (an array, which has no single
    truth value, counts as given).

    **Arguments:**

    - `value`: the keyword's value.
    - `default`: its default.

    **Returns:**

    `True` when given.
    """
    if value is default:
        return False
    try:
        return not bool(value == default)
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
        return True


def given_or_built(
    who: str, part: str, given: Any, keywords: Mapping[str, Any], defaults: Mapping[str, Any],
    build: Callable[[], Any],
) -> Any:
    """A part given directly, or built from the keywords it replaces (`build()`); a part given
    together with one of those keywords raises `ValueError` naming them. `kfac_preconditioner`,
    `kfac_optax` and `eqx_kfac.kfac_jax.Optimizer` share it.

    **Arguments:**

    - `who`: the caller's name, for the error.
    - `part`: the part's keyword (e.g. `"refresh"`).
    - `given`: the part given directly, or `None`.
    - `keywords`: the caller's keyword values by name (at least those of `defaults`).
    - `defaults`: the keywords the part replaces, with their defaults.
    - `build`: builds the part from the keywords.

    **Returns:**

    The part.
    """
    if given is None:
        return build()
    changed = [name for name, default in defaults.items() if keyword_given(keywords[name], default)]
    if changed:
        raise ValueError(
            f"{who} got {part}= and the keywords {changed}, which that part replaces; pass "
            f"them to the {type(given).__name__} instead (or drop {part}=)."
        )
    return given


def _built_part(part: str, k: Mapping[str, Any], who: str) -> Any:
    """The part `part` built from its keywords."""
    if part == "curvature":
        return CurvatureOptions(**{name: k[name] for name in PART_KEYWORDS["curvature"]})
    if part == "refresh":
        return RefreshSchedule(
            0, _check_int("curvature_update_period", k["curvature_update_period"], who),
            _check_int("inverse_update_period", k["inverse_update_period"], who), k["curvature_ema"],
            k["max_statistics_growth"],
        )
    return PreconditionedGradient(k["use_exact_inverses"], k["norm_constraint"])


def preconditioner_from_keywords(
    keywords: Mapping[str, Any], defaults: Mapping[str, Any], who: str
) -> Preconditioner:
    """The `Preconditioner` of the parts given in `keywords`, or built from their keywords.

    **Arguments:**

    - `keywords`: the parts (`curvature`, `refresh`, `direction`; `None` where not given) and the
      keywords of `PART_KEYWORDS`, by name, as given.
    - `defaults`: the caller's defaults of those keywords (a keyword at its default is not given).
    - `who`: the caller's name, for the errors.

    **Returns:**

    The `Preconditioner`.
    """
    parts = {
        part: given_or_built(
            who, part, keywords[part], keywords, {name: defaults[name] for name in names},
            lambda part=part: _built_part(part, keywords, who),
        )
        for part, names in PART_KEYWORDS.items()
    }
    return Preconditioner(**parts)
