"""kfac-jax's block interface, adapted: a block class written against kfac-jax's
`CurvatureBlock` / `KroneckerFactored` / `DenseTwoKroneckerFactored` (FermiNet's
`RepeatedDenseBlock` and `QmcBlockedDense`) becomes an `eqx_kfac` block.

The classes here are kfac-jax's bases, with kfac-jax's methods and arguments
(`update_curvature_matrix_estimate(state, estimation_data, ema_old, ema_new, identity_weight,
batch_size)`, `_init`, `_update_cache`, `multiply_matpower`, `fixed_scale`, `inputs_shapes`,
...). Called with a `LayerSpec` (as every block constructor is, through
`set_default_tag_to_block_ctor` or `layer_tag_to_block_ctor`), a subclass builds itself on that
spec and returns a `KfacJaxBlock`: an `eqx_kfac` block whose per-slice hooks call the subclass's
kfac-jax methods. The methods a subclass does not override are `eqx_kfac`'s own: the Kronecker
bases run `eqx_kfac`'s Kronecker block for the layer (`DenseTwoKroneckerFactored` for dense
layers) on the factors of kfac-jax's state. The bases themselves, called with a spec, return
`eqx_kfac`'s block.
"""

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array

from .._curvature.blocks import CurvatureBlock as _EqxBlock
from .._curvature.blocks.statistics import WeightedMovingAverage as _Average
from .._tracing.layer_data import LayerSpec
from ._accumulators import WeightedMovingAverage as WeightedMovingAverage

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class LayerData(Generic[T]):
    """kfac-jax's per-layer arrays (`kfac_jax.layers_and_loss_tags.LayerData`).

    **Fields:**

    - `inputs`, `outputs`, `params`: tuples of arrays (batch axis first for inputs and outputs).
    """

    inputs: tuple[T, ...]
    outputs: tuple[T, ...]
    params: tuple[T, ...]


@dataclasses.dataclass(frozen=True)
class LayerVjpData(Generic[T]):
    """What a kfac-jax block's `update_curvature_matrix_estimate` receives.

    **Fields:**

    - `primals`: the layer's inputs, outputs and parameters (`LayerData`).
    - `tangents`: the output tangents (`outputs`, batch axis first, one loss-space vector) and
      parameter tangents (`params`) of that vector; `inputs` is empty.
    """

    primals: LayerData[T]
    tangents: LayerData[T]


def mutable_averages(tree: Any) -> Any:
    """`tree` with its `eqx_kfac.WeightedMovingAverage`s as kfac-jax's mutable averages (new
    ones, holding the same arrays).

    **Arguments:**

    - `tree`: any PyTree.

    **Returns:**

    The converted tree.
    """
    return jax.tree.map(
        lambda a: WeightedMovingAverage(weight=a.weight, value=a.value) if isinstance(a, _Average) else a,
        tree,
        is_leaf=lambda a: isinstance(a, (_Average, WeightedMovingAverage)),
    )


class State:
    """kfac-jax's block state: named fields (keywords), mutable, and a PyTree; every subclass is
    one too. `eqx_kfac.WeightedMovingAverage`s given to it become kfac-jax's mutable averages.

    **Fields:** the keywords given (kfac-jax's states have `cache`, Kronecker ones `factors`).
    """

    def __init__(self, **fields: Any):
        for name, value in fields.items():
            setattr(self, name, mutable_averages(value))

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        _register_state(cls)

    def copy(self) -> "State":
        """A new state (new containers and averages) holding the same arrays.

        **Returns:**

        The copy.
        """
        leaves, treedef = jax.tree.flatten(self)
        return jax.tree.unflatten(treedef, leaves)

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}({', '.join(sorted(vars(self)))})"


def _register_state(cls: type) -> None:
    def flatten(state):
        names = tuple(sorted(vars(state)))
        return tuple(getattr(state, n) for n in names), names

    def flatten_with_keys(state):
        children, names = flatten(state)
        return tuple(zip(map(jax.tree_util.GetAttrKey, names), children)), names

    def unflatten(names, children):
        state = object.__new__(cls)
        state.__dict__.update(zip(names, children))
        return state

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)


_register_state(State)


def kfac_jax_power(power: float | int) -> float | int:
    """A power as kfac-jax passes it (an `int` when it is whole: blocks key caches by
    `str(power)`)."""
    return int(power) if float(power).is_integer() else float(power)


def _power_set(powers: Any) -> set[float | int]:
    if powers is None:
        return set()
    if isinstance(powers, (int, float)):
        powers = (powers,)
    return {kfac_jax_power(p) for p in powers}


class _AdaptedMeta(abc.ABCMeta):
    """Called with a `LayerSpec` alone (as a block constructor), a class returns an `eqx_kfac`
    block (see the module docstring); otherwise it constructs as usual."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], LayerSpec):
            return cls._eqx_block(args[0])
        return super().__call__(*args, **kwargs)


class CurvatureBlock(metaclass=_AdaptedMeta):
    """kfac-jax's abstract block: the layer's shapes, the scale, and the public methods, which
    call the private ones (`_init`, `_update_cache`, `_multiply_matpower_unscaled`, ...) as
    kfac-jax's do. A subclass implements the abstract methods (see the module docstring).

    **Arguments:**

    - `layer_tag_eq`: the layer (an `eqx_kfac.LayerSpec` here, kfac-jax's tag equation there).
    """

    State: ClassVar[type] = State

    def __init__(self, layer_tag_eq: LayerSpec, **kwargs: Any):
        del kwargs  # kfac-jax's `var_to_idx`: the parameters are in tag order here.
        self._layer_tag_eq = layer_tag_eq

    @classmethod
    def _eqx_block(cls, spec: LayerSpec) -> _EqxBlock:
        if abstract_methods(cls):
            raise TypeError(f"{cls.__name__} does not implement kfac-jax's {abstract_methods(cls)}.")
        return KfacJaxBlock(spec=spec, block=super(_AdaptedMeta, cls).__call__(spec))  # type: ignore[misc]

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._layer_tag_eq == other._layer_tag_eq  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self._layer_tag_eq))

    # --- the layer ------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The layer's description."""
        return self._layer_tag_eq.describe

    @property
    def inputs_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of the layer's inputs, batch axis first."""
        return self._layer_tag_eq.input_shapes

    @property
    def outputs_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of the layer's outputs, batch axis first."""
        return self._layer_tag_eq.output_shapes

    @property
    def parameters_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of the layer's parameters, in tag order."""
        return self._layer_tag_eq.param_shapes

    @property
    def number_of_parameters(self) -> int:
        """How many parameter arrays the layer has."""
        return len(self.parameters_shapes)

    @property
    def parameters_canonical_order(self) -> tuple[int, ...]:
        """The parameters' order (tag order here)."""
        return tuple(range(self.number_of_parameters))

    @property
    def layer_tag_extra_params(self) -> dict[str, Any]:
        """The tag's keyword parameters."""
        return dict(self._layer_tag_eq.meta)

    @property
    def dim(self) -> int:
        """The number of parameter elements."""
        return sum(math.prod(s) for s in self.parameters_shapes)

    @property
    def dtype(self) -> Any:
        """The statistics dtype (`eqx_kfac`'s: float32 or wider)."""
        return jnp.result_type(*self._layer_tag_eq.param_dtypes, jnp.float32)

    # --- the scale ------------------------------------------------------------------------

    def fixed_scale(self) -> ArrayLike:
        """A constant factor of the curvature (kfac-jax's; 1)."""
        return 1.0

    def state_dependent_scale(self, state: State) -> ArrayLike:
        """A factor of the curvature computed from the state (kfac-jax's; 1)."""
        del state
        return 1.0

    def scale(self, state: State, use_cache: bool) -> ArrayLike:
        """The curvature's factor: `fixed_scale()`, times `state_dependent_scale(state)` unless
        cached values (which include it) are used.

        **Arguments:**

        - `state`: the block's state.
        - `use_cache`: whether cached values are used.

        **Returns:**

        The factor.
        """
        if use_cache:
            return self.fixed_scale()
        return self.fixed_scale() * self.state_dependent_scale(state)

    # --- kfac-jax's public methods ----------------------------------------------------------

    def init(self, rng: Any, exact_powers_to_cache: Any, approx_powers_to_cache: Any, cache_eigenvalues: bool) -> State:
        """kfac-jax's `init`: `_init` with the powers as sets.

        **Arguments:**

        - `rng`: a PRNG key (or `None`), handed to `_init`.
        - `exact_powers_to_cache`, `approx_powers_to_cache`: `None`, a power or powers.
        - `cache_eigenvalues`: whether eigenvalues will be cached.

        **Returns:**

        The block's `State`.
        """
        return self._init(rng, _power_set(exact_powers_to_cache), _power_set(approx_powers_to_cache), cache_eigenvalues)

    def update_cache(self, state: State, identity_weight: ArrayLike, exact_powers: Any, approx_powers: Any, eigenvalues: bool) -> State:
        """kfac-jax's `update_cache`: `_update_cache` with the damping divided by the scale.

        **Arguments:**

        - `state`: the block's state.
        - `identity_weight`: the damping.
        - `exact_powers`, `approx_powers`: `None`, a power or powers to refresh.
        - `eigenvalues`: whether to refresh the cached eigenvalues.

        **Returns:**

        The state with refreshed caches.
        """
        return self._update_cache(
            state, identity_weight / self.scale(state, False), _power_set(exact_powers), _power_set(approx_powers), eigenvalues
        )

    def multiply_matpower(
        self, state: State, vector: Sequence[Array], identity_weight: ArrayLike, power: float | int,
        exact_power: bool, use_cached: bool,
    ) -> tuple[Array, ...]:
        """kfac-jax's `multiply_matpower`: `(scale · C + λ I)^p v` from the unscaled product.

        **Arguments:**

        - `state`: the block's state.
        - `vector`: arrays shaped like the parameters.
        - `identity_weight`: the damping `λ`.
        - `power`: the power `p`.
        - `exact_power`, `use_cached`: as kfac-jax's.

        **Returns:**

        A tuple of arrays shaped like `vector`.
        """
        scale = self.scale(state, use_cached)
        result = self._multiply_matpower_unscaled(state, vector, identity_weight / scale, power, exact_power, use_cached)
        return tuple(r * jnp.power(scale, power) for r in result)

    def eigenvalues(self, state: State, use_cached: bool) -> Array:
        """kfac-jax's `eigenvalues`: the unscaled ones times the scale.

        **Arguments:**

        - `state`: the block's state.
        - `use_cached`: use the cached eigenvalues.

        **Returns:**

        The eigenvalues.
        """
        return self.scale(state, use_cached) * self._eigenvalues_unscaled(state, use_cached)

    def to_dense_matrix(self, state: State) -> Array:
        """kfac-jax's `to_dense_matrix`: the unscaled matrix times the scale.

        **Arguments:**

        - `state`: the block's state.

        **Returns:**

        The `(dim, dim)` matrix.
        """
        return self.scale(state, False) * self._to_dense_unscaled(state)

    # --- what a subclass writes -------------------------------------------------------------

    @abc.abstractmethod
    def _init(self, rng: Any, exact_powers_to_cache: set, approx_powers_to_cache: set, cache_eigenvalues: bool) -> State:
        """The state: empty statistics and caches."""

    @abc.abstractmethod
    def update_curvature_matrix_estimate(
        self, state: State, estimation_data: LayerVjpData, ema_old: ArrayLike, ema_new: ArrayLike,
        identity_weight: ArrayLike, batch_size: ArrayLike,
    ) -> State:
        """Folds one batch into the statistics (kfac-jax's method; see `KfacJaxBlock` for the
        arguments it is called with).

        **Arguments:**

        - `state`: a copy of the block's state (it may be changed in place).
        - `estimation_data`: the layer's `LayerVjpData` for one loss-space vector.
        - `ema_old`, `ema_new`: the moving averages' weights.
        - `identity_weight`: `0.0` (eqx_kfac's statistics update is not given the damping).
        - `batch_size`: the number of examples.

        **Returns:**

        The updated state.
        """

    @abc.abstractmethod
    def _update_cache(self, state: State, identity_weight: ArrayLike, exact_powers: set, approx_powers: set, eigenvalues: bool) -> State:
        """Refreshes the caches (damping already divided by the scale)."""

    @abc.abstractmethod
    def _multiply_matpower_unscaled(
        self, state: State, vector: Sequence[Array], identity_weight: ArrayLike, power: float | int,
        exact_power: bool, use_cached: bool,
    ) -> tuple[Array, ...]:
        """The product without the scale."""

    @abc.abstractmethod
    def _eigenvalues_unscaled(self, state: State, use_cached: bool) -> Array:
        """The eigenvalues without the scale."""

    @abc.abstractmethod
    def _to_dense_unscaled(self, state: State) -> Array:
        """The dense matrix without the scale."""


def abstract_methods(cls: type) -> str:
    """The abstract methods of a kfac-jax-style class, as text (empty when there are none)."""
    return ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))


class KfacJaxState(eqx.Module):
    """The state of a `KfacJaxBlock` (final).

    **Fields:**

    - `state`: the kfac-jax block's `State`.
    """

    state: State


class KfacJaxBlock(_EqxBlock):
    """A block written against kfac-jax's interface, as an `eqx_kfac` block (final): each hook
    calls the kfac-jax block's method of the same purpose with kfac-jax's arguments (powers as
    kfac-jax passes them, `identity_weight=0.0` to `update_curvature_matrix_estimate`, which
    `eqx_kfac`'s hook is not given) on a copy of the kfac-jax block's `State`, which its state
    (a `KfacJaxState`) holds.

    With `V > 1` loss-space vectors (the exact estimation modes), the statistics are updated
    once per vector, as kfac-jax's estimator does: the tangents times `sqrt(V)`, the weight
    `ema_new / V`, and the past kept (`ema_old = 1`) after the first.

    **Fields:**

    - `spec`: the layer's `LayerSpec` (static).
    - `block`: the kfac-jax-style block built on `spec` (static).
    """

    spec: LayerSpec = eqx.field(static=True)
    block: CurvatureBlock = eqx.field(static=True)

    def slice_init(self, exact_powers, approx_powers, cache_eigenvalues) -> KfacJaxState:
        return KfacJaxState(self.block.init(None, exact_powers, approx_powers, cache_eigenvalues))

    def slice_update_statistics(self, state, data, ema_old, ema_new, batch_size) -> KfacJaxState:
        state = state.state
        vectors = data.outputs_tangent[0].shape[0] if data.outputs_tangent else data.params_tangent[0].shape[0]
        primals = LayerData(inputs=tuple(data.inputs), outputs=tuple(data.outputs), params=tuple(data.params))
        factor = 1.0 if vectors == 1 else math.sqrt(vectors)
        for v in range(vectors):
            tangents = LayerData(
                inputs=(),
                outputs=tuple(t[v] * factor for t in data.outputs_tangent),
                params=tuple(t[v] * factor for t in data.params_tangent),
            )
            state = self.block.update_curvature_matrix_estimate(
                state.copy(), LayerVjpData(primals, tangents), ema_old, ema_new / vectors, 0.0, batch_size
            )
            ema_old = 1.0
        return KfacJaxState(state)

    def slice_update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues) -> KfacJaxState:
        return KfacJaxState(
            self.block.update_cache(state.state.copy(), identity_weight, exact_powers, approx_powers, eigenvalues)
        )

    def slice_multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached) -> tuple[Array, ...]:
        return tuple(self.block.multiply_matpower(
            state.state.copy(), tuple(vector), identity_weight, kfac_jax_power(power), exact_power, use_cached
        ))

    def slice_eigenvalues(self, state, use_cached) -> Array:
        return jnp.reshape(self.block.eigenvalues(state.state.copy(), use_cached), (-1,))

    def slice_to_dense_matrix(self, state) -> Array:
        return self.block.to_dense_matrix(state.state.copy())
