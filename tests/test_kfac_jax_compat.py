"""kfac-jax's extension API as its users (FermiNet) write it: `register_dense(..., variant=...)`,
`register_repeated_dense`, the exported tags, `GraphPattern` in kfac-jax's constructor form,
`set_default_tag_to_block_ctor`, and custom patterns and blocks accepted alike by the estimator,
`kfac_jax.Optimizer`, `kfac_preconditioner` and `kfac_optax`."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_kfac
import eqx_kfac.kfac_jax as kfac_jax


class UserDiagonal(eqx_kfac.Diagonal):
    """A block written by a user: squared summed gradients (what `NaiveDiagonal` computes)."""

    spec: eqx_kfac.LayerSpec = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = None

    def _diagonal_statistics(self, data, batch_size):
        return tuple(jnp.sum(jnp.square(g), axis=0) / batch_size for g in data.params_tangent)


def _dense(x, params):
    """kfac-jax's example dense layer (`tag_graph_matcher._dense` with `axes=1`)."""
    w, b = params
    return jnp.tensordot(x, w, axes=1) + b


# FermiNet's `repeated_dense1_with_bias_pattern`, with eqx_kfac's tag and a variant of its own.
PATTERN = eqx_kfac.GraphPattern(
    name="repeated_dense1_with_bias",
    tag_primitive=eqx_kfac.dense_tag,
    compute_func=jax.vmap(_dense, in_axes=[0, [None, None]]),
    parameters_extractor_func=lambda eqns: dict(weight_layout="in_out", has_bias=True, variant="electrons"),
    example_args=[np.zeros([9, 11, 13]), [np.zeros([13, 7]), np.zeros([7])]],
)


def _params(key):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (4, 3)), "b": 0.1 * jnp.ones(3), "head": jax.random.normal(k2, (3, 1))}


def _loss(params, batch):
    x, y = batch  # x: (batch, electrons, 4)
    h = jnp.tanh(jax.vmap(lambda e: jnp.tensordot(e, params["w"], axes=1) + params["b"])(x))
    out = jnp.sum((h @ params["head"])[..., 0], axis=1)
    eqx_kfac.register_squared_error_loss(out[:, None], y[:, None])
    return jnp.mean((out - y) ** 2)


def _batch(key, n=6):
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, (n, 5, 4)), jax.random.normal(k2, (n,))


@eqx.filter_jit
def _curvature_matrix(estimator, func_args, batch_size):
    """The estimator's dense matrix after one update from zero (compiled: quicker than eager)."""
    state = estimator.update_curvature_matrix_estimate(
        estimator.init(jax.random.key(0)), 0.0, 1.0, batch_size, jax.random.key(1), func_args
    )
    return estimator.to_dense_matrix(state)


def _update(transform, params, batch):
    state = transform.init(params)
    grads = jax.grad(_loss)(params, batch)
    return transform.update(grads, state, params, batch=batch, key=jax.random.key(0))[0]


def test_custom_pattern_and_block_in_every_entry_point(getkey):
    """One custom pattern (a variant of the dense tag) and one user block, given the same way to
    the estimator, `kfac_jax.Optimizer` (kfac-jax's keywords: the patterns through
    `auto_register_kwargs`, as FermiNet passes them), `kfac_preconditioner` and `kfac_optax`: each registers the layer
    with them, so each computes what it computes with the built-in `NaiveDiagonal` there."""
    params, batch = _params(getkey()), _batch(getkey())
    patterns = (PATTERN, *eqx_kfac.DEFAULT_GRAPH_PATTERNS)
    naive = {"dense": eqx_kfac.NaiveDiagonal}  # the head, in both
    custom = dict(graph_patterns=patterns, layer_tag_to_block_ctor={"electrons": UserDiagonal, **naive})
    builtin = dict(graph_patterns=patterns, layer_tag_to_block_ctor=naive)
    expected = ("dense", "UserDiagonal", "repeated_dense1_with_bias")
    assert eqx_kfac.BlockDiagonalCurvature(_loss, (params, batch), **custom).registrations()["['w']"][:3] == expected
    optimizer = kfac_jax.Optimizer(
        jax.value_and_grad(_loss), l2_reg=0.0, use_adaptive_learning_rate=True,
        layer_tag_to_block_ctor=custom["layer_tag_to_block_ctor"],
        auto_register_kwargs=dict(graph_patterns=patterns),
    )
    assert optimizer.estimators((params, batch))[0].registrations()["['b']"][:3] == expected
    precondition = lambda options: eqx_kfac.kfac_preconditioner(_loss, (params, batch), damping=1e-2, **options)
    new, reference = _update(precondition(custom), params, batch), _update(precondition(builtin), params, batch)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    # kfac_optax is the same preconditioner in a chain (its update is checked to be finite).
    assert all(np.all(np.isfinite(u)) for u in jax.tree.leaves(_update(eqx_kfac.kfac_optax(_loss, (params, batch), **custom), params, batch)))


def test_register_dense_variants(getkey):
    """`variant` is kfac-jax's keyword: `"repeated_dense"` is the dense layer over repeated
    axes (as `"dense"` is here), another name picks its block from `layer_tag_to_block_ctor`
    or `set_default_tag_to_block_ctor`, and falls back to the dense block."""
    params, batch = _params(getkey()), _batch(getkey())

    def loss(params, batch, variant):
        x, y = batch

        def layer(e):
            pre = e @ params["w"] + params["b"]
            if variant == "repeated_dense":
                return eqx_kfac.register_repeated_dense(pre, e, params["w"], params["b"])
            return eqx_kfac.register_dense(pre, e, params["w"], params["b"], variant=variant)

        out = jnp.sum((jnp.tanh(jax.vmap(layer)(x)) @ params["head"])[..., 0], axis=1)
        eqx_kfac.register_squared_error_loss(out[:, None], y[:, None])
        return jnp.mean((out - y) ** 2)

    def estimator(variant, **kwargs):
        return eqx_kfac.BlockDiagonalCurvature(lambda p, b: loss(p, b, variant), (params, batch), **kwargs)

    def curvature(est):
        return _curvature_matrix(est, (params, batch), 6)

    plain, repeated = estimator("dense"), estimator("repeated_dense")
    (layer,) = [b for b in repeated.blocks if "['w']" in b.spec.param_paths]
    assert layer.spec.get("variant") == "repeated_dense"
    assert repeated.registrations()["['w']"].block == "DenseTwoKroneckerFactored"
    np.testing.assert_allclose(curvature(repeated), curvature(plain), rtol=1e-12)
    assert estimator("qmc").registrations()["['w']"].block == "DenseTwoKroneckerFactored"
    assert estimator("qmc", layer_tag_to_block_ctor={"qmc": UserDiagonal}).registrations()["['w']"].block == "UserDiagonal"
    eqx_kfac.set_default_tag_to_block_ctor("qmc", UserDiagonal)
    try:
        assert estimator("qmc").registrations()["['w']"].block == "UserDiagonal"
        assert estimator("dense").registrations()["['w']"].block == "DenseTwoKroneckerFactored"
    finally:
        eqx_kfac.set_default_tag_to_block_ctor("qmc", eqx_kfac.DenseTwoKroneckerFactored)
    with pytest.raises(ValueError, match="without '_tag'"):
        eqx_kfac.set_default_tag_to_block_ctor("qmc_tag", UserDiagonal)
    with pytest.raises(TypeError, match="variant must be a non-empty string"):
        eqx_kfac.register_dense(jnp.ones((2, 3)), jnp.ones((2, 4)), jnp.ones((4, 3)), variant="")


def test_graph_pattern_constructor_forms():
    """kfac-jax's keywords (`tag_primitive`, `[x, [w, b]]` examples, the parameters reaching
    `compute_func` as a list), and clear errors for what does not carry over (its
    `in_values_preprocessor`, its single `layer_tag`)."""
    assert PATTERN.tag is eqx_kfac.dense_tag and PATTERN.list_params
    assert [tuple(s.shape for s in params) for _, params in PATTERN.example_args] == [((13, 7), (7,))]
    with pytest.raises(TypeError, match="tag_inputs_func instead"):
        eqx_kfac.GraphPattern(
            "p", eqx_kfac.scale_and_shift_tag, PATTERN.compute_func, PATTERN.example_args[0],
            in_values_preprocessor=lambda v, m: v,
        )
    with pytest.raises(TypeError, match="must be an eqx_kfac.LayerTag"):
        eqx_kfac.GraphPattern("p", tag_primitive=object(), compute_func=PATTERN.compute_func, example_args=PATTERN.example_args[0])


def test_default_parameters_of_a_pattern_without_extractor(getkey):
    """Without `parameters_extractor_func`, a dense pattern's layout is read off its
    `dot_general`: `x @ w.T` with a square weight is `"out_in"` (the shapes cannot say)."""
    w = jax.random.normal(getkey(), (4, 4))
    x, y = jax.random.normal(getkey(), (6, 4)), jax.random.normal(getkey(), (6, 4))
    pattern = eqx_kfac.GraphPattern("transposed", eqx_kfac.dense_tag, lambda x, p: x @ p[0].T, (jnp.zeros((7, 5)), (jnp.zeros((3, 5)),)))

    def loss(w, batch):
        x, y = batch
        out = jnp.tanh(x) @ w.T
        eqx_kfac.register_squared_error_loss(out, y)
        return jnp.mean(jnp.sum((out - y) ** 2, -1))

    estimator = eqx_kfac.BlockDiagonalCurvature(
        loss, (w, (x, y)), graph_patterns=(pattern,), default_estimation_mode="ggn_exact", on_unmatched="error"
    )
    (block,) = estimator.blocks
    assert (block.spec.origin, block.spec.get("weight_layout")) == ("transposed", "out_in")
    matrix = _curvature_matrix(estimator, (w, (x, y)), 6)
    # A linear layer with squared error: the K-FAC block of one layer is exact on one example;
    # here it is compared with the exact GGN's Kronecker structure: (A ⊗ I) for out_in rows.
    a = jnp.tanh(x).T @ jnp.tanh(x) / 6
    np.testing.assert_allclose(matrix, 2.0 * jnp.kron(jnp.eye(4), a), rtol=1e-10)


def _nd_params(key):
    k1, k2 = jax.random.split(key)
    return {"b": 0.1 * jax.random.normal(k1, (4, 5)), "w": jax.random.normal(k2, (2, 3, 4, 5))}


def _nd_loss(params, batch, manual):
    x, t = batch  # x: (batch, 2, 3), t: (batch, 20)
    y = jnp.tensordot(x, params["w"], axes=2) + params["b"]
    if manual:
        y = eqx_kfac.register_dense(y, x, params["w"], params["b"], variant="dense")
    out = jnp.tanh(y).reshape(x.shape[0], -1)
    eqx_kfac.register_squared_error_loss(out, t)
    return jnp.mean(jnp.sum((out - t) ** 2, -1))


@pytest.mark.parametrize("manual", [True, False], ids=["register_dense", "pattern"])
def test_nd_dense_weights_are_exact_where_kfac_is(getkey, manual):
    """A weight `(*in, *out)` (`jnp.tensordot(x, w, 2)`, Flax's `DenseGeneral`): registered by
    hand or matched, its blocks act on its `(in, out)` reshape. The full block (registered by
    hand) and the diagonal block (matched) are the exact GGN's block and diagonal, the Kronecker
    block is exact on one example."""
    params = _nd_params(getkey())

    def exact_ggn(batch):
        flat, unravel = jax.flatten_util.ravel_pytree(params)
        out = lambda p: jnp.tanh(jnp.tensordot(batch[0], unravel(p)["w"], axes=2) + unravel(p)["b"]).reshape(-1)
        jac = jax.jit(jax.jacobian(out))(flat)
        return 2.0 * jac.T @ jac / batch[0].shape[0]  # squared error: the loss's GGN is 2 I

    def curvature(batch, block=None):
        estimator = eqx_kfac.BlockDiagonalCurvature(
            lambda p, b: _nd_loss(p, b, manual), (params, batch), default_estimation_mode="ggn_exact",
            on_unmatched="error", layer_tag_to_block_ctor=None if block is None else {"dense": block},
        )
        (layer,) = estimator.blocks
        assert (layer.spec.param_shapes, layer.spec.origin) == (
            ((2, 3, 4, 5), (4, 5)), "manual" if manual else "dense_general_2x2_with_bias"
        )
        return np.asarray(_curvature_matrix(estimator, (params, batch), batch[0].shape[0]))

    batch = (jax.random.normal(getkey(), (3, 2, 3)), jax.random.normal(getkey(), (3, 20)))
    if manual:
        np.testing.assert_allclose(curvature(batch, eqx_kfac.DenseFull), exact_ggn(batch), rtol=1e-9, atol=1e-12)
    else:
        np.testing.assert_allclose(np.diag(curvature(batch, eqx_kfac.DenseDiagonal)), np.diag(exact_ggn(batch)), rtol=1e-9)
    one = (batch[0][:1], batch[1][:1])
    np.testing.assert_allclose(curvature(one), exact_ggn(one), rtol=1e-9, atol=1e-12)
