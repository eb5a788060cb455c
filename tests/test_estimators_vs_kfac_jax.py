"""BlockDiagonalCurvature equals kfac-jax 0.0.8 on the stored fixtures (Equinox twins, same weights).

The fixtures (`tests/reference/fixtures.md`) hold kfac-jax's dense curvature matrices after one
update in `ggn_exact` and `fisher_exact` mode, for its default K-FAC blocks, full blocks and
diagonal blocks, on a small MLP and a small CNN with softmax cross-entropy. The twins' parameters
are the fixture's, permuted to Equinox's layout by `to_eqx_layout`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import equinox as eqx
from eqx_kfac import DenseDiagonal, DenseFull
from eqx_kfac import Conv2DDiagonal, Conv2DFull
from eqx_kfac import BlockDiagonalCurvature
from eqx_kfac import register_softmax_cross_entropy_loss
from reference.twins import (
    cnn_inputs,
    cnn_twin,
    load,
    mlp_twin,
    softmax_cross_entropy,
    stored_matrix,
    to_eqx_layout,
)

BLOCKS = {
    "kfac": None,
    "full": {"dense": DenseFull, "conv2d": Conv2DFull},
    "diag": {"dense": DenseDiagonal, "conv2d": Conv2DDiagonal},
}


def loss_fn(model, batch):
    x, y = batch
    logits = jax.vmap(model)(x)
    register_softmax_cross_entropy_loss(logits, y)
    return softmax_cross_entropy(logits, y)


@eqx.filter_jit
def _dense_after_update(estimator, func_args, batch_size, mode):
    state = estimator.update_curvature_matrix_estimate(
        estimator.init(), 0.0, 1.0, batch_size, jax.random.key(0), func_args, mode
    )
    return estimator.to_dense_matrix(state)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_matches_kfac_jax(model, kind):
    fx = load(f"curvature_{model}")
    if model == "cnn":
        twin, x = cnn_twin(fx), cnn_inputs(fx)
    else:
        twin, x = mlp_twin(fx), jnp.asarray(fx["x"])
    func_args = (twin, (x, jnp.asarray(fx["y"])))
    estimator = BlockDiagonalCurvature(loss_fn, func_args, layer_tag_to_block_ctor=BLOCKS[kind])
    assert sorted(type(b).__name__ for b in estimator.blocks) == sorted(fx[f"block_classes_{kind}"])
    for mode in ("ggn_exact", "fisher_exact"):
        expected = to_eqx_layout(fx, stored_matrix(fx, f"{kind}_{mode}"))
        actual = _dense_after_update(estimator, func_args, x.shape[0], mode)
        np.testing.assert_allclose(actual, expected, rtol=1e-8, atol=1e-12 * np.abs(expected).max())
