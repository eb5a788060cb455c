"""`KroneckerMuon`: Muon's orthogonalised momentum, taken in the geometry of K-FAC's factors.

Muon (Jordan et al., 2024; `optax.contrib.muon`) moves each weight matrix along the polar factor
of its momentum: steepest descent under the spectral norm. Under the norm
`||A^{1/2} D G^{1/2}||_op` that K-FAC's factors `A ⊗ G` define instead, the steepest direction is
`A^{-1/2} polar(A^{-1/2} M G^{-1/2}) G^{-1/2}`: Muon in the whitened coordinates.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PyTree

from .._curvature.blocks import KroneckerFactored, KroneckerState
from .._curvature.operators.structured import apply_factors
from .direction import AbstractDirection, DirectionOutcome
from .eigenbasis_adam import slice_eigh


def newton_schulz(matrix: Float[Array, "m n"]) -> Float[Array, "m n"]:
    """The approximate polar factor `U Vᵀ` of `matrix = U S Vᵀ` that Muon uses: optax's quintic
    Newton-Schulz iteration (`optax.contrib.scale_by_muon` with no momentum).

    **Arguments:**

    - `matrix`: a 2-D array.

    **Returns:**

    An array shaped like `matrix`, its singular values near 1 (between about 0.7 and 1.2, as in Muon).
    """
    polar = optax.contrib.scale_by_muon(beta=0.0, nesterov=False)
    return polar.update(matrix, polar.init(matrix))[0]


def _promoted(x: Array) -> Array:
    """`x` in at least float32 (the moments of bf16 parameters are kept in float32)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


class KroneckerMuonState(eqx.Module):
    """The state of `KroneckerMuon` (final).

    **Fields:**

    - `count`: the number of gradients taken into the momentum so far (its bias correction).
    - `momentum`: per block, the moving average of the gradient (in the parameter basis) for
      the parameters that are orthogonalised; `None` for the others.
    - `adam`: `optax.scale_by_adam`'s state over the other parameters (`None` where a parameter
      is orthogonalised).
    - `gradient_scale`: the gradient norm an outlier is measured against: a moving average (decay
      `beta`) of the gradients' norms, each capped at `max_gradient_growth` times the average
      before it; `0` before the first gradient.
    - `rejected`: the number of gradients left out as outliers.
    """

    count: Int[Array, ""]
    momentum: PyTree[Array | None]
    adam: optax.OptState
    gradient_scale: Float[Array, ""]
    rejected: Int[Array, ""]


class KroneckerMuon(AbstractDirection):
    """Muon in K-FAC's geometry: the polar factor of the momentum, whitened by the Kronecker
    factors (final).

    For a Kronecker-factored block `A ⊗ G` with eigendecompositions `A = Q_A diag(a) Q_Aᵀ`,
    `G = Q_G diag(g) Q_Gᵀ` (the ones the refresh schedule caches, every `inverse_update_period`
    steps; computed from the current factors at every step with `inverse_update_period=1`), on
    the block's canonical array `M` (e.g. `(in + 1, out)` for a dense layer, its bias the last
    row), with Muon's momentum `M` (Nesterov's by default, as `optax.contrib.muon`):

    - `s_A = ((a / mean(a) + δ) / (1 + δ))^(-p)` and `s_G` likewise (`δ` = `damping`,
      `p` = `power`): the factors normalised to a mean eigenvalue of 1, damped, and scaled so that
      `δ → ∞` leaves them out;
    - `W = s_A ⊙ (Q_Aᵀ M Q_G) ⊙ s_G` (rows by `s_A`, columns by `s_G`);
    - `u = Q_A [s_A ⊙ polar(W) ⊙ s_G] Q_Gᵀ · sqrt(max(1, out / in))` (Muon's width scale).

    With `p = 1/2` and exact factors, `u` is the steepest direction under the norm
    `||A^{1/2} u G^{1/2}||_op` (for the damped, normalised factors); `p = 0` (or `δ → ∞`) is Muon
    itself, since the polar factor commutes with rotations. Parameters of other blocks get what
    `optax.contrib.muon` gives them: the polar factor of the momentum for 2-D arrays (e.g. an
    embedding table), Adam (`optax.scale_by_adam`, Nesterov's) for the rest (biases, norms'
    scales). The damping of the step does not enter the direction; the step rule scales it (e.g.
    `kfac_optax(direction=KroneckerMuon(), momentum=None, learning_rate=...)` gives Muon's
    update `-lr · u` in the K-FAC geometry). The state (`KroneckerMuonState`) is kept where the
    step is not applied.

    **Outlier batches.** The polar factor hides a gradient's size, so a batch whose gradient is
    1e30 times too large would move the parameters by a normal step and then rule the momentum
    for `log(1e30) / log(1 / beta)` steps (about 1,350 at `beta = 0.95`). A gradient whose norm
    exceeds `max_gradient_growth` times `gradient_scale` (a moving average of the gradients'
    norms, see `KroneckerMuonState`) is left out instead: the momentum, Adam's moments and the
    bias correction stay as they were, the orthogonalised parameters move along the bias-corrected
    momentum and the others do not move (`stats["gradient_rejected"]` says so, `rejected` counts
    it). Since each norm enters the average capped at that bound, a gradient scale that grows for
    good is reached after a few rejected steps (`log(growth) / log(beta + (1 - beta) ·
    max_gradient_growth)`, e.g. 39 steps for a 1e30 jump at the defaults), so rejections never
    go on for ever.

    **Fields:**

    - `beta`: the momentum's decay (Muon's `beta`).
    - `damping`: `δ > 0`, added to the normalised eigenvalues; smaller whitens harder.
    - `power`: `p >= 0`, the whitening's exponent.
    - `nesterov`: Nesterov's momentum (for Adam's too).
    - `adam_b1`, `adam_b2`, `eps`: Adam's decays and epsilon for the parameters that are not
      orthogonalised (`optax.contrib.muon`'s defaults).
    - `orthogonalize`: the polar factor of a 2-D array (default: Muon's Newton-Schulz iteration,
      `newton_schulz`); e.g. an exact one from the SVD, `lambda x: U @ Vt`.
    - `max_gradient_growth`: `> 1`, how far above `gradient_scale` a gradient's norm may be before
      it is left out as an outlier (see above); `None` takes every gradient.
    """

    beta: float | Array = 0.95
    damping: float | Array = 0.1
    power: float | Array = 0.5
    nesterov: bool = eqx.field(static=True, default=True)
    adam_b1: float | Array = 0.9
    adam_b2: float | Array = 0.999
    eps: float | Array = 1e-8
    orthogonalize: Callable[[Array], Array] = eqx.field(static=True, default=newton_schulz)
    max_gradient_growth: float | Array | None = 100.0

    def __check_init__(self):
        checks = dict(beta=lambda v: 0.0 <= v < 1.0, adam_b1=lambda v: 0.0 <= v < 1.0,
                      adam_b2=lambda v: 0.0 <= v < 1.0, damping=lambda v: v > 0.0,
                      power=lambda v: v >= 0.0, eps=lambda v: v >= 0.0,
                      max_gradient_growth=lambda v: v > 1.0)
        for name, holds in checks.items():
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not holds(value):
                wanted = dict(damping="> 0", power=">= 0", eps=">= 0",
                              max_gradient_growth="None or > 1").get(name, "in [0, 1)")
                raise ValueError(f"KroneckerMuon: {name} must be {wanted}, got {value}.")

    def _adam(self) -> optax.GradientTransformation:
        return optax.scale_by_adam(self.adam_b1, self.adam_b2, self.eps, nesterov=self.nesterov)

    def _split(self, estimator, vectors: PyTree) -> tuple[PyTree, PyTree]:
        """`vectors` as (the orthogonalised parameters, the others), `None` in each for the other's."""
        polar, adam = [], []
        for block, vs in zip(estimator.blocks, vectors, strict=True):
            whole = isinstance(block, KroneckerFactored)
            polar.append(tuple(v if whole or v.ndim == 2 else None for v in vs))
            adam.append(tuple(None if whole or v.ndim == 2 else v for v in vs))
        return tuple(polar), tuple(adam)

    def init(self, estimator, params):
        zeros = jax.tree.map(
            lambda x: jnp.zeros_like(_promoted(x)), estimator.params_vector_to_blocks_vectors(params)
        )
        momentum, others = self._split(estimator, zeros)
        count = jnp.zeros((), jnp.int32)
        return KroneckerMuonState(count, momentum, self._adam().init(others), jnp.zeros(()), count)

    def powers_to_cache(self):
        # The exact inverse's cache is the factors' eigendecompositions.
        return (-1, None)

    def _momentum(self, grads: PyTree, momentum: PyTree, count: Array) -> tuple[PyTree, PyTree]:
        """Muon's momentum and the vector it orthogonalises (`optax.contrib.scale_by_muon`'s)."""
        momentum = optax.tree.update_moment(grads, momentum, self.beta, 1)
        if not self.nesterov:
            return momentum, optax.tree.bias_correction(momentum, self.beta, count)
        ahead = optax.tree.bias_correction(momentum, self.beta, count + 1)
        fresh = optax.tree.bias_correction(grads, self.beta, count)
        return momentum, jax.tree.map(lambda m, g: self.beta * m + (1 - self.beta) * g, ahead, fresh)

    def _accepts(self, grads: PyTree, scale: Array) -> tuple[Array, Array]:
        """Whether `grads` is taken (not an outlier against `scale`), and the next `scale`."""
        norm = optax.tree.norm(grads)
        if self.max_gradient_growth is None:
            return jnp.array(True), scale
        bound = self.max_gradient_growth * scale
        accept = (scale == 0) | (norm <= bound)
        capped = jnp.where(accept, norm, bound)
        return accept, jnp.where(scale == 0, norm, self.beta * scale + (1 - self.beta) * capped)

    def _polar(self, matrix: Array) -> Array:
        """The polar factor with Muon's width scale `sqrt(max(1, columns / rows))`."""
        rows, columns = matrix.shape
        return self.orthogonalize(matrix) * max(1.0, columns / rows) ** 0.5

    def _whitened_polar(self, block: KroneckerFactored, state: KroneckerState, vector, use_cached: bool):
        """The direction of one Kronecker slice from its momentum `vector` (see the class)."""
        eigh = slice_eigh(block, state, use_cached)
        array = block._params_to_array(vector)
        if array.ndim != 2 or len(eigh.eigenvectors) != 2:
            raise ValueError(
                f"KroneckerMuon needs two Kronecker factors, got {len(eigh.eigenvectors)} for the "
                f"{block.spec.describe}; give that layer another block (layer_tag_to_block_ctor)."
            )
        scales = [
            ((a / jnp.maximum(jnp.mean(a), jnp.finfo(a.dtype).tiny) + self.damping) / (1 + self.damping))
            ** -self.power
            for a in eigh.eigenvalues
        ]
        rows, columns = scales[0][:, None], scales[1][None, :]
        rotated = apply_factors([q.T for q in eigh.eigenvectors], array.astype(eigh.eigenvectors[0].dtype))
        polar = rows * self._polar(rows * rotated * columns) * columns
        return block._array_to_params(apply_factors(eigh.eigenvectors, polar).astype(array.dtype))

    def __call__(
        self, estimator, estimator_state, grads, state, identity_weight, learning_rate, use_cached,
        axis_name=None,
    ):
        grads = jax.tree.map(_promoted, estimator.params_vector_to_blocks_vectors(grads))
        accept, scale = self._accepts(grads, state.gradient_scale)
        polar_grads, adam_grads = self._split(estimator, grads)
        momentum, aimed = self._momentum(polar_grads, state.momentum, state.count + 1)
        adam_updates, adam_state = self._adam().update(adam_grads, state.adam)
        # An outlier leaves the moments as they were: the momentum (bias-corrected) is followed,
        # the parameters under Adam stay.
        held = optax.tree.bias_correction(state.momentum, self.beta, jnp.maximum(state.count, 1))
        pick = lambda new, old: jax.tree.map(lambda n, o: jnp.where(accept, n, o), new, old)
        momentum, aimed = pick(momentum, state.momentum), pick(aimed, held)
        adam_state = pick(adam_state, state.adam)
        adam_updates = jax.tree.map(lambda u: jnp.where(accept, u, 0), adam_updates)
        count = state.count + accept.astype(jnp.int32)
        directions = []
        for block, block_state, aim, adam in zip(
            estimator.blocks, estimator_state.block_states, aimed, adam_updates, strict=True
        ):
            if isinstance(block, KroneckerFactored):
                fn = lambda s, v, block=block: self._whitened_polar(block, s, v, use_cached)
                directions.append(block._stacked(fn, block_state, aim))
            else:
                directions.append(tuple(u if v is None else self._polar(v) for v, u in zip(aim, adam)))
        return DirectionOutcome(
            estimator.blocks_vectors_to_params_vector(directions),
            KroneckerMuonState(count, momentum, adam_state, scale, state.rejected + (~accept).astype(jnp.int32)),
            stats={"gradient_rejected": ~accept},
        )
