"""kfac-jax's curvature block names: kfac-jax's bases `CurvatureBlock`, `KroneckerFactored`,
`DenseTwoKroneckerFactored` (and `RepeatedDenseKroneckerFactored`) as adapters, so that a block
class written against kfac-jax's interface (FermiNet's) becomes an `eqx_kfac` block (see
`_block_adapter`); the other names are `eqx_kfac`'s blocks. `set_default_tag_to_block_ctor`
refuses, when it is called, what cannot be adapted, saying what to write instead.
"""

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from .._curvature.blocks import (
    Conv2DDiagonal as Conv2DDiagonal,
    Conv2DFull as Conv2DFull,
    Conv2DTwoKroneckerFactored as Conv2DTwoKroneckerFactored,
    DenseDiagonal as DenseDiagonal,
    DenseFull as DenseFull,
    Diagonal as Diagonal,
    Full as Full,
    NaiveDiagonal as NaiveDiagonal,
    NaiveFull as NaiveFull,
    ScaleAndShiftDiagonal as ScaleAndShiftDiagonal,
    ScaleAndShiftFull as ScaleAndShiftFull,
    ScaledIdentity as ScaledIdentity,
)
from .._curvature.estimators.block_diagonal import (
    get_default_tag_to_block_ctor as get_default_tag_to_block_ctor,
    set_default_tag_to_block_ctor as _set_default_tag_to_block_ctor,
)
from ._block_adapter import (
    CurvatureBlock as CurvatureBlock,
    abstract_methods,
    KfacJaxBlock as KfacJaxBlock,
    LayerVjpData as LayerVjpData,
    WeightedMovingAverage as WeightedMovingAverage,
)
from ._kronecker_adapter import (
    DenseTwoKroneckerFactored as DenseTwoKroneckerFactored,
    KroneckerFactored as KroneckerFactored,
)

# kfac-jax's repeated-dense block: the dense block treats the repeated axes as examples (no
# masking of all-zero repeats).
RepeatedDenseKroneckerFactored = DenseTwoKroneckerFactored

# What an adapted block may not override: `eqx_kfac` does it itself, or its caches do not hold it.
_NOT_ADAPTED = {
    "sync": "eqx_kfac averages every statistic of a block's state over devices itself: drop it",
    "state_dependent_scale": "fold the factor into the statistics update_curvature_matrix_estimate forms",
    "parameters_shaped_list_to_array": "eqx_kfac arranges the parameters as the layer's Kronecker block does",
    "array_to_parameters_shaped_list": "eqx_kfac arranges the parameters as the layer's Kronecker block does",
}

# kfac-jax's block interface: the methods whose names (or arguments) eqx_kfac's blocks do not have.
_KFAC_JAX_METHODS = ("fixed_scale", "_init", "_update_cache", "input_size", "output_size", "_multiply_matpower")
_KFAC_JAX_ARGUMENTS = {"update_curvature_matrix_estimate": "identity_weight", "multiply_matpower": "exact_power"}


def _own_members(ctor: type) -> list[tuple[str, str, Any]]:
    """`(class name, name, member)` of what `ctor`'s classes below `eqx_kfac`'s define."""
    found = []
    for cls in ctor.__mro__:
        if cls.__module__.startswith("eqx_kfac."):
            break
        found.extend((cls.__name__, name, member) for name, member in vars(cls).items())
    return found


def _kfac_jax_methods(ctor: type) -> list[str]:
    """The methods of `ctor` (below `eqx_kfac`'s classes) written against kfac-jax's interface."""
    return [
        f"{owner}.{name}"
        for owner, name, member in _own_members(ctor)
        if name in _KFAC_JAX_METHODS
        or (name in _KFAC_JAX_ARGUMENTS and callable(member)
            and _KFAC_JAX_ARGUMENTS[name] in inspect.signature(member).parameters)
    ]


def _adapter_problem(ctor: type) -> str | None:
    """Why a subclass of kfac-jax's bases cannot be adapted (`None`: it can)."""
    if abstract := abstract_methods(ctor):
        return (
            f"it does not implement kfac-jax's {abstract}: implement them, or subclass "
            "kfac_jax.KroneckerFactored or kfac_jax.DenseTwoKroneckerFactored, whose eqx_kfac methods "
            "stand for the ones you do not write"
        )
    overridden = [(owner, name) for owner, name, _ in _own_members(ctor) if name in _NOT_ADAPTED]
    if overridden:
        return "; ".join(f"{owner}.{name} is not adapted ({_NOT_ADAPTED[name]})" for owner, name in overridden)
    return None


def check_block_ctor(name: Any, ctor: Callable[..., Any]) -> None:
    """Raises `TypeError` when `ctor` is a block class written against kfac-jax's block interface
    that cannot be adapted, saying what to write instead. Subclasses of kfac-jax's bases
    (`kfac_jax.KroneckerFactored`, `DenseTwoKroneckerFactored`, `CurvatureBlock`) are adapted
    (see `_block_adapter`) unless they leave kfac-jax's abstract methods unwritten or override
    `sync`, `state_dependent_scale` or the parameter rearrangement; `eqx_kfac`'s blocks (the
    other names) with kfac-jax's methods (`fixed_scale`, `_init`, ...) are refused.

    **Arguments:**

    - `name`: the tag, variant or parameter the block is registered for (for the message).
    - `ctor`: the block class or constructor.
    """
    if not isinstance(ctor, type):
        return
    if issubclass(ctor, CurvatureBlock):
        problem = _adapter_problem(ctor)
        if problem is not None:
            raise TypeError(f"The kfac-jax-style block {ctor.__name__} registered for {name!r} cannot be adapted: {problem}.")
        return
    methods = _kfac_jax_methods(ctor)
    if methods:
        base = next((c.__name__ for c in ctor.__mro__ if c.__module__.startswith("eqx_kfac.")), None)
        subclassing = f"subclasses eqx_kfac's {base} but " if base else ""
        raise TypeError(
            f"The block {ctor.__name__} registered for {name!r} {subclassing}is written against "
            f"kfac-jax's block interface ({', '.join(methods)}), which eqx_kfac's blocks do not call. "
            "Subclass kfac_jax.KroneckerFactored or kfac_jax.DenseTwoKroneckerFactored instead (their "
            "kfac-jax methods are adapted), or write it as an eqx_kfac block: implement slice_init / "
            "slice_update_statistics / slice_update_cache / slice_multiply_matpower on the layer's "
            "LayerSpec and EstimationData (the 'Extending' page)."
        )


def check_block_ctors(ctors: Mapping[Any, Callable[..., Any]] | None) -> None:
    """`check_block_ctor` for every entry of a `layer_tag_to_block_ctor` or
    `index_to_block_ctor` mapping.

    **Arguments:**

    - `ctors`: the mapping, or `None`.
    """
    for name, ctor in (ctors or {}).items():
        check_block_ctor(name, ctor)


def set_default_tag_to_block_ctor(tag_name: str, block_ctor: Callable[..., Any]) -> None:
    """kfac-jax's function: the block every estimator built afterwards gives a tag or a
    `register_dense` variant (see `eqx_kfac.set_default_tag_to_block_ctor`). A subclass of
    kfac-jax's bases is adapted; a block class that cannot be (see `check_block_ctor`) raises
    `TypeError` here, saying what to write instead.

    **Arguments:**

    - `tag_name`: a tag's name (`"dense"`, ...) or a `register_dense` variant (`"repeated_dense"`).
    - `block_ctor`: an `eqx_kfac` block class, a subclass of kfac-jax's bases, or a
      `LayerSpec -> CurvatureBlock` callable.
    """
    check_block_ctor(tag_name, block_ctor)
    _set_default_tag_to_block_ctor(tag_name, block_ctor)
