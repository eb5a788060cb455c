"""Taylor-mode evaluation of MLPs (`taylor_forward`) against nested `jax.grad`/`jax.hessian`, and
the `taylor_dense` registrations it makes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_kfac


@eqx.filter_jit
def _reference(model, x, weights=None):
    """Value, gradient and weighted Laplacian of `model` at the points `x`, by reverse mode."""
    weights = jnp.ones(x.shape[1]) if weights is None else weights

    def hessian_diag(point):
        hess = jax.jacfwd(jax.jacrev(model))(point)  # (*out, dim, dim)
        return jnp.einsum("...ii,i->...", hess, weights)

    gradient = jax.vmap(jax.jacrev(model))(x)  # (batch, *out, dim)
    return jax.vmap(model)(x), jnp.moveaxis(gradient, -1, 1), jax.vmap(hessian_diag)(x)


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("out_size, use_bias", [("scalar", True), (2, True), (2, False)])
def test_mlp_value_gradient_and_laplacian(getkey, out_size, use_bias):
    model = eqx.nn.MLP(
        3, out_size, 5, 2, activation=jax.nn.softplus, final_activation=jnp.tanh,
        use_bias=use_bias, use_final_bias=use_bias, key=getkey(),
    )
    x = jax.random.normal(getkey(), (4, 3))
    out = eqx.filter_jit(eqx_kfac.taylor_forward)(model, eqx_kfac.TaylorInput(x))
    value, gradient, laplacian = _reference(model, x)
    _close(out.value, value)
    _close(out.gradient, gradient)
    _close(out.laplacian, laplacian)


def test_sequential_weighted_laplacian_and_lower_orders(getkey):
    keys = jax.random.split(getkey(), 2)
    model = eqx.nn.Sequential(
        [eqx.nn.Linear(2, 4, key=keys[0]), eqx.nn.Lambda(jnp.tanh), eqx.nn.Lambda(jnp.sin), eqx.nn.Linear(4, "scalar", key=keys[1])]
    )
    x = jax.random.normal(getkey(), (3, 2))
    weights = jnp.array([0.0, 0.25])
    second, first, zeroth = eqx.filter_jit(eqx_kfac.taylor_forward)(
        model,
        [
            eqx_kfac.TaylorInput(x, laplacian_weights=weights),
            eqx_kfac.TaylorInput(x[:2], order=1),
            eqx_kfac.TaylorInput(x, order=0),
        ],
    )
    value, gradient, laplacian = _reference(model, x, weights)
    _close(second.laplacian, laplacian)
    _close(first.gradient, gradient[:2])
    _close(zeroth.value, value)
    assert first.laplacian is None and zeroth.gradient is None


def _poisson_loss(model, batch):
    x_in, f, x_bd, g = batch
    inner, edge = eqx_kfac.taylor_forward(
        model, [eqx_kfac.TaylorInput(x_in), eqx_kfac.TaylorInput(x_bd, order=0)]
    )
    return eqx_kfac.register_residual_loss((-inner.laplacian, f), (edge.value, g))


def test_every_linear_layer_is_one_taylor_dense_layer_over_both_point_sets(getkey):
    model = eqx.nn.MLP(2, "scalar", 4, 2, activation=jnp.tanh, key=getkey())
    batch = (jnp.ones((5, 2)), jnp.ones(5), jnp.zeros((3, 2)), jnp.zeros(3))
    estimator = eqx_kfac.BlockDiagonalCurvature(
        _poisson_loss, (model, batch), layer_tag_to_block_ctor={"taylor_dense": eqx_kfac.TaylorDenseFull}
    )
    assert {r.tag for r in estimator.registrations().values()} == {"taylor_dense"}
    assert len(estimator.registrations()) == 6
    # Value, two derivatives and the Laplacian on the interior; the value on the boundary.
    assert [b.spec.input_shapes for b in estimator.blocks][1] == ((5, 4, 4), (3, 1, 4))


def test_register_residual_loss_is_a_mean_per_term(getkey):
    model = eqx.nn.MLP(2, "scalar", 4, 1, activation=jnp.tanh, key=getkey())
    x_in, x_bd = jax.random.normal(getkey(), (5, 2)), jax.random.normal(getkey(), (3, 2))
    f, g = jnp.arange(5.0), jnp.arange(3.0)
    value, _, laplacian = _reference(model, x_in)
    expected = 0.5 * jnp.mean((-laplacian - f) ** 2) + 0.5 * jnp.mean((jax.vmap(model)(x_bd) - g) ** 2)
    _close(eqx.filter_jit(_poisson_loss)(model, (x_in, f, x_bd, g)), expected)


def test_unsupported_models_and_inputs_raise(getkey):
    x = jnp.ones((2, 3))
    with pytest.raises(TypeError, match=r"layers\[1\] is a LayerNorm"):
        keys = jax.random.split(getkey(), 2)
        model = eqx.nn.Sequential([eqx.nn.Linear(3, 3, key=keys[0]), eqx.nn.LayerNorm(3), eqx.nn.Linear(3, 1, key=keys[1])])
        eqx_kfac.taylor_forward(model, eqx_kfac.TaylorInput(x))
    with pytest.raises(ValueError, match="order must be 0, 1 or 2"):
        eqx_kfac.TaylorInput(x, order=3)
    with pytest.raises(ValueError, match="laplacian_weights must have shape"):
        eqx_kfac.TaylorInput(x, laplacian_weights=jnp.ones(2))
    with pytest.raises(ValueError, match="takes 2 input features"):
        eqx_kfac.taylor_forward(eqx.nn.MLP(2, 1, 3, 1, key=getkey()), eqx_kfac.TaylorInput(x))
    with pytest.raises(ValueError, match=r"bias must have shape \(out,\)"):
        eqx_kfac.register_taylor_dense([jnp.ones((2, 1, 3))], [jnp.ones((2, 1, 4))], jnp.ones((3, 4)), jnp.ones(4))
