"""Curvature-block statistics against explicit formulas and brute-force per-example gradients."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from block_helpers import dense_spec, generic_spec, random_data, scale_shift_spec
from eqx_kfac import (
    DenseDiagonal,
    DenseFull,
    DenseTwoKroneckerFactored,
    NaiveDiagonal,
    NaiveFull,
    ScaleAndShiftDiagonal,
    ScaleAndShiftFull,
)
from eqx_kfac import BlockDiagonalCurvature
from eqx_kfac import LayerSpec
from eqx_kfac import register_softmax_cross_entropy_loss
from models import Problem, block_slices, brute_force_ggn

seeds = st.integers(0, 2**31 - 1)
LAYERS = [
    dict(layout="in_out", bias=True, extra=()),
    dict(layout="out_in", bias=True, extra=()),
    dict(layout="out_in", bias=False, extra=(2,)),
    dict(layout="in_out", bias=False, extra=(2, 2)),
]
LAYER_IDS = ["in_out-bias", "out_in-bias", "out_in-seq", "in_out-2d"]
BATCH = 3


@eqx.filter_jit
def _estimate(block, data, batch_size):
    # A small ema_new: the bias-corrected average must still return the batch statistics exactly.
    return block.update_curvature_matrix_estimate(block.init(None), data, 0.3, 0.05, batch_size)


def estimate(block, seed, num_vectors=2):
    data = random_data(block.spec, jax.random.key(seed), num_vectors)
    return _estimate(block, data, BATCH), data


def dense_layer(layout, bias):
    def apply(params, x):
        w = params[0] if layout == "in_out" else params[0].T
        y = x @ w
        return y + params[1] if bias else y

    return apply


def brute_force_per_example_gradients(spec, apply, data, params):
    """g_vb = ∇_θ Σ_t <dy_vbt, y_bt(θ)>, one flat row per (vector, example), via jax.grad."""
    (x,) = data.inputs
    (dy,) = data.outputs_tangent
    rows = []
    for v in range(dy.shape[0]):
        for b in range(x.shape[0]):
            grad = jax.grad(lambda p: jnp.sum(apply(p, x[b]) * dy[v, b]))(params)
            rows.append(np.concatenate([np.ravel(g) for g in grad]))
    return np.stack(rows)


def zero_params(spec):
    return tuple(jnp.zeros(s) for s in spec.param_shapes)


@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
@settings(max_examples=5)
@given(seed=seeds)
def test_dense_kronecker_factors_are_the_explicit_formulas(layer, seed):
    spec = dense_spec(3, 2, batch=BATCH, **layer)
    block = DenseTwoKroneckerFactored(spec)
    state, data = estimate(block, seed)
    x = np.asarray(data.inputs[0]).reshape(-1, 3)
    positions = x.shape[0] // BATCH
    if layer["bias"]:
        x = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
    dy = np.asarray(data.outputs_tangent[0]).reshape(-1, 2)
    a, g = (np.asarray(f.value) for f in state.factors)
    np.testing.assert_allclose(a, x.T @ x / (BATCH * positions), rtol=1e-12)
    np.testing.assert_allclose(g, dy.T @ dy / BATCH, rtol=1e-12)
    # The dense matrix is A ⊗ G on the weight in (in, out) orientation with the bias as a last
    # row; check it entry by entry against the parameters' row-major flattening.
    dense = np.asarray(block.to_dense_matrix(state))
    w_shape = spec.param_shapes[0]

    def canonical(k):  # (row of A, row of G) of flat parameter index k
        if k >= 6:
            return 3, k - 6
        i, j = np.unravel_index(k, w_shape)
        return (i, j) if layer["layout"] == "in_out" else (j, i)

    for k in range(block.dim):
        for m in range(block.dim):
            (ia, ig), (ja, jg) = canonical(k), canonical(m)
            np.testing.assert_allclose(dense[k, m], a[ia, ja] * g[ig, jg], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
@settings(max_examples=4)
@given(seed=seeds)
def test_dense_full_and_diagonal_are_per_example_second_moments(layer, seed):
    spec = dense_spec(3, 2, batch=BATCH, **layer)
    full = DenseFull(spec)
    state, data = estimate(full, seed)
    grads = brute_force_per_example_gradients(
        spec, dense_layer(layer["layout"], layer["bias"]), data, zero_params(spec)
    )
    expected = grads.T @ grads / BATCH
    np.testing.assert_allclose(full.to_dense_matrix(state), expected, rtol=1e-10, atol=1e-12)
    diagonal = DenseDiagonal(spec)
    diag_state, _ = estimate(diagonal, seed)
    np.testing.assert_allclose(
        diagonal.to_dense_matrix(diag_state), np.diag(np.diag(expected)), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
@settings(max_examples=5)
@given(seed=seeds)
def test_kronecker_is_exact_for_one_example(layout, seed):
    # With one example, one vector and no positions the per-example gradient is x̃ ⊗ dy, so its
    # second moment is exactly A ⊗ G: the Kronecker block must equal the full block.
    spec = dense_spec(3, 2, batch=1, layout=layout)
    data = random_data(spec, jax.random.key(seed), num_vectors=1)
    kron, full = DenseTwoKroneckerFactored(spec), DenseFull(spec)
    kron_state = _estimate(kron, data, 1)
    full_state = _estimate(full, data, 1)
    np.testing.assert_allclose(
        kron.to_dense_matrix(kron_state), full.to_dense_matrix(full_state), rtol=1e-10,
        atol=1e-12,
    )


@pytest.mark.parametrize(
    "x_shape, param_shape, scale, shift",
    [((BATCH, 4), (4,), True, True), ((BATCH, 2, 3), (1, 3), True, False),
     ((BATCH, 2, 3), (2, 3), False, True)],
    ids=["vector", "broadcast-scale", "shift-only"],
)
@settings(max_examples=4)
@given(seed=seeds)
def test_scale_and_shift_are_per_example_second_moments(x_shape, param_shape, scale, shift, seed):
    spec = scale_shift_spec(x_shape, param_shape, scale=scale, shift=shift)
    full = ScaleAndShiftFull(spec)
    state, data = estimate(full, seed)

    def apply(params, x):
        params = list(params)
        y = x * params.pop(0) if scale else x
        return y + params.pop(0) if shift else y

    grads = brute_force_per_example_gradients(spec, apply, data, zero_params(spec))
    expected = grads.T @ grads / BATCH
    np.testing.assert_allclose(full.to_dense_matrix(state), expected, rtol=1e-10, atol=1e-12)
    diagonal = ScaleAndShiftDiagonal(spec)
    diag_state, _ = estimate(diagonal, seed)
    np.testing.assert_allclose(
        diagonal.to_dense_matrix(diag_state), np.diag(np.diag(expected)), rtol=1e-10, atol=1e-12
    )


# Parameters along axes other than the trailing ones (`param_axes`, counted from the end of x),
# each with a reference layer written by hand with explicit indexing.
AXES_LAYERS = {
    "group_norm": (
        (BATCH, 4, 2, 3), (4,), (-3,), True, True,
        lambda p, x: x * p[0][:, None, None] + p[1][:, None, None],
    ),
    "middle-axis-scale": ((BATCH, 2, 3, 4), (3,), (-2,), True, False, lambda p, x: x * p[0][None, :, None]),
    "broadcast-shift": ((BATCH, 2, 3, 4), (2, 1), (-3, -2), False, True, lambda p, x: x + p[0][:, :, None]),
    "first-and-last": (
        (BATCH, 2, 3, 4), (2, 4), (-3, -1), True, True,
        lambda p, x: x * p[0][:, None, :] + p[1][:, None, :],
    ),
}


def axes_spec(x_shape, param_shape, param_axes, scale, shift):
    shapes = (param_shape,) * (scale + shift)
    return LayerSpec(
        tag="scale_and_shift",
        index=1,
        param_paths=("scale", "shift")[: len(shapes)] if scale else ("shift",),
        param_indices=tuple(range(len(shapes))),
        param_shapes=shapes,
        param_dtypes=(jnp.float64,) * len(shapes),
        input_shapes=(x_shape,),
        output_shapes=(x_shape,),
        meta=(("has_scale", scale), ("has_shift", shift), ("param_axes", param_axes)),
    )


@pytest.mark.parametrize("name", list(AXES_LAYERS))
@settings(max_examples=3)
@given(seed=seeds)
def test_scale_and_shift_along_other_axes_are_per_example_second_moments(name, seed):
    x_shape, param_shape, param_axes, scale, shift, apply = AXES_LAYERS[name]
    spec = axes_spec(x_shape, param_shape, param_axes, scale, shift)
    full = ScaleAndShiftFull(spec)
    state, data = estimate(full, seed)
    (x,) = data.inputs
    (dy,) = data.outputs_tangent
    params = tuple(jnp.linspace(0.5, 1.5, int(np.prod(s))).reshape(s) for s in spec.param_shapes)

    def per_example(dy_vb, x_b):
        grads = jax.grad(lambda p: jnp.sum(apply(p, x_b) * dy_vb))(params)
        return jnp.concatenate([jnp.ravel(g) for g in grads])

    grads = jax.jit(jax.vmap(jax.vmap(per_example), (0, None)))(dy, x).reshape(-1, full.dim)
    expected = np.asarray(grads.T @ grads) / BATCH
    np.testing.assert_allclose(full.to_dense_matrix(state), expected, rtol=1e-10, atol=1e-12)
    diagonal = ScaleAndShiftDiagonal(spec)
    diag_state, _ = estimate(diagonal, seed)
    np.testing.assert_allclose(
        diagonal.to_dense_matrix(diag_state), np.diag(np.diag(expected)), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize(
    "param_shape, param_axes",
    [((BATCH,), (-4,)), ((2, 3), (-2, -3)), ((2, 3), (-3,))],
    ids=["batch-axis", "decreasing", "rank"],
)
def test_scale_and_shift_blocks_check_param_axes(param_shape, param_axes):
    spec = axes_spec((BATCH, 2, 3, 4), param_shape, param_axes, True, False)
    for block in (ScaleAndShiftFull, ScaleAndShiftDiagonal):
        with pytest.raises(ValueError, match=rf"{block.__name__} cannot handle the scale_and_shift layer #1.*param_axes"):
            block(spec)


@settings(max_examples=5)
@given(seed=seeds)
def test_naive_blocks_use_parameter_gradients(seed):
    spec = generic_spec((2, 2), (3,))
    full, diagonal = NaiveFull(spec), NaiveDiagonal(spec)
    state, data = estimate(full, seed, num_vectors=3)
    g = np.concatenate([np.asarray(t).reshape(3, -1) for t in data.params_tangent], axis=1)
    np.testing.assert_allclose(full.to_dense_matrix(state), g.T @ g / BATCH, rtol=1e-12)
    diag_state, _ = estimate(diagonal, seed, num_vectors=3)
    np.testing.assert_allclose(
        np.diag(diagonal.to_dense_matrix(diag_state)), np.sum(g * g, axis=0) / BATCH, rtol=1e-12
    )


class _GroupNormNet(eqx.Module):
    norm: eqx.nn.GroupNorm
    lin: eqx.nn.Linear

    def __call__(self, x):
        return self.lin(jnp.tanh(self.norm(x)).reshape(-1))


def _summed_cross_entropy(logits, labels):
    return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1))


def test_group_norm_model_blocks_are_slices_of_the_exact_ggn(getkey):
    # End to end: GroupNorm's affine part is found automatically, traced, and its full block is
    # the (exact-mode) GGN restricted to its parameters.
    norm = eqx.tree_at(
        lambda n: (n.weight, n.bias), eqx.nn.GroupNorm(2, 4), (jnp.linspace(0.5, 2.0, 4), jnp.linspace(-1.0, 1.0, 4))
    )
    model = _GroupNormNet(norm, eqx.nn.Linear(4 * 2 * 3, 3, key=getkey()))
    x = jax.random.normal(getkey(), (BATCH, 4, 2, 3))
    labels = jax.random.randint(getkey(), (BATCH,), 0, 3)

    def outputs_fn(params, x):
        return (jax.vmap(params)(x),)

    def loss_fn(params, data):
        x, labels = data
        (logits,) = outputs_fn(params, x)
        register_softmax_cross_entropy_loss(logits, labels)
        return _summed_cross_entropy(logits, labels) / x.shape[0]

    problem = Problem(model, (x, labels), loss_fn, outputs_fn, lambda z, d: _summed_cross_entropy(z[0], d[1]))
    estimator = BlockDiagonalCurvature(
        loss_fn, problem.func_args, layer_tag_to_block_ctor={"scale_and_shift": ScaleAndShiftFull, "dense": DenseFull}
    )
    state = estimator.init(getkey())
    state = eqx.filter_jit(estimator.update_curvature_matrix_estimate)(
        state, 0.0, 1.0, BATCH, getkey(), problem.func_args, "ggn_exact"
    )
    norm_block = next(b for b in estimator.blocks if b.spec.param_paths == ("norm.weight", "norm.bias"))
    assert isinstance(norm_block, ScaleAndShiftFull) and norm_block.spec.get("param_axes") == (-3,)
    exact = brute_force_ggn(problem)
    estimate_matrix = np.asarray(estimator.to_dense_matrix(state))
    for idx in block_slices(estimator):
        np.testing.assert_allclose(
            estimate_matrix[np.ix_(idx, idx)], exact[np.ix_(idx, idx)], rtol=1e-10, atol=1e-12
        )
