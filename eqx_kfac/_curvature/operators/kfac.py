"""K-FAC as a lineax operator over a data set: products, spectra, inverses and Laplace samples.

`kfac_linear_operator(func, params, data)` accumulates a `BlockDiagonalCurvature` over a data
iterator and wraps it as `KFACLinearOperator`, the PyTorch library curvlinops'
`KFACLinearOperator` made Equinox-native: a lineax operator on parameter-space vectors with
`trace`, `logdet`, `det`, `frobenius_norm`, `eigenvalues`, `inverse` and `sample`.
"""

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Inexact, PRNGKeyArray, PyTree

from ..._core.compiled import compiled
from ..blocks.statistics import WeightedMovingAverage
from ..blocks.kronecker import KroneckerFactored
from .block_operators import (
    AbstractCurvatureOperator,
    KroneckerCurvatureOperator,
    StackedCurvatureOperator,
)
from ..estimators import (
    BlockDiagonalCurvature,
    default_batch_size_extractor,
    EstimatorState,
    ParameterSpaceOperator,
)
from .kronecker_powers import identity_like
from .spectral import eigenvalues, frobenius_norm, logdet, matpower, trace


FISHER_TYPES: dict[str, str] = {
    "mc": "fisher_gradients",
    "type-2": "ggn_exact",
    "empirical": "fisher_empirical",
    "forward-only": "ggn_curvature_prop",
}


class KFACLinearOperator(lx.AbstractLinearOperator):
    """The curvature estimate `scale · C + damping · I` of a block-diagonal estimator, as an operator.

    `C` is the (block-diagonal, e.g. K-FAC) estimate held by `estimator` and `state`; `scale`
    turns the per-example average into, for example, the curvature of a whole data set
    (`scaled(num_data)`), and `damping` adds a multiple of the identity (`damped(prior)` gives a
    Laplace posterior precision). Vectors have the structure of
    `eqx.filter(params, eqx.is_inexact_array)`.

    It is a view of the estimator's structured operator (`estimator.as_linear_operator`, one
    curvature operator per block, scaled): products, spectral quantities, inverses and samples
    are those of the blocks' operators (Kronecker blocks: from their factors), never of a dense
    matrix; `as_matrix()` is for small models. The operator is symmetric positive
    semi-definite and is tagged so for lineax.

    Build one from data with `kfac_linear_operator`, or from any `BlockDiagonalCurvature` and its
    state (e.g. the optimizer's) directly.

    **Fields:**

    - `estimator`: the `BlockDiagonalCurvature` that defines the blocks.
    - `state`: its state, holding the accumulated statistics.
    - `scale`: a positive scalar multiplying the estimate.
    - `damping`: a non-negative scalar added to the diagonal.
    """

    estimator: BlockDiagonalCurvature
    state: EstimatorState
    scale: Float[Array, ""]
    damping: Float[Array, ""]

    def __init__(
        self,
        estimator: BlockDiagonalCurvature,
        state: EstimatorState,
        scale: ArrayLike = 1.0,
        damping: ArrayLike = 0.0,
    ):
        """**Arguments:**

        - `estimator`: a `BlockDiagonalCurvature`.
        - `state`: its state (with statistics already accumulated).
        - `scale`: positive factor on the estimate.
        - `damping`: non-negative multiple of the identity added to it.
        """
        self.estimator = estimator
        self.state = state
        dtype = _dtype(estimator)
        self.scale = jnp.asarray(scale, dtype)
        self.damping = jnp.asarray(damping, dtype)

    def structured_operator(self, extra_damping: ArrayLike = 0.0) -> ParameterSpaceOperator:
        """The operator (plus `extra_damping · I`) as the estimator's structured operator.

        **Arguments:**

        - `extra_damping`: a non-negative scalar added to the damping.

        **Returns:**

        A `ParameterSpaceOperator` over one curvature operator per block (each scaled by
        `scale`), for `scale · C + (damping + extra_damping) · I`.
        """
        total = self.damping + extra_damping
        operator = self.estimator.as_linear_operator(self.state, total / self.scale)
        return _map_blocks(operator, lambda block: block.scaled(self.scale))

    # --- lineax interface ---------------------------------------------------------------------

    @compiled
    def mv(self, vector: PyTree[Inexact[Array, "..."]]) -> PyTree[Inexact[Array, "..."]]:
        return self.structured_operator().mv(vector)

    @compiled
    def as_matrix(self) -> Float[Array, "dim dim"]:
        return self.structured_operator().as_matrix()

    def transpose(self) -> "KFACLinearOperator":
        return self

    def in_structure(self) -> PyTree[jax.ShapeDtypeStruct]:
        dtype = _dtype(self.estimator)
        leaves = [jax.ShapeDtypeStruct(s, dtype) for s in self.estimator.param_shapes]
        return jax.tree.unflatten(self.estimator.params_treedef, leaves)

    def out_structure(self) -> PyTree[jax.ShapeDtypeStruct]:
        return self.in_structure()

    # --- new operators ------------------------------------------------------------------------

    def scaled(self, factor: ArrayLike) -> "KFACLinearOperator":
        """The operator times a positive `factor` (the damping is scaled too).

        **Arguments:**

        - `factor`: a positive scalar, e.g. the number of training examples.

        **Returns:**

        A `KFACLinearOperator` for `factor · (scale · C + damping · I)`.
        """
        return KFACLinearOperator(
            self.estimator, self.state, self.scale * factor, self.damping * factor
        )

    def damped(self, damping: ArrayLike) -> "KFACLinearOperator":
        """The operator plus `damping · I`.

        **Arguments:**

        - `damping`: a non-negative scalar, e.g. a prior precision.

        **Returns:**

        A `KFACLinearOperator` for `scale · C + (self.damping + damping) · I`.
        """
        return KFACLinearOperator(self.estimator, self.state, self.scale, self.damping + damping)

    # --- spectral quantities ------------------------------------------------------------------

    @compiled
    def eigenvalues(self) -> Float[Array, " dim"]:
        """The eigenvalues, block by block (not sorted).

        **Returns:**

        A flat array of `dim` eigenvalues `scale · λ_i(C) + damping`.
        """
        return eigenvalues(self.structured_operator())

    @compiled
    def trace(self) -> Float[Array, ""]:
        """The trace.

        **Returns:**

        A scalar array.
        """
        return trace(self.structured_operator())

    @compiled
    def logdet(self) -> Float[Array, ""]:
        """The log-determinant (`-inf` when the operator is singular).

        **Returns:**

        A scalar array.
        """
        return logdet(self.structured_operator())

    @compiled
    def det(self) -> Float[Array, ""]:
        """The determinant (prefer `logdet`, which does not overflow).

        **Returns:**

        A scalar array.
        """
        return jnp.exp(self.logdet())

    @compiled
    def frobenius_norm(self) -> Float[Array, ""]:
        """The Frobenius norm.

        **Returns:**

        A scalar array.
        """
        return frobenius_norm(self.structured_operator())

    # --- inverse and sampling -----------------------------------------------------------------

    def inverse(
        self,
        damping: ArrayLike = 0.0,
        use_heuristic_damping: bool = False,
        use_exact_damping: bool = False,
    ) -> ParameterSpaceOperator:
        """An inverse of the operator with extra damping, as a structured PSD lineax operator.

        The total damping is `δ = self.damping + damping`. For a Kronecker block with factors
        `A ⊗ (scale·G)` (the scale is folded into the last factor):

        - default: `((A + δI) ⊗ (scale·G + δI))⁻¹`, each factor damped by `δ` (as curvlinops);
        - `use_heuristic_damping=True`: the pi-adjusted factored damping of Martens & Grosse
          (2015), `(A + π√δ I)⁻¹ ⊗ (scale·G + √δ/π I)⁻¹`;
        - `use_exact_damping=True`: the exact `(scale · A ⊗ G + δI)⁻¹`, from the factors'
          eigendecompositions.

        Blocks without Kronecker factors (diagonal, full, EK-FAC) are always inverted exactly
        (a full block is a Kronecker operator with one factor, for which all three agree).

        **Arguments:**

        - `damping`: extra damping `≥ 0` on top of the operator's own.
        - `use_heuristic_damping`: use pi-adjusted damping.
        - `use_exact_damping`: invert the exactly damped operator.

        **Returns:**

        A `ParameterSpaceOperator` over the blocks' inverse curvature operators (so `trace`,
        `logdet`, ... of the inverse are structured too).
        """
        if use_heuristic_damping and use_exact_damping:
            raise ValueError(
                "KFACLinearOperator.inverse: use_heuristic_damping and use_exact_damping are "
                "exclusive; pass at most one of them."
            )
        # The damping as an array: a traced argument of the compiled inverse, not a static one.
        return _inverse(self, jnp.asarray(damping), use_heuristic_damping, use_exact_damping)

    def sample(
        self, key: PRNGKeyArray, prior_precision: ArrayLike = 0.0, num_samples: int | None = None
    ) -> PyTree[Array]:
        """Draws from `N(0, (operator + prior_precision · I)⁻¹)` (a Laplace posterior around zero).

        A sample is `(scale·C + λI)^(-1/2) z` with `z ~ N(0, I)` and `λ = damping +
        prior_precision`, computed exactly per block (Kronecker blocks from their factors'
        eigendecompositions, without forming the product). Add the mode (the trained parameters)
        to get posterior samples of the parameters.

        **Arguments:**

        - `key`: a PRNG key.
        - `prior_precision`: the precision `≥ 0` of an isotropic Gaussian prior; the total
          damping must be positive unless the curvature is non-singular.
        - `num_samples`: `None` for one sample, otherwise the number of samples (stacked on a
          leading axis of every leaf).

        **Returns:**

        A parameter-space vector (with a leading sample axis when `num_samples` is given).
        """
        # The prior precision as an array: an argument of the compiled draw, not a static value.
        return _sample(self, key, jnp.asarray(prior_precision), num_samples)


@compiled
def _sample(
    operator: KFACLinearOperator, key: PRNGKeyArray, prior_precision: Array, num_samples: int | None
) -> PyTree[Array]:
    """`KFACLinearOperator.sample`, compiled as one program when called eagerly."""
    root = matpower(operator.structured_operator(prior_precision), -0.5)
    leaves, treedef = jax.tree.flatten(operator.in_structure())

    def one_sample(key):
        keys = jax.random.split(key, len(leaves))
        noise = [jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, leaves)]
        return root.mv(jax.tree.unflatten(treedef, noise))

    if num_samples is None:
        return one_sample(key)
    return jax.vmap(one_sample)(jax.random.split(key, num_samples))


@compiled
def _inverse(
    operator: KFACLinearOperator, damping: Array, use_heuristic_damping: bool, use_exact_damping: bool
) -> ParameterSpaceOperator:
    """`KFACLinearOperator.inverse`, compiled as one program when called eagerly."""
    structured = operator.structured_operator(damping)
    if not (use_exact_damping or use_heuristic_damping):
        structured = _map_blocks(structured, _each_factor_damped)
    return matpower(structured, -1, exact=not use_heuristic_damping)


def _dtype(estimator: BlockDiagonalCurvature) -> Any:
    return jnp.result_type(*(block.dtype for block in estimator.blocks))


def _map_blocks(
    operator: ParameterSpaceOperator,
    fn: Callable[[AbstractCurvatureOperator], AbstractCurvatureOperator],
) -> ParameterSpaceOperator:
    """Applies `fn` to each block's curvature operator of an estimator's operator."""
    blocks = tuple(fn(block) for block in operator.inner.blocks)
    return eqx.tree_at(lambda op: op.inner.blocks, operator, blocks)


def _each_factor_damped(operator: AbstractCurvatureOperator) -> AbstractCurvatureOperator:
    """A Kronecker operator `⊗F_i + λI` becomes `⊗(F_i + λI)` (curvlinops); others are unchanged."""
    if isinstance(operator, StackedCurvatureOperator):
        return StackedCurvatureOperator(jax.vmap(_each_factor_damped)(operator.slices))
    if not isinstance(operator, KroneckerCurvatureOperator):
        return operator
    damping = operator.damping
    factors = tuple(f + damping * identity_like(f) for f in operator.factors)
    return KroneckerCurvatureOperator(factors, jnp.zeros_like(damping), operator.layout)


def _identity_output_factors(estimator: BlockDiagonalCurvature, state: EstimatorState) -> EstimatorState:
    """Replaces the output factor of every Kronecker block by the identity (forward-only K-FAC)."""
    block_states = []
    for block, block_state in zip(estimator.blocks, state.block_states):
        if not isinstance(block, KroneckerFactored):
            raise ValueError(
                f"fisher_type='forward-only' replaces the output-gradient factor of Kronecker "
                f"blocks by the identity, but the {block.spec.describe} has a "
                f"{type(block).__name__}, which has no such factor. Use another fisher_type, or "
                "give every layer a Kronecker block (`layer_tag_to_block_ctor`) and register "
                "parameters outside dense/conv layers as part of them."
            )
        last = block_state.factors[-1]
        eye = jnp.broadcast_to(jnp.eye(last.value.shape[-1], dtype=last.value.dtype), last.value.shape)
        factors = (*block_state.factors[:-1], WeightedMovingAverage(value=eye, weight=last.weight))
        block_states.append(eqx.tree_at(lambda s: s.factors, block_state, factors))
    return eqx.tree_at(lambda s: s.block_states, state, tuple(block_states))


@eqx.filter_jit
def _accumulate(estimator, state, key, params, batch, batch_size, weight, mode):
    return estimator.update_curvature_matrix_estimate(
        state, 1.0, weight, batch_size, key, (params, batch), mode
    )


def kfac_linear_operator(
    func: Callable[..., Any],
    params: PyTree,
    data: Iterable[Any],
    *,
    fisher_type: str = "mc",
    key: PRNGKeyArray | None = None,
    mc_samples: int = 1,
    progressbar: bool = False,
    batch_size_extractor: Callable[[Any], int] = default_batch_size_extractor,
    layer_tag_to_block_ctor: Mapping[str, Callable] | None = None,
    index_to_block_ctor: Mapping[Any, Callable] | None = None,
    **auto_register_kwargs: Any,
) -> KFACLinearOperator:
    """Accumulates a K-FAC (block-diagonal) curvature estimate over a data set as a lineax operator.

    Every batch's statistics enter the average weighted by its size, so the result is the
    per-example average over the whole data set (uneven batches included); for the curvature of
    the summed loss, call `.scaled(num_data)` on the result.

    **Arguments:**

    - `func`: the loss function `func(params, batch)`; it must register its losses (e.g.
      `register_softmax_cross_entropy_loss(logits, targets)`). Layers are found automatically
      as for `BlockDiagonalCurvature`.
    - `params`: the parameters (a model) at which the curvature is taken.
    - `data`: an iterable of batches (each the second argument of `func`); for one batch pass
      `[batch]`.
    - `fisher_type`: `"mc"` (Fisher from `mc_samples` targets sampled from the model per
      example), `"type-2"` (exact: the GGN, i.e. the Fisher for the registered likelihoods),
      `"empirical"` (gradients at the data's targets: `(1/N) Σ_n g_n g_nᵀ` per block) or
      `"forward-only"` (the output-gradient factor of every Kronecker block is the identity: only
      input statistics are used, as FOOF / ISAAC).
    - `key`: PRNG key for `"mc"` (required there).
    - `mc_samples`: number of sampled targets per example for `"mc"` (must be 1 otherwise).
    - `progressbar`: show a `tqdm` progress bar over the batches (needs `tqdm`).
    - `batch_size_extractor`: `batch -> int`, the number of examples of a batch.
    - `layer_tag_to_block_ctor`, `index_to_block_ctor`, `**auto_register_kwargs`: as for
      `BlockDiagonalCurvature` (e.g. `{"dense": DenseEigenbasisKFAC}` for EK-FAC).

    **Returns:**

    A `KFACLinearOperator`.
    """
    if fisher_type not in FISHER_TYPES:
        raise ValueError(
            f"Unknown fisher_type {fisher_type!r}; expected one of {', '.join(FISHER_TYPES)}."
        )
    if fisher_type == "mc" and key is None:
        raise ValueError("fisher_type='mc' samples targets: pass `key=jax.random.key(...)`.")
    if mc_samples < 1 or (mc_samples != 1 and fisher_type != "mc"):
        raise ValueError(
            f"mc_samples={mc_samples}: it must be a positive integer, and 1 unless fisher_type='mc'."
        )
    key = jax.random.key(0) if key is None else key
    mode = FISHER_TYPES[fisher_type]
    if progressbar:
        from tqdm.auto import tqdm

        data = tqdm(data, desc="K-FAC statistics", unit="batch")
    estimator, state = None, None
    total, total_sq = 0, 0
    for batch in data:
        if estimator is None:
            estimator = BlockDiagonalCurvature(
                func,
                (params, batch),
                default_estimation_mode=mode,
                layer_tag_to_block_ctor=layer_tag_to_block_ctor,
                index_to_block_ctor=index_to_block_ctor,
                **auto_register_kwargs,
            )
            state = estimator.init(None)
        size = int(batch_size_extractor(batch))
        # `fisher_empirical` (kfac-jax's convention) divides a batch's statistics by its size
        # once more; weighting by size² and rescaling by Σ size² / Σ size at the end undoes it.
        weight = size * size if fisher_type == "empirical" else size
        for _ in range(mc_samples):
            key, subkey = jax.random.split(key)
            state = _accumulate(
                estimator, state, subkey, params, batch, size, jnp.asarray(weight / mc_samples), mode
            )
        total, total_sq = total + size, total_sq + size * size
    if estimator is None:
        raise ValueError("kfac_linear_operator: `data` yielded no batch.")
    if fisher_type == "forward-only":
        state = _identity_output_factors(estimator, state)
    scale = total_sq / total if fisher_type == "empirical" else 1.0
    return KFACLinearOperator(estimator, state, scale=scale)


@lx.linearise.register(KFACLinearOperator)
@lx.materialise.register(KFACLinearOperator)
@lx.conj.register(KFACLinearOperator)
def _(operator):
    return operator


# Everything else is the structured operator's: its spectral functions, diagonal and structure.
for _function in (
    lx.tridiagonal,
    lx.is_symmetric,
    lx.is_positive_semidefinite,
    lx.is_negative_semidefinite,
    lx.is_diagonal,
    lx.is_tridiagonal,
    lx.has_unit_diagonal,
    lx.is_lower_triangular,
    lx.is_upper_triangular,
):

    @_function.register(KFACLinearOperator)
    def _(operator, *args, _function=_function, **kwargs):
        return _function(operator.structured_operator(), *args, **kwargs)


# The functions that compute arrays, as one compiled program each when called eagerly (as the
# methods are); the other arguments (a power, `exact`) are static.
for _function in (trace, logdet, eigenvalues, frobenius_norm, matpower, lx.diagonal):

    @_function.register(KFACLinearOperator)
    @compiled
    def _(operator, *args, _function=_function, **kwargs):
        return _function(operator.structured_operator(), *args, **kwargs)
