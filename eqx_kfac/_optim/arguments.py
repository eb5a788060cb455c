"""Checks of what users pass to `Optimizer.init` and `Optimizer.step`, raised before anything is
compiled, with messages that name the argument and say what to do."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

from .._core.tree import signature


def describe_signature(sig: Any) -> str:
    """A readable form of a `signature`: the leaves' dtypes and shapes."""
    return ", ".join(
        f"{dtype}{list(shape)}" if shape != "static" else f"static {dtype!r}" for shape, dtype in sig[1]
    )


def _difference(got: Any, expected: Any) -> str:
    if got[0] != expected[0]:
        return f"its structure is {got[0]}, expected {expected[0]}"
    return f"got ({describe_signature(got)}), expected ({describe_signature(expected)})"


def check_batch(expected: Any, batch: PyTree, where: str) -> None:
    """Raises `ValueError` unless `batch` has the signature `expected` (of the `init` batch)."""
    got = signature(batch)
    if got != expected:
        raise ValueError(
            f"The {where} does not have the structure/shapes/dtypes of the batch given to init: "
            f"{_difference(got, expected)}. K-FAC's state was built for the init batch's shapes; "
            "call init with a batch of the new shapes (or pad/drop the last incomplete batch)."
        )


def params_signature(params: PyTree) -> Any:
    """The signature of the trained part of `params` (its inexact arrays)."""
    return signature(eqx.filter(params, eqx.is_inexact_array))


def check_params(expected: Any, params: PyTree) -> None:
    """Raises `ValueError` unless the parameters have the signature given to `init`."""
    got = params_signature(params)
    if got != expected:
        raise ValueError(
            "The parameters passed to step are not those given to init (their inexact arrays "
            f"differ): {_difference(got, expected)}. Pass the parameters returned by the previous "
            "step, or call init again for a model of another structure, shape or dtype."
        )


def check_func_state(has_state: bool, func_state: Any) -> None:
    """Raises if `func_state` is given without `value_func_has_state`, or missing with it."""
    if has_state and func_state is None:
        raise ValueError(
            "value_func_has_state=True but func_state is None: pass the function state "
            "(e.g. the model's eqx.nn.State) as func_state=."
        )
    if not has_state and func_state is not None:
        raise ValueError(
            "func_state was given but value_func_has_state=False; construct the optimizer "
            "with value_func_has_state=True or drop func_state."
        )


def check_scalar_loss(value: Callable[..., Any], loss_of: Callable[[Any], Any], func_args: tuple[Any, ...]) -> None:
    """Raises `ValueError` unless the loss function returns a scalar loss (checked abstractly)."""
    out = eqx.filter_eval_shape(lambda args: loss_of(value(*args)), func_args)
    shape = getattr(out, "shape", None)
    if shape != ():
        raise ValueError(
            f"The loss function must return a scalar loss (averaged over the batch), but it "
            f"returns {jax.tree.map(lambda x: getattr(x, 'shape', x), out)}. Reduce it, e.g. with "
            "`jnp.mean`; return other values as `(loss, aux)` with value_func_has_aux=True."
        )
