"""kfac-jax's curvature block names on `eqx_kfac`'s blocks, the annotation classes kfac-jax code
names (`KroneckerFactored.State`, `LayerVjpData`), and `set_default_tag_to_block_ctor`, which
refuses a block written against kfac-jax's block interface when it is registered, saying what to
write instead.
"""

import inspect
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, TypeVar

from .._curvature.blocks import (
    Conv2DDiagonal as Conv2DDiagonal,
    Conv2DFull as Conv2DFull,
    Conv2DTwoKroneckerFactored as Conv2DTwoKroneckerFactored,
    CurvatureBlock as CurvatureBlock,
    DenseDiagonal as DenseDiagonal,
    DenseFull as DenseFull,
    DenseTwoKroneckerFactored as DenseTwoKroneckerFactored,
    Diagonal as Diagonal,
    Full as Full,
    KroneckerFactored as _KroneckerFactored,
    KroneckerState,
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

T = TypeVar("T")

# kfac-jax's repeated-dense block: eqx_kfac's dense block treats the repeated axes as examples.
RepeatedDenseKroneckerFactored = DenseTwoKroneckerFactored


class KroneckerFactored(_KroneckerFactored):
    """`eqx_kfac.KroneckerFactored` (the abstract family) with kfac-jax's `State` name, for
    annotations: `KroneckerFactored.State` is `eqx_kfac.KroneckerState`."""

    State: ClassVar[type] = KroneckerState


class LayerVjpData(Generic[T]):
    """kfac-jax's type of the data its blocks receive, for annotations only
    (`LayerVjpData[Array]`). `eqx_kfac`'s blocks receive an `eqx_kfac.EstimationData`; a block
    written against kfac-jax's interface is refused by `set_default_tag_to_block_ctor`."""


# kfac-jax's block interface: the methods whose names (or arguments) eqx_kfac's blocks do not have.
_KFAC_JAX_METHODS = ("fixed_scale", "_init", "_update_cache", "input_size", "output_size", "_multiply_matpower")
_KFAC_JAX_ARGUMENTS = {"update_curvature_matrix_estimate": "identity_weight", "multiply_matpower": "exact_power"}


def _kfac_jax_methods(ctor: Any) -> list[str]:
    """The methods of `ctor` (a class) written against kfac-jax's block interface."""
    if not isinstance(ctor, type):
        return []
    found = []
    for cls in ctor.__mro__:
        if cls.__module__.startswith("eqx_kfac."):
            break
        for name, member in vars(cls).items():
            argument = _KFAC_JAX_ARGUMENTS.get(name)
            if name in _KFAC_JAX_METHODS or (
                argument is not None and callable(member) and argument in inspect.signature(member).parameters
            ):
                found.append(f"{cls.__name__}.{name}")
    return found


def check_block_ctor(name: Any, ctor: Callable[..., Any]) -> None:
    """Raises `TypeError` when `ctor` is a block class written against kfac-jax's block interface
    (`update_curvature_matrix_estimate(state, estimation_data, ema_old, ema_new,
    identity_weight, batch_size)`, `_init`, `_update_cache`, `fixed_scale`, ...), which
    `eqx_kfac`'s estimators do not call, saying what to write instead.

    **Arguments:**

    - `name`: the tag, variant or parameter the block is registered for (for the message).
    - `ctor`: the block class or constructor.
    """
    methods = _kfac_jax_methods(ctor)
    if not methods:
        return
    dense = issubclass(ctor, DenseTwoKroneckerFactored)
    instead = (
        f"If {ctor.__name__} flattens repeated axes into examples (FermiNet's RepeatedDenseBlock, "
        f"kfac-jax's RepeatedDenseKroneckerFactored), eqx_kfac.DenseTwoKroneckerFactored does that "
        f"already: drop this registration (the default block of {name!r} is the dense layer's). "
        "Otherwise write it as an eqx_kfac block (see the 'Extending' page)."
        if dense else
        "Write it as an eqx_kfac block: subclass eqx_kfac.KroneckerFactored (or CurvatureBlock, "
        "Diagonal, Full) and implement slice_init / slice_update_statistics / slice_update_cache / "
        "slice_multiply_matpower on the layer's LayerSpec and EstimationData (see the 'Extending' page)."
    )
    raise TypeError(
        f"The block {ctor.__name__} registered for {name!r} is written against kfac-jax's block "
        f"interface ({', '.join(methods)}), which eqx_kfac's estimators do not call. {instead}"
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
    `register_dense` variant (see `eqx_kfac.set_default_tag_to_block_ctor`). A block class written
    against kfac-jax's block interface raises `TypeError` here, saying what to write instead.

    **Arguments:**

    - `tag_name`: a tag's name (`"dense"`, ...) or a `register_dense` variant (`"repeated_dense"`).
    - `block_ctor`: an `eqx_kfac` block class, or a `LayerSpec -> CurvatureBlock` callable.
    """
    check_block_ctor(tag_name, block_ctor)
    _set_default_tag_to_block_ctor(tag_name, block_ctor)
