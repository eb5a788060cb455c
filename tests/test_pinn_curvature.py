"""The curvature of physics-informed losses: the `taylor_dense` blocks and `DenseGaussNewton`
against the exact Gauss-Newton matrix, built independently from `jax.jacobian` of residuals
written with nested `jax.grad`/`jax.hessian`."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import eqx_kfac


def _derivatives(model, point):
    """`(u, ∇u, Δu)` of `model` at one point, by reverse mode (u flattened to a vector)."""
    value = jnp.atleast_1d(model(point))
    gradient = jnp.reshape(jax.jacrev(model)(point), (value.shape[0], -1))
    hessian = jnp.reshape(jax.jacfwd(jax.jacrev(model))(point), (value.shape[0], point.shape[0], -1))
    return value, gradient, jnp.trace(hessian, axis1=1, axis2=2)


def _exact_gauss_newton(model, terms):
    """`Σ_k 1/N_k Σ_n J_knᵀ J_kn` for residuals `residual_k(model, point)` on points `x_k`."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, unravel = ravel_pytree(params)

    @jax.jit  # every term in one program
    def gauss_newton(flat):
        total = 0.0
        for residual, x in terms:
            def residuals(theta, residual=residual, x=x):
                model = eqx.combine(unravel(theta), static)
                return jnp.reshape(jax.vmap(lambda p: residual(model, p))(x), (-1,))

            jac = jax.jacobian(residuals)(flat)
            total = total + jac.T @ jac / x.shape[0]
        return total

    return np.asarray(gauss_newton(flat))


def _residual_terms(setting):
    """The residuals (and the loss that registers them through Taylor mode) of a setting.

    `"expand"`: every channel of the interior points is its own residual (value, gradient and
    Laplacian); `"reduce"`: their sum is one residual. The boundary term is the value.
    """

    def interior(model, point):
        value, gradient, laplacian = _derivatives(model, point)
        channels = jnp.concatenate([value, gradient.reshape(-1), laplacian])
        return channels if setting == "expand" else jnp.atleast_1d(value.sum() + gradient.sum() + laplacian.sum())

    def boundary(model, point):
        return _derivatives(model, point)[0]

    def loss(model, batch):
        x_in, x_bd = batch
        inner, edge = eqx_kfac.taylor_forward(
            model, [eqx_kfac.TaylorInput(x_in), eqx_kfac.TaylorInput(x_bd, order=0)]
        )
        value = jnp.reshape(inner.value, (x_in.shape[0], -1))
        gradient = jnp.reshape(inner.gradient, (x_in.shape[0], -1))
        laplacian = jnp.reshape(inner.laplacian, (x_in.shape[0], -1))
        if setting == "expand":
            prediction = jnp.concatenate([value, gradient, laplacian], axis=1)
        else:
            prediction = value.sum(1) + gradient.sum(1) + laplacian.sum(1)
        return eqx_kfac.register_residual_loss((prediction, None), (inner_boundary(edge), None))

    def inner_boundary(edge):
        return edge.value

    return interior, boundary, loss


def _estimate(loss, args, block):
    estimator = eqx_kfac.BlockDiagonalCurvature(
        loss, args, layer_tag_to_block_ctor={"taylor_dense": block}, default_estimation_mode="ggn_exact"
    )

    # The initial state made inside the update's program (made eagerly, each of its arrays was a
    # compilation of its own).
    @eqx.filter_jit
    def update(args):
        return estimator.update_curvature_matrix_estimate(
            estimator.init(), 0.0, 1.0, args[1][0].shape[0], jax.random.key(0), args
        )

    return estimator, update(args)


def _block_diagonal(matrix, estimator):
    """`matrix` with the entries between parameters of different blocks set to zero."""
    sizes = [int(np.prod(s)) for s in estimator.param_shapes]
    owner = np.repeat([next(k for k, b in enumerate(estimator.blocks) if i in b.spec.param_indices) for i in range(len(sizes))], sizes)
    return np.where(owner[:, None] == owner[None, :], matrix, 0.0)


@pytest.mark.parametrize("setting", ["expand", "reduce"])
def test_kfac_is_exact_for_a_deep_linear_network_at_one_point_per_set(getkey, setting):
    """Eschenhagen et al. (2023): with a deep linear network, K-FAC-expand is exact when every
    channel has its own residual and K-FAC-reduce when the channels are summed into one; one point
    per point set, one Kronecker product per point set."""
    model = eqx.nn.MLP(3, 2, 4, 2, activation=lambda t: t, key=getkey())
    x_in, x_bd = jax.random.normal(getkey(), (1, 3)), jax.random.normal(getkey(), (1, 3))
    interior, boundary, loss = _residual_terms(setting)
    exact = _exact_gauss_newton(model, [(interior, x_in), (boundary, x_bd)])
    block = functools.partial(eqx_kfac.TaylorDenseKroneckerSum, approximation=setting)
    estimator, state = _estimate(loss, (model, (x_in, x_bd)), block)
    dense = eqx.filter_jit(estimator.to_dense_matrix)(state)
    np.testing.assert_allclose(dense, _block_diagonal(exact, estimator), rtol=1e-8, atol=1e-10)


def test_full_blocks_and_the_dense_gauss_newton_are_exact_for_a_tanh_network(getkey):
    model = eqx.nn.MLP(2, "scalar", 5, 2, activation=jnp.tanh, key=getkey())
    x_in, x_bd = jax.random.uniform(getkey(), (6, 2)), jax.random.uniform(getkey(), (4, 2))
    f, g = jnp.sin(x_in[:, 0]), jnp.cos(x_bd[:, 1])

    def loss(model, batch):
        x_in, f, x_bd, g = batch
        inner, edge = eqx_kfac.taylor_forward(model, [eqx_kfac.TaylorInput(x_in), eqx_kfac.TaylorInput(x_bd, order=0)])
        return eqx_kfac.register_residual_loss((-inner.laplacian, f), (edge.value, g))

    def interior(model, point):
        return -_derivatives(model, point)[2]

    exact = _exact_gauss_newton(model, [(interior, x_in), (lambda m, p: _derivatives(m, p)[0], x_bd)])
    args = (model, (x_in, f, x_bd, g))
    estimator, state = _estimate(loss, args, eqx_kfac.TaylorDenseFull)
    blocks = eqx.filter_jit(estimator.to_dense_matrix)(state)
    np.testing.assert_allclose(blocks, _block_diagonal(exact, estimator), rtol=1e-8, atol=1e-12)
    dense = eqx_kfac.DenseGaussNewton(loss, args)

    @eqx.filter_jit
    def gramian(args):
        state = dense.update_curvature_matrix_estimate(dense.init(), 0.0, 1.0, 6, jax.random.key(0), args)
        return dense.to_dense_matrix(state)

    np.testing.assert_allclose(gramian(args), exact, rtol=1e-8, atol=1e-12)


@pytest.fixture(scope="module")
def random_sum_block():
    """A `TaylorDenseKroneckerSum` block with random statistics of two point sets, its state and a
    random vector (built once: both tests of the block take it as it is)."""
    keys = iter(jax.random.split(jax.random.key(0), 4))
    model = eqx.nn.MLP(2, "scalar", 3, 1, activation=jnp.tanh, key=next(keys))
    batch = (jax.random.normal(next(keys), (5, 2)), jax.random.normal(next(keys), (2, 2)))
    _, _, loss = _residual_terms("reduce")
    estimator, state = _estimate(loss, (model, batch), eqx_kfac.TaylorDenseKroneckerSum)
    block, block_state = estimator.blocks[0], state.block_states[0]
    shapes = block.param_shapes
    vector = tuple(jax.random.normal(k, s) for k, s in zip(jax.random.split(next(keys), len(shapes)), shapes))
    return block, block_state, vector


def test_kronecker_sum_inverts_its_damped_sum_exactly(random_sum_block):
    damping = 1e-3
    block, state, vector = random_sum_block
    flat = ravel_pytree(vector)[0]

    @jax.jit
    def products(state, vector):
        # The approximate inverse is the exact inverse of the approximate product (the sum of the
        # damped Kronecker products), cached or not.
        product = block.multiply(state, vector, damping, exact_power=False)
        inverse = block.multiply_inverse(state, product, damping, exact_power=False)
        initial = eqx.tree_at(lambda s: s.factors, block.init(approx_powers_to_cache=-1), state.factors)
        cached_state = block.update_cache(initial, damping, approx_powers=-1)
        cached = block.multiply_inverse(cached_state, product, damping, exact_power=False, use_cached=True)
        # Before its first refresh the cache holds a zero inverse (finite, like other blocks').
        unrefreshed = block.multiply_inverse(initial, product, damping, exact_power=False, use_cached=True)
        exact = block.multiply(state, vector, damping, exact_power=True)
        return inverse, cached, unrefreshed, exact, block.to_dense_matrix(state), initial, cached_state

    inverse, cached, unrefreshed, exact, dense, initial, refreshed = products(state, vector)
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
    assert shapes(initial.cache) == shapes(refreshed.cache)
    np.testing.assert_array_equal(ravel_pytree(unrefreshed)[0], np.zeros_like(flat))
    np.testing.assert_allclose(ravel_pytree(inverse)[0], flat, rtol=1e-9)
    np.testing.assert_allclose(ravel_pytree(cached)[0], flat, rtol=1e-9)
    np.testing.assert_allclose(ravel_pytree(exact)[0], dense @ flat + damping * flat, rtol=1e-10)


def test_kronecker_sum_refuses_what_it_cannot_do(random_sum_block):
    block, state, vector = random_sum_block
    with pytest.raises(ValueError, match="has no exact power -1"):
        block.multiply_inverse(state, vector, 1e-3, exact_power=True)
    spec = dataclasses.replace(
        block.spec, input_shapes=block.spec.input_shapes * 2, output_shapes=block.spec.output_shapes * 2
    )
    with pytest.raises(ValueError, match="more than two Kronecker"):
        eqx_kfac.TaylorDenseKroneckerSum(spec)


def test_dense_gauss_newton_needs_every_parameter_in_taylor_layers(getkey):
    model = eqx.nn.MLP(2, "scalar", 3, 1, activation=jnp.tanh, key=getkey())
    scale = jnp.ones(())

    def loss(params, x):
        model, scale = params
        out = eqx_kfac.taylor_forward(model, eqx_kfac.TaylorInput(x))
        return eqx_kfac.register_residual_loss((scale * out.laplacian, None))

    with pytest.raises(ValueError, match=r"\['\[1\]'\] are not"):
        eqx_kfac.DenseGaussNewton(loss, ((model, scale), jnp.ones((3, 2))))
