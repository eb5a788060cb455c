"""kfac-jax's `KroneckerFactored` and `DenseTwoKroneckerFactored` as adapter bases (see
`_block_adapter`): their kfac-jax methods run `eqx_kfac`'s Kronecker block for the layer on the
factors of kfac-jax's state, so a subclass that overrides some of them (FermiNet's
`RepeatedDenseBlock`: `fixed_scale` and `update_curvature_matrix_estimate`, which flattens the
repeated axes into the batch and calls `super()`) keeps `eqx_kfac`'s for the others.
"""

import functools
from collections.abc import Sequence
from typing import Any

from jax.typing import ArrayLike
from jaxtyping import Array

from .._curvature.blocks import (
    Conv2DTwoKroneckerFactored as _Conv2DKronecker,
    CurvatureBlock as _EqxBlock,
    DenseTwoKroneckerFactored as _DenseKronecker,
    KroneckerFactored as _EqxKronecker,
    KroneckerState as _KroneckerState,
)
from .._curvature.blocks.statistics import WeightedMovingAverage as _Average
from .._tracing.layer_data import EstimationData, LayerSpec
from ._block_adapter import CurvatureBlock, LayerVjpData, mutable_averages, State

# `eqx_kfac`'s Kronecker block of each tag: what kfac-jax's default rearrangement of the
# parameters (weight as `(in, out)`, bias as an extra row) is for that layer.
_EQX_KRONECKER: dict[str, type[_EqxKronecker]] = {"dense": _DenseKronecker, "conv2d": _Conv2DKronecker}


class KroneckerFactored(CurvatureBlock):
    """kfac-jax's `KroneckerFactored`: `C ≈ scale · F_1 ⊗ F_2`, its state the factors' moving
    averages (`State.factors`) and a cache. The methods a subclass does not write are
    `eqx_kfac`'s Kronecker block of the layer's tag (dense or conv2d) on those factors; called
    with a `LayerSpec`, the class itself is that block.

    **Arguments:**

    - `layer_tag_eq`: the layer's `LayerSpec`.
    - `parameters_specs`, `parameters_concat_axis`: kfac-jax's rearrangement of the parameters;
      only its default (the layer's canonical array) is supported.
    """

    class State(State):
        """kfac-jax's `KroneckerFactored.State`: `factors` (moving averages) and `cache`, or any
        other fields a subclass's `_init` gives it (FermiNet's `inputs_factor`, ...)."""

    def __init__(self, layer_tag_eq: LayerSpec, parameters_specs: Sequence[str] | None = None,
                 parameters_concat_axis: int = 0, **kwargs: Any):
        if parameters_specs is not None or parameters_concat_axis != 0:
            raise NotImplementedError(
                f"{type(self).__name__}: kfac-jax's parameters_specs / parameters_concat_axis are not "
                "supported; eqx_kfac arranges a layer's parameters as its Kronecker block does."
            )
        super().__init__(layer_tag_eq, **kwargs)

    @classmethod
    def _eqx_block(cls, spec: LayerSpec) -> _EqxBlock:
        if cls in (KroneckerFactored, DenseTwoKroneckerFactored):
            return _eqx_kronecker(cls, spec, "")(spec)
        return super()._eqx_block(spec)

    @functools.cached_property
    def _eqx(self) -> _EqxKronecker:
        """`eqx_kfac`'s Kronecker block of this layer (for the methods not overridden), built once."""
        return _eqx_kronecker(type(self), self._layer_tag_eq, "kfac-jax's default method")(self._layer_tag_eq)

    def _kronecker_state(self, state: State) -> _KroneckerState:
        if not hasattr(state, "factors"):
            raise NotImplementedError(
                f"{type(self).__name__}'s state has no `factors` (it has {sorted(vars(state))}): a "
                "subclass whose _init makes other fields must override every method that reads them "
                "(update_curvature_matrix_estimate, _update_cache, multiply_matpower, eigenvalues, "
                "to_dense_matrix)."
            )
        return _KroneckerState(factors=tuple(_Average(f.value, f.weight) for f in state.factors), cache=state.cache)

    def _with(self, state: State, kronecker: _KroneckerState) -> State:
        state = state.copy()
        state.factors = mutable_averages(kronecker.factors)
        state.cache = kronecker.cache
        return state

    def _init(self, rng: Any, exact_powers_to_cache: set, approx_powers_to_cache: set, cache_eigenvalues: bool) -> State:
        del rng
        kronecker = self._eqx.slice_init(_floats(exact_powers_to_cache), _floats(approx_powers_to_cache), cache_eigenvalues)
        return KroneckerFactored.State(factors=kronecker.factors, cache=kronecker.cache)

    def update_curvature_matrix_estimate(
        self, state: State, estimation_data: LayerVjpData, ema_old: ArrayLike, ema_new: ArrayLike,
        identity_weight: ArrayLike, batch_size: ArrayLike,
    ) -> State:
        """Folds one batch into the factors (`eqx_kfac`'s statistics of the layer: for a dense
        layer `A = x̃ᵀ x̃ / batch_size`, `G = dyᵀ dy / batch_size`, as kfac-jax's)."""
        del identity_weight
        primals, tangents = estimation_data.primals, estimation_data.tangents
        data = EstimationData(
            params=tuple(primals.params),
            inputs=tuple(primals.inputs),
            outputs=tuple(primals.outputs),
            outputs_tangent=tuple(t[None] for t in tangents.outputs),
            params_tangent=tuple(t[None] for t in tangents.params),
        )
        kronecker = self._eqx.slice_update_statistics(self._kronecker_state(state), data, ema_old, ema_new, batch_size)
        return self._with(state, kronecker)

    def _update_cache(self, state: State, identity_weight: ArrayLike, exact_powers: set, approx_powers: set, eigenvalues: bool) -> State:
        kronecker = self._eqx.slice_update_cache(
            self._kronecker_state(state), identity_weight, _floats(exact_powers), _floats(approx_powers), eigenvalues
        )
        return self._with(state, kronecker)

    def _multiply_matpower_unscaled(
        self, state: State, vector: Sequence[Array], identity_weight: ArrayLike, power: float | int,
        exact_power: bool, use_cached: bool,
    ) -> tuple[Array, ...]:
        return self._eqx.slice_multiply_matpower(
            self._kronecker_state(state), tuple(vector), identity_weight, power, exact_power, use_cached
        )

    def _eigenvalues_unscaled(self, state: State, use_cached: bool) -> Array:
        return self._eqx.slice_eigenvalues(self._kronecker_state(state), use_cached)

    def _to_dense_unscaled(self, state: State) -> Array:
        return self._eqx.slice_to_dense_matrix(self._kronecker_state(state))


class DenseTwoKroneckerFactored(KroneckerFactored):
    """kfac-jax's `DenseTwoKroneckerFactored` (see `KroneckerFactored`): `eqx_kfac`'s
    `DenseTwoKroneckerFactored` for the methods a subclass does not write; called with a
    `LayerSpec`, the class itself is that block."""

    @property
    def has_bias(self) -> bool:
        """Whether the layer has a bias."""
        return self.number_of_parameters == 2


def _floats(powers: set) -> tuple[float, ...]:
    return tuple(sorted(float(p) for p in powers))


def _eqx_kronecker(cls: type, spec: LayerSpec, what: str) -> type[_EqxKronecker]:
    """`eqx_kfac`'s Kronecker block class for `spec`'s tag, or an error naming `what` needs it."""
    eqx_class = _DenseKronecker if issubclass(cls, DenseTwoKroneckerFactored) else _EQX_KRONECKER.get(spec.tag)
    if eqx_class is None:
        raise NotImplementedError(
            f"{cls.__name__} for the {spec.describe}: {what or cls.__name__} needs eqx_kfac's Kronecker "
            f"block of the layer's tag, and tag {spec.tag!r} has none (dense and conv2d do). Override "
            "_init, update_curvature_matrix_estimate, _update_cache, multiply_matpower, eigenvalues and "
            "to_dense_matrix, or write an eqx_kfac block (the 'Extending' page)."
        )
    return eqx_class
