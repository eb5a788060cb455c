"""The embedding block against dense K-FAC of the same layer written as `one_hot(ids) @ table`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from block_helpers import dense_matpower
from eqx_kfac import DenseTwoKroneckerFactored
from eqx_kfac import EmbeddingKroneckerFactored
from eqx_kfac import register_embedding
from eqx_kfac import BlockDiagonalCurvature
from eqx_kfac import EstimationData, LayerSpec
from eqx_kfac import register_softmax_cross_entropy_loss
from eqx_kfac import register_dense

VOCAB, FEATURES, CLASSES = 6, 3, 4


class TokenClassifier(eqx.Module):
    """Embedding, tanh, linear head; per example (one id or a sequence of ids)."""

    embedding: eqx.nn.Embedding
    head: eqx.nn.Linear
    one_hot: bool = eqx.field(static=True)

    def __call__(self, ids):
        if self.one_hot:
            x = jax.nn.one_hot(ids, VOCAB, dtype=self.embedding.weight.dtype)
            h = register_dense(x @ self.embedding.weight, x, self.embedding.weight, weight_layout="in_out")
        elif jnp.ndim(ids) == 0:
            h = self.embedding(ids)
        else:
            h = jax.vmap(self.embedding)(ids)
        return jax.vmap(self.head)(jnp.tanh(h)) if jnp.ndim(ids) else self.head(jnp.tanh(h))


def _loss(model, batch):
    ids, labels = batch
    logits = jax.vmap(model)(ids)
    register_softmax_cross_entropy_loss(logits, labels)
    logp = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.take_along_axis(logp, labels[..., None], axis=-1)) / ids.shape[0]


def _estimate(model, batch, **kwargs):
    estimator = BlockDiagonalCurvature(_loss, (model, batch), **kwargs)

    @eqx.filter_jit
    def dense(model, batch):
        state = estimator.update_curvature_matrix_estimate(
            estimator.init(None), 0.0, 1.0, batch[0].shape[0], jax.random.key(0), (model, batch), "ggn_exact"
        )
        return [b.to_dense_matrix(s) for b, s in zip(estimator.blocks, state.block_states)]

    return estimator, dense(model, batch)


@pytest.mark.parametrize("ids_shape", [(7,), (4, 3)], ids=["tokens", "sequences"])
def test_embedding_block_equals_dense_kfac_of_the_one_hot_layer(ids_shape, getkey):
    model = TokenClassifier(
        eqx.nn.Embedding(VOCAB, FEATURES, key=getkey()), eqx.nn.Linear(FEATURES, CLASSES, key=getkey()), False
    )
    # Some tokens never appear: their rows have zero curvature in both.
    ids = jax.random.randint(getkey(), ids_shape, 0, VOCAB - 1)
    labels = jax.random.randint(getkey(), ids_shape, 0, CLASSES)
    # Found by the default patterns, whatever the table's shape, and given the embedding block.
    estimator, (emb_dense, head_dense) = _estimate(model, (ids, labels))
    assert isinstance(estimator.blocks[0], EmbeddingKroneckerFactored)
    assert estimator.blocks[0].spec.origin == "embedding"
    one_hot_model = TokenClassifier(model.embedding, model.head, True)
    reference, (ref_emb, ref_head) = _estimate(one_hot_model, (ids, labels))
    assert isinstance(reference.blocks[0], DenseTwoKroneckerFactored)
    np.testing.assert_allclose(emb_dense, ref_emb, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(head_dense, ref_head, rtol=1e-10, atol=1e-14)
    assert np.all(np.diag(np.asarray(emb_dense)).reshape(VOCAB, FEATURES)[-1] == 0)


def test_manual_registration_and_shape_errors():
    table = jnp.ones((VOCAB, FEATURES))
    ids = jnp.array([0, 2])
    np.testing.assert_array_equal(register_embedding(table[ids], ids, table), table[ids])
    with pytest.raises(ValueError, match="register_embedding"):
        register_embedding(table, ids, table)
    with pytest.raises(TypeError, match="integers"):
        register_embedding(table[ids], ids.astype(float), table)


def _spec(ids_shape):
    return LayerSpec(
        tag="embedding", index=0, param_paths=("table",), param_indices=(0,),
        param_shapes=((VOCAB, FEATURES),), param_dtypes=(jnp.float64,), input_shapes=(ids_shape,),
        output_shapes=((*ids_shape, FEATURES),),
    )


@eqx.filter_jit
def _algebra(block, data, v, damping):
    state = block.init(None, exact_powers_to_cache=(-1, -0.5), approx_powers_to_cache=-1, cache_eigenvalues=True)
    state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, data.inputs[0].shape[0])
    state = block.update_cache(state, damping, exact_powers=(-1, -0.5), approx_powers=-1, eigenvalues=True)
    return dict(
        state=state,
        dense=block.to_dense_matrix(state),
        columns=jax.vmap(lambda e: block.multiply(state, (e.reshape(VOCAB, FEATURES),), 0.0)[0].reshape(-1), out_axes=1)(
            jnp.eye(VOCAB * FEATURES)
        ),
        eigenvalues=block.eigenvalues(state, use_cached=True),
        roundtrip=block.multiply(state, block.multiply_inverse(state, v, damping, True, True), damping)[0],
        inv_sqrt=block.multiply_matpower(state, v, damping, -0.5, True, True)[0],
        approx=block.multiply_inverse(state, v, damping, exact_power=False, use_cached=True)[0],
        approx_fresh=block.multiply_inverse(state, v, damping, exact_power=False, use_cached=False)[0],
    )


def test_block_algebra(getkey):
    block = EmbeddingKroneckerFactored(_spec((5, 2)))
    ids = jax.random.randint(getkey(), (5, 2), 0, VOCAB - 1)
    data = EstimationData(
        params=(), inputs=(ids,), outputs=(),
        outputs_tangent=(jax.random.normal(getkey(), (3, 5, 2, FEATURES)),), params_tangent=(),
    )
    v = (jax.random.normal(getkey(), (VOCAB, FEATURES)),)
    damping = 0.3
    out = _algebra(block, data, v, jnp.asarray(damping))
    state = out.pop("state")
    out = {k: np.asarray(x) for k, x in out.items()}
    dense, flat_v = out["dense"], np.asarray(v[0]).reshape(-1)
    counts = np.bincount(np.asarray(ids).reshape(-1), minlength=VOCAB) / 10
    dy = np.asarray(data.outputs_tangent[0]).reshape(-1, FEATURES)
    np.testing.assert_allclose(dense, np.kron(np.diag(counts), dy.T @ dy / 5), rtol=1e-12)
    np.testing.assert_allclose(out["columns"], dense, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.sort(out["eigenvalues"]), np.linalg.eigvalsh(dense), rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(out["roundtrip"].reshape(-1), flat_v, rtol=1e-8)
    np.testing.assert_allclose(out["inv_sqrt"].reshape(-1), dense_matpower(dense, damping, -0.5) @ flat_v, rtol=1e-8)
    a, g = np.asarray(state.frequencies.value), np.asarray(state.output_factor.value)
    pi = np.sqrt(a.mean() / (np.trace(g) / FEATURES))
    approx = np.kron(np.diag(a + pi * np.sqrt(damping)), g + np.sqrt(damping) / pi * np.eye(FEATURES))
    np.testing.assert_allclose(out["approx"].reshape(-1), np.linalg.solve(approx, flat_v), rtol=1e-8)
    np.testing.assert_allclose(out["approx_fresh"], out["approx"], rtol=1e-10)
