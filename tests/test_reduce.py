"""K-FAC-expand and K-FAC-reduce against the exact GGN where Eschenhagen et al. (2023) prove them exact."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from block_helpers import dense_spec, random_data
from eqx_kfac import DenseTwoKroneckerFactored
from eqx_kfac import DenseTwoKroneckerFactoredReduce
from eqx_kfac import BlockDiagonalCurvature
from eqx_kfac import register_squared_error_loss
from eqx_kfac import register_dense


class SharedLinearNet(eqx.Module):
    """A deep linear network applied to every position of a sequence (weights shared over it)."""

    layers: tuple[eqx.nn.Linear, ...]

    def __call__(self, x):  # x: (positions, features)
        for layer in self.layers:
            y = x @ layer.weight.T + layer.bias
            x = register_dense(y, x, layer.weight, layer.bias, weight_layout="out_in")
        return x


def _deep_linear_problem(key, setting, sizes=(3, 4, 2), positions=3, batch=4):
    """Squared error per position ("expand") or on the mean over positions ("reduce")."""
    keys = jax.random.split(key, len(sizes) + 1)
    model = SharedLinearNet(
        tuple(eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys))
    )
    x = jax.random.normal(keys[-2], (batch, positions, sizes[0]))
    target_shape = (batch, positions, sizes[-1]) if setting == "expand" else (batch, sizes[-1])
    t = jax.random.normal(keys[-1], target_shape)

    def outputs_fn(params, x):
        out = jax.vmap(params)(x)
        return (out if setting == "expand" else jnp.mean(out, axis=1),)

    def summed(z, data):
        return jnp.sum((data[1] - z[0]) ** 2)

    def loss_fn(params, data):
        (pred,) = outputs_fn(params, data[0])
        register_squared_error_loss(pred, data[1])
        return summed((pred,), data) / data[0].shape[0]

    return models.Problem(model, (x, t), loss_fn, outputs_fn, summed)


def _kfac_and_exact(problem, ctor):
    estimator = BlockDiagonalCurvature(
        problem.loss_fn, problem.func_args, auto_register_tags=False,
        layer_tag_to_block_ctor={"dense": ctor},
    )

    @eqx.filter_jit
    def dense(key):
        state = estimator.update_curvature_matrix_estimate(
            estimator.init(None), 0.0, 1.0, problem.batch_size, key, problem.func_args, "ggn_exact"
        )
        return estimator.to_dense_matrix(state)

    return np.asarray(dense(jax.random.key(0))), models.brute_force_ggn(problem), models.block_slices(estimator)


@pytest.mark.parametrize(
    "setting, exact_ctor, other_ctor",
    [
        ("expand", DenseTwoKroneckerFactored, DenseTwoKroneckerFactoredReduce),
        ("reduce", DenseTwoKroneckerFactoredReduce, DenseTwoKroneckerFactored),
    ],
)
def test_each_approximation_is_exact_in_its_setting(setting, exact_ctor, other_ctor, getkey):
    problem = _deep_linear_problem(getkey(), setting)
    kfac, exact, slices = _kfac_and_exact(problem, exact_ctor)
    assert len(slices) == 2
    for idx in slices:
        block = exact[np.ix_(idx, idx)]
        np.testing.assert_allclose(kfac[np.ix_(idx, idx)], block, rtol=1e-8, atol=1e-10 * np.abs(block).max())
    # The other approximation is not exact here (so the test can tell them apart).
    other, _, _ = _kfac_and_exact(problem, other_ctor)
    idx = slices[0]
    assert not np.allclose(other[np.ix_(idx, idx)], exact[np.ix_(idx, idx)], rtol=1e-3)


def test_reduce_factors_are_the_explicit_formulas(getkey):
    spec = dense_spec(3, 2, bias=True, layout="out_in", batch=4, extra=(2, 3))
    data = random_data(spec, getkey())
    block = DenseTwoKroneckerFactoredReduce(spec)
    state = block.update_curvature_matrix_estimate(block.init(None), data, 0.0, 1.0, 4)
    x = np.asarray(data.inputs[0]).reshape(4, 6, 3).mean(1)
    x = np.concatenate([x, np.ones((4, 1))], 1)
    dy = np.asarray(data.outputs_tangent[0]).reshape(2, 4, 6, 2).sum(2).reshape(8, 2)
    np.testing.assert_allclose(state.factors[0].value, x.T @ x / 4, rtol=1e-12)
    np.testing.assert_allclose(state.factors[1].value, dy.T @ dy / 4, rtol=1e-12)
    # Without shared dims, reduce and expand are the same block.
    plain = dense_spec(3, 2, batch=4)
    plain_data = random_data(plain, getkey())
    reduce_state = DenseTwoKroneckerFactoredReduce(plain).update_curvature_matrix_estimate(
        DenseTwoKroneckerFactoredReduce(plain).init(None), plain_data, 0.0, 1.0, 4)
    expand = DenseTwoKroneckerFactored(plain)
    expand_state = expand.update_curvature_matrix_estimate(expand.init(None), plain_data, 0.0, 1.0, 4)
    np.testing.assert_allclose(
        DenseTwoKroneckerFactoredReduce(plain).to_dense_matrix(reduce_state),
        expand.to_dense_matrix(expand_state), rtol=1e-12,
    )
