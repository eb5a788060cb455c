"""The kfac-jax fixtures agree with their Equinox twins under the documented layouts.

These tests pin the layout mapping of `fixtures.md` (parameter order, weight transposes, the CNN's
input/flatten order) with references independent of kfac-jax and of eqx_kfac: brute-force GGNs
from `jax.jacobian`, and losses/gradients of the twins. Parity of eqx_kfac itself is tested in the
estimator and optimizer tests.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from twins import (
    cnn_inputs,
    cnn_twin,
    load,
    mlp_twin,
    softmax_cross_entropy,
    stored_matrix,
    to_eqx_layout,
)


def _flat(model):
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    return jnp.concatenate([leaf.reshape(-1) for leaf in leaves])


def _brute_force_ggn(model, inputs):
    """(1/B) sum_b J_b^T (diag(p_b) - p_b p_b^T) J_b over the twin's flat parameters."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    sizes = [leaf.size for leaf in leaves]

    def logits_of(vec):
        pieces = jnp.split(vec, np.cumsum(sizes)[:-1])
        new = jax.tree.unflatten(treedef, [p.reshape(l.shape) for p, l in zip(pieces, leaves)])
        return jax.vmap(eqx.combine(new, static))(inputs)

    @jax.jit
    def ggn(vec):
        jac = jax.jacobian(logits_of)(vec)
        probs = jax.nn.softmax(logits_of(vec))
        hess = jax.vmap(jnp.diag)(probs) - probs[:, :, None] * probs[:, None, :]
        return jnp.einsum("bcp,bcd,bdq->pq", jac, hess, jac) / inputs.shape[0]

    return ggn(_flat(model))


@pytest.mark.parametrize("name", ["curvature_mlp", "curvature_cnn", "optimizer_mlp"])
def test_twin_parameters_are_the_fixture_parameters_permuted(name):
    fx = load(name)
    twin = cnn_twin(fx) if name.endswith("cnn") else mlp_twin(fx)
    kfac_vec = np.concatenate([fx[f"param_{i}"].reshape(-1) for i in range(len(fx["param_names"]))])
    np.testing.assert_array_equal(np.asarray(_flat(twin)), to_eqx_layout(fx, kfac_vec))


@pytest.mark.parametrize("name", ["curvature_mlp", "curvature_cnn"])
def test_exact_ggn_equals_brute_force_on_the_twin(name):
    fx = load(name)
    if name.endswith("cnn"):
        twin, inputs = cnn_twin(fx), cnn_inputs(fx)
    else:
        twin, inputs = mlp_twin(fx), jnp.asarray(fx["x"])
    expected = _brute_force_ggn(twin, inputs)
    actual = to_eqx_layout(fx, stored_matrix(fx, "exact_ggn"))
    np.testing.assert_allclose(actual, expected, rtol=1e-10, atol=1e-14)
    # Full blocks are slices of the exact matrix (in kfac layout, where blocks are contiguous).
    exact = stored_matrix(fx, "exact_ggn")
    offsets = fx["block_offsets"]
    for mode in ("ggn_exact", "fisher_exact"):
        for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            np.testing.assert_allclose(fx[f"full_{mode}_block{i}"], exact[lo:hi, lo:hi],
                                       rtol=1e-10, atol=1e-14)


def test_optimizer_first_loss_and_gradients_match_the_twin():
    fx = load("optimizer_mlp")
    twin = mlp_twin(fx)
    x, y = jnp.asarray(fx["x"]), jnp.asarray(fx["y"])
    l2 = float(fx["l2_reg"])

    def loss(model):
        reg = sum(jnp.sum(p**2) for p in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
        return softmax_cross_entropy(jax.vmap(model)(x), y) + 0.5 * l2 * reg

    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(twin)
    stat_keys = list(fx["stat_keys"])
    for setting in ("fixed", "adaptive", "adaptive_dai2", "fixed_lr_adaptive_damping_dai2"):
        np.testing.assert_allclose(fx[f"{setting}/stats"][0, stat_keys.index("loss")], value,
                                   rtol=1e-12)
        np.testing.assert_allclose(to_eqx_layout(fx, fx[f"{setting}/grad"][0]), _flat(grads),
                                   rtol=1e-10, atol=1e-14)
