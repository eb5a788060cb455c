"""`EigenbasisAdam`: Adam's moments in the K-FAC eigenbasis, a SOAP-style direction.

SOAP (Vyas et al., 2024, "SOAP: Improving and Stabilizing Shampoo using Adam",
arXiv:2409.11321) runs Adam in the eigenbasis of Shampoo's preconditioner; here the basis is the
K-FAC one: the eigenvectors of each Kronecker block's factors, refreshed with the cached inverses.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._curvature.blocks import CurvatureBlock, KroneckerFactored, KroneckerState
from .._curvature.operators.kronecker_powers import kronecker_eigh, KroneckerEigh
from .._curvature.operators.structured import apply_factors
from .direction import AbstractDirection, DirectionOutcome

BlocksVectors = tuple[tuple[Array, ...], ...]


class EigenbasisAdamState(eqx.Module):
    """The state of `EigenbasisAdam` (final).

    **Fields:**

    - `count`: the number of directions computed so far (the bias correction's `t`).
    - `first_moment`: per block, the moving average of the gradient, in the parameter basis (a
      tuple shaped like the block's parameters; rotated into the current eigenbasis at each
      step, which is what SOAP does when it rotates it along with a new basis).
    - `second_moment`: per block, the moving average of the squared gradient in the eigenbasis
      in which each gradient was taken (not rotated when the basis is refreshed, as in SOAP),
      laid out like the block's parameters (the canonical array `KroneckerFactored` acts on,
      rearranged by the block's own parameter layout).
    """

    count: Int[Array, ""]
    first_moment: BlocksVectors
    second_moment: BlocksVectors


def slice_eigh(block: KroneckerFactored, state: KroneckerState, use_cached: bool) -> KroneckerEigh:
    """The eigendecompositions of one slice's factors: the cached ones when `use_cached` and
    eigenvectors are cached, else computed from the current factors."""
    cache = state.cache.eigh
    if use_cached and cache.eigenvectors is not None:
        return KroneckerEigh(cache.eigenvalues, cache.eigenvectors)
    return kronecker_eigh(block._kronecker_factors(state))


def _rotated(
    block: CurvatureBlock, state: eqx.Module, vectors: tuple[tuple[Array, ...], ...], back: bool,
    use_cached: bool,
) -> tuple[tuple[Array, ...], ...]:
    """Each of `vectors` (the block's parameter tuples) in the eigenbasis of the block's factors
    (`back`: from it), `Q_1ᵀ ⊗ ... ⊗ Q_kᵀ` (`back`: `Q_1 ⊗ ... ⊗ Q_k`) on the canonical array;
    unchanged for a block that is not Kronecker-factored (Adam in the parameter basis)."""
    if not (isinstance(block, KroneckerFactored) and isinstance(state, KroneckerState)):
        return vectors

    def one_slice(state: KroneckerState, *vectors: tuple[Array, ...]) -> tuple[tuple[Array, ...], ...]:
        bases = slice_eigh(block, state, use_cached).eigenvectors
        bases = bases if back else tuple(q.T for q in bases)
        return tuple(
            block._array_to_params(apply_factors(bases, block._params_to_array(v))) for v in vectors
        )

    return block._stacked(one_slice, state, *vectors)


class EigenbasisAdam(AbstractDirection):
    """Adam in the K-FAC eigenbasis: a SOAP-style direction (final).

    SOAP (Vyas et al., 2024, "SOAP: Improving and Stabilizing Shampoo using Adam") runs Adam in
    the eigenbasis of a Kronecker-factored preconditioner and refreshes the basis only every few
    steps. This direction does so with K-FAC's factors: for a Kronecker-factored block
    `A ⊗ G` with eigenvectors `Q_A`, `Q_G` (the eigendecompositions the refresh schedule caches,
    every `inverse_update_period` steps; computed from the current factors at every step with
    `inverse_update_period=1`), on the block's canonical array (e.g. `(in + 1, out)` for a dense
    layer), at step `t`:

    - `m ← b1 m + (1 - b1) g` (in the parameter basis),
    - `g̃ = Q_Aᵀ g Q_G`, `v ← b2 v + (1 - b2) g̃²` (in the eigenbasis),
    - `u = Q_A [(Q_Aᵀ m̂ Q_G) / (sqrt(v̂) + eps)] Q_Gᵀ`, with `m̂ = m / (1 - b1^t)`,
      `v̂ = v / (1 - b2^t)`.

    Blocks that are not Kronecker-factored (diagonal, full, EK-FAC, a block of your own) get
    Adam in the parameter basis. The damping does not enter the direction (`eps` plays its
    part); the step rule scales it (e.g. `MomentumStep()` with `learning_rate=` and
    `momentum=0.0` gives SOAP's update `-lr · u`). The state (`EigenbasisAdamState`) is kept
    where the step is not applied.

    **Fields:**

    - `b1`, `b2`: the decays of the first and second moments.
    - `eps`: added to `sqrt(v̂)`.
    """

    b1: float | Array = 0.9
    b2: float | Array = 0.999
    eps: float | Array = 1e-8

    def __check_init__(self):
        for name in ("b1", "b2"):
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not 0.0 <= value < 1.0:
                raise ValueError(f"EigenbasisAdam: {name} must be in [0, 1), got {value}.")
        if isinstance(self.eps, (int, float)) and not self.eps >= 0.0:
            raise ValueError(f"EigenbasisAdam: eps must be >= 0, got {self.eps}.")

    def init(self, estimator, params):
        zeros = jax.tree.map(
            lambda x: jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)),
            estimator.params_vector_to_blocks_vectors(params),
        )
        return EigenbasisAdamState(jnp.zeros((), jnp.int32), zeros, zeros)

    def powers_to_cache(self):
        # The exact inverse's cache is the factors' eigendecompositions.
        return (-1, None)

    def __call__(
        self, estimator, estimator_state, grads, state, identity_weight, learning_rate, use_cached,
        axis_name=None,
    ):
        count = state.count + 1
        blocks = zip(estimator.blocks, estimator_state.block_states, strict=True)
        directions, first, second = [], [], []
        for (block, block_state), g, m, v in zip(
            blocks, estimator.params_vector_to_blocks_vectors(grads), state.first_moment,
            state.second_moment, strict=True,
        ):
            g = tuple(x.astype(y.dtype) for x, y in zip(g, m))
            m = jax.tree.map(lambda m, g: self.b1 * m + (1 - self.b1) * g, m, g)
            g_rotated, m_rotated = _rotated(block, block_state, (g, m), False, use_cached)
            v = jax.tree.map(lambda v, g: self.b2 * v + (1 - self.b2) * g**2, v, g_rotated)
            update = jax.tree.map(
                lambda m, v: (m / (1 - self.b1**count)) / (jnp.sqrt(v / (1 - self.b2**count)) + self.eps),
                m_rotated, v,
            )
            (direction,) = _rotated(block, block_state, (update,), True, use_cached)
            directions.append(direction)
            first.append(m)
            second.append(v)
        return DirectionOutcome(
            estimator.blocks_vectors_to_params_vector(directions),
            EigenbasisAdamState(count, tuple(first), tuple(second)),
        )
