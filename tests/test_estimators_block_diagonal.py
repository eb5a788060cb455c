"""BlockDiagonalCurvature: exact-mode blocks against exact matrices, structure, inspection, errors."""

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import equinox as eqx
from eqx_kfac import (
    DenseDiagonal,
    DenseFull,
    DenseTwoKroneckerFactored,
    NaiveFull,
    ScaleAndShiftFull,
)
from eqx_kfac import BlockDiagonalCurvature, ExplicitExactCurvature
from eqx_kfac import register_softmax_cross_entropy_loss, register_squared_error_loss
from eqx_kfac import register_generic
from eqx_kfac import eigenvalues as operator_eigenvalues, trace as operator_trace

from models import (
    block_slices,
    brute_force_ggn,
    brute_force_hessian,
    dense_from_products,
    flat_params,
    mlp_classification,
    mlp_ggn_only,
    mlp_regression,
    scan_classification,
    sequence_classification,
    two_losses,
)

FULL = {"dense": DenseFull, "generic": NaiveFull}


@eqx.filter_jit
def _update(estimator, state, key, func_args, batch_size, mode):
    """One curvature update, and the dense matrix of the updated estimate (one program)."""
    state = estimator.update_curvature_matrix_estimate(
        state, 0.0, 1.0, batch_size, key, func_args, mode
    )
    return state, estimator.to_dense_matrix(state)


_to_dense = eqx.filter_jit(lambda estimator, state: estimator.to_dense_matrix(state))


def _estimate(problem, mode, key, init_kwargs=None, **kwargs):
    """The estimator, its state after one update on the problem's batch, and its dense matrix."""
    estimator = BlockDiagonalCurvature(problem.loss_fn, problem.func_args, **kwargs)
    state = estimator.init(key, **(init_kwargs or {}))
    state, dense = _update(estimator, state, key, problem.func_args, problem.batch_size, mode)
    return estimator, state, np.asarray(dense)


def _block_diagonal_part(matrix, estimator):
    out = np.zeros_like(matrix)
    for idx in block_slices(estimator):
        out[np.ix_(idx, idx)] = matrix[np.ix_(idx, idx)]
    return out


def _bias_free_mlp(key):
    # Between bias-free per-example layers `vmap` keeps the activations feature-major.
    return mlp_classification(key, sizes=(3, 4, 5, 3), use_bias=False)


# The two exact modes differ only in the loss-space vectors (the losses' Fisher or GGN factors,
# tested in test_losses.py); what the blocks make of them is the same code. `fisher_exact` is
# checked against the exact matrix on the problem with both losses (softmax cross-entropy and
# squared error, each with its own vectors); the other tests use `ggn_exact` only.
@pytest.mark.parametrize(
    "make, mode",
    [
        (mlp_classification, "ggn_exact"),
        (two_losses, "ggn_exact"),
        (two_losses, "fisher_exact"),
        (_bias_free_mlp, "ggn_exact"),
    ],
)
def test_full_blocks_are_slices_of_exact_matrix(make, mode, getkey):
    problem = make(getkey())
    estimator, _, dense = _estimate(problem, mode, getkey(), layer_tag_to_block_ctor=FULL)
    assert {type(b) for b in estimator.blocks} == {DenseFull}
    exact = brute_force_ggn(problem)  # Fisher == GGN for these losses
    np.testing.assert_allclose(
        dense, _block_diagonal_part(exact, estimator), rtol=1e-10, atol=1e-12
    )


def test_exact_modes_are_exact_with_interacting_sequence_positions(getkey):
    # Positions of one example are mixed by the network, so the exact modes need one-hot vectors
    # per (position, class), replicated over the batch axis only.
    problem = sequence_classification(getkey())
    estimator, _, dense = _estimate(
        problem, "ggn_exact", getkey(), layer_tag_to_block_ctor=FULL, auto_register_tags=False
    )
    assert [b.spec.input_shapes for b in estimator.blocks] == [((4, 3, 2),), ((4, 3, 3),)]
    exact = brute_force_ggn(problem)
    np.testing.assert_allclose(
        dense, _block_diagonal_part(exact, estimator), rtol=1e-10, atol=1e-12
    )


def test_diagonal_blocks_are_diagonal_of_full(getkey):
    problem = mlp_classification(getkey())
    key, mode = getkey(), "ggn_exact"
    _, _, full = _estimate(problem, mode, key, layer_tag_to_block_ctor=FULL)
    _, _, diag = _estimate(problem, mode, key, layer_tag_to_block_ctor={"dense": DenseDiagonal})
    np.testing.assert_allclose(diag, np.diag(np.diag(full)), rtol=1e-10, atol=1e-14)


def test_kfac_is_exact_for_deep_linear_network(getkey):
    # Output tangents of a linear network with squared error do not depend on the input, so
    # E[a aᵀ ⊗ g gᵀ] factorises exactly into E[a aᵀ] ⊗ E[g gᵀ].
    problem = mlp_regression(getkey(), sizes=(3, 4, 3, 2), activation=None)
    key, mode = getkey(), "ggn_exact"
    est_kfac, _, kfac = _estimate(problem, mode, key)
    assert {type(b) for b in est_kfac.blocks} == {DenseTwoKroneckerFactored}
    _, _, full = _estimate(problem, mode, key, layer_tag_to_block_ctor=FULL)
    np.testing.assert_allclose(kfac, full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("use_bias", [True, False])
def test_kfac_is_exact_for_one_example(use_bias, getkey):
    problem = mlp_classification(getkey(), sizes=(3, 4, 5, 3), batch=1, use_bias=use_bias)
    estimator, _, dense = _estimate(problem, "ggn_exact", getkey())
    exact = brute_force_ggn(problem)
    np.testing.assert_allclose(
        dense, _block_diagonal_part(exact, estimator), rtol=1e-10, atol=1e-12
    )


def test_relu_ggn_blocks_equal_hessian_blocks(getkey):
    # A ReLU network is affine in each layer's parameters, so within a layer the Hessian has no
    # second-derivative term of the network: its diagonal blocks are the GGN's.
    problem = mlp_classification(getkey(), sizes=(3, 4, 5, 3), activation=jax.nn.relu)
    estimator, _, dense = _estimate(problem, "ggn_exact", getkey(), layer_tag_to_block_ctor=FULL)
    hessian = brute_force_hessian(problem)
    np.testing.assert_allclose(
        dense, _block_diagonal_part(hessian, estimator), rtol=1e-9, atol=1e-12
    )


def test_several_losses_add_up(getkey):
    # In the exact modes each loss brings its own output-tangent vectors, so the G factors (and
    # with them the K-FAC blocks, whose A factors are shared) add up over the losses.
    key, kmodel, mode = getkey(), getkey(), "ggn_exact"
    dense = {}
    for register in (("cls", "reg"), ("cls",), ("reg",)):
        problem = two_losses(kmodel, register=register)
        dense[register] = _estimate(problem, mode, key)[2]
    np.testing.assert_allclose(
        dense[("cls", "reg")], dense[("cls",)] + dense[("reg",)], rtol=1e-10, atol=1e-12
    )


@eqx.filter_jit
def _everything(estimator, state, v, damping):
    """Every product, power and spectrum the test compares with the dense matrix, in one program."""
    state = estimator.update_cache(state, damping, exact_powers=-1)
    operator = estimator.as_linear_operator(state, damping)
    flat = lambda tree: ravel_pytree(tree)[0]  # noqa: E731
    inverse = {
        exact: estimator.multiply_inverse(state, v, damping, exact_power=exact)
        for exact in (True, False)
    }
    return dict(
        dense=estimator.to_dense_matrix(state),
        operator_matrix=operator.as_matrix(),
        operator_mv=flat(operator.mv(v)),
        operator_trace=operator_trace(operator),
        operator_eigenvalues=operator_eigenvalues(operator),
        eigenvalues=estimator.eigenvalues(state),
        block_eigenvalues=estimator.block_eigenvalues(state),
        product=flat(estimator.multiply(state, v, damping)),
        per_block_product=flat(estimator.multiply(state, v, [damping] * estimator.num_blocks)),
        round_trip={
            exact: flat(estimator.multiply(state, inverse[exact], damping, exact_power=exact))
            for exact in (True, False)
        },
        cached_inverse=flat(
            estimator.multiply_inverse(state, v, damping, exact_power=True, use_cached=True)
        ),
    )


def test_dense_matrix_operator_and_products_agree(getkey):
    problem = mlp_classification(getkey(), sizes=(3, 4, 3))
    estimator, state, _ = _estimate(
        problem, "ggn_exact", getkey(), init_kwargs=dict(exact_powers_to_cache=-1)
    )
    damping = 0.3
    filtered = eqx.filter(problem.params, eqx.is_inexact_array)
    rng = np.random.default_rng(0)  # (NumPy: JAX's random functions would compile per shape)
    v = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), filtered)

    out = jax.tree.map(np.asarray, _everything(estimator, state, v, damping))
    dense = out["dense"]
    assert dense.shape == (estimator.dim, estimator.dim)
    assert sum(estimator.block_dims) == estimator.dim == flat_params(problem.params)[0].size
    by_products = dense_from_products(lambda u: estimator.multiply(state, u, 0.0), problem.params)
    np.testing.assert_allclose(by_products, dense, rtol=1e-10, atol=1e-13)

    operator = estimator.as_linear_operator(state, damping)
    assert eqx.tree_equal(operator.in_structure(), jax.eval_shape(lambda: filtered))
    assert lx.is_positive_semidefinite(operator) and lx.is_symmetric(operator)
    damped = dense + damping * np.eye(estimator.dim)
    flat_v = np.asarray(ravel_pytree(v)[0])
    np.testing.assert_allclose(out["operator_matrix"], damped, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(out["operator_mv"], damped @ flat_v, rtol=1e-10)
    np.testing.assert_allclose(out["operator_trace"], np.trace(damped), rtol=1e-10)
    np.testing.assert_allclose(
        np.sort(out["operator_eigenvalues"]), np.linalg.eigvalsh(damped), rtol=1e-8, atol=1e-10
    )
    np.testing.assert_allclose(
        np.sort(out["eigenvalues"]), np.linalg.eigvalsh(dense), rtol=1e-8, atol=1e-10
    )
    for values, idx in zip(out["block_eigenvalues"], block_slices(estimator)):
        np.testing.assert_allclose(
            np.sort(values), np.linalg.eigvalsh(dense[np.ix_(idx, idx)]), rtol=1e-8, atol=1e-10
        )
    np.testing.assert_allclose(out["product"], damped @ flat_v, rtol=1e-10)
    np.testing.assert_allclose(out["per_block_product"], damped @ flat_v, rtol=1e-10)
    for exact in (True, False):
        np.testing.assert_allclose(out["round_trip"][exact], flat_v, rtol=1e-8)
    np.testing.assert_allclose(out["cached_inverse"], np.linalg.solve(damped, flat_v), rtol=1e-8)


def test_registrations_and_overrides(getkey):
    problem = mlp_classification(getkey(), sizes=(3, 4, 3))
    estimator = BlockDiagonalCurvature(
        problem.loss_fn, problem.func_args, index_to_block_ctor={"layers[1].weight": DenseFull}
    )
    regs = estimator.registrations()
    assert list(regs) == [
        "layers[0].weight", "layers[0].bias", "layers[1].weight", "layers[1].bias"
    ]
    assert regs["layers[0].weight"].block == "DenseTwoKroneckerFactored"
    assert regs["layers[1].bias"].block == "DenseFull"
    assert {r.tag for r in regs.values()} == {"dense"}
    table = str(regs)
    assert "layers[1].bias" in table and "DenseFull" in table and "parameter" in table.splitlines()[0]

    with pytest.raises(ValueError, match="match no layer"):
        BlockDiagonalCurvature(
            problem.loss_fn, problem.func_args, index_to_block_ctor={"nope.weight": DenseFull}
        )


def test_incompatible_block_names_the_parameter(getkey):
    problem = mlp_classification(getkey(), sizes=(3, 4, 3))
    with pytest.raises(ValueError, match=r"layers\[0\]\.weight"):
        BlockDiagonalCurvature(
            problem.loss_fn,
            problem.func_args,
            auto_register_tags=False,
            layer_tag_to_block_ctor={"generic": DenseTwoKroneckerFactored},
        )


def test_mode_errors(getkey):
    problem = mlp_ggn_only(getkey())
    estimator = BlockDiagonalCurvature(problem.loss_fn, problem.func_args)
    state = estimator.init(getkey())

    # (The errors are raised while the update is traced: compiled, only the valid mode runs.)
    def update(mode):
        return _update(estimator, state, getkey(), problem.func_args, problem.batch_size, mode)

    for mode in ("fisher_gradients", "fisher_exact", "fisher_curvature_prop", "fisher_empirical"):
        with pytest.raises(TypeError, match="NegativeLogProbLoss"):
            update(mode)
    update("ggn_exact")
    with pytest.raises(ValueError, match="Unknown estimation_mode"):
        update("fisher")
    with pytest.raises(ValueError, match="Unknown default_estimation_mode"):
        BlockDiagonalCurvature(problem.loss_fn, problem.func_args, default_estimation_mode="ggn")

    classification = mlp_classification(getkey())
    x, _ = classification.batch

    def no_targets(params, data):
        logits = jax.vmap(params)(data[0])
        register_softmax_cross_entropy_loss(logits)
        return jnp.sum(logits)

    est = BlockDiagonalCurvature(no_targets, classification.func_args)
    with pytest.raises(ValueError, match="targets"):
        _update(est, est.init(), getkey(), classification.func_args, 5, "fisher_empirical")


def test_example_args_may_be_shape_structs_and_update_jits(getkey):
    problem = mlp_classification(getkey())
    structs = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x,
        problem.func_args,
    )
    estimator = BlockDiagonalCurvature(problem.loss_fn, structs)
    key = getkey()
    state = estimator.init(key)

    @eqx.filter_jit
    def update(state, args, key):
        return estimator.update_curvature_matrix_estimate(
            state, 0.0, 1.0, problem.batch_size, key, args, "ggn_exact"
        )

    jitted = _to_dense(estimator, update(state, problem.func_args, key))
    eager = _to_dense(
        estimator,
        estimator.update_curvature_matrix_estimate(
            state, 0.0, 1.0, problem.batch_size, key, problem.func_args, "ggn_exact"
        ),
    )
    np.testing.assert_allclose(jitted, eager, rtol=1e-12)


def test_scan_over_stacked_layers_equals_unrolled_network(getkey):
    problem, unrolled, perm = scan_classification(getkey())
    key, mode = getkey(), "ggn_exact"
    est_scan, _, scan_dense = _estimate(problem, mode, key)
    est_unrolled, _, unrolled_dense = _estimate(unrolled, mode, key)
    stacked = [b for b in est_scan.blocks if b.spec.stack_size is not None]
    assert len(stacked) == 1 and stacked[0].spec.stack_size == 2
    assert isinstance(stacked[0], DenseTwoKroneckerFactored)
    assert est_scan.num_blocks == 3 and est_unrolled.num_blocks == 4
    expected = unrolled_dense[np.ix_(perm, perm)]
    np.testing.assert_allclose(scan_dense, expected, rtol=1e-10, atol=1e-13)


def test_axis_name_averages_statistics_over_devices(getkey):
    devices = jax.devices()[:4]
    problem = mlp_classification(getkey(), batch=8)
    x, y = problem.batch
    estimator = BlockDiagonalCurvature(problem.loss_fn, problem.func_args)
    state0 = estimator.init()
    key = getkey()
    mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
    spec = jax.sharding.PartitionSpec

    def per_device(x, y):
        return estimator.update_curvature_matrix_estimate(
            state0, 0.0, 1.0, x.shape[0], key, (problem.params, (x, y)), "ggn_exact",
            axis_name="batch",
        )

    # Per-device statistics need the map without varying-axis checks (see the test below).
    mapped = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(spec("batch"), spec("batch")),
        out_specs=spec(),
        check_vma=False,
    )
    sharded = jax.jit(lambda x, y: estimator.to_dense_matrix(mapped(x, y)))(x, y)
    _, single = _update(estimator, state0, key, problem.func_args, 8, "ggn_exact")
    np.testing.assert_allclose(sharded, single, rtol=1e-10, atol=1e-13)


def test_layers_changing_with_the_arguments_is_an_error(getkey):
    problem = mlp_classification(getkey(), batch=5)

    def shape_dependent(params, data):
        if data[0].shape[0] < 4:
            # All parameters as one generic layer instead of two dense layers.
            leaves, treedef = jax.tree.flatten(params)
            params = jax.tree.unflatten(treedef, list(register_generic(*leaves)))
        return problem.loss_fn(params, data)

    estimator = BlockDiagonalCurvature(shape_dependent, problem.func_args)
    assert [b.spec.tag for b in estimator.blocks] == ["dense", "dense"]
    small = (problem.params, jax.tree.map(lambda a: a[:2], problem.batch))
    with pytest.raises(ValueError, match="different layers"):
        estimator.update_curvature_matrix_estimate(estimator.init(), 0.0, 1.0, 2, getkey(), small)



def test_varying_axis_checks_are_rejected_with_advice(getkey):
    problem = mlp_classification(getkey(), batch=8)
    x, y = problem.batch
    estimator = BlockDiagonalCurvature(problem.loss_fn, problem.func_args)
    state0 = estimator.init()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("batch",))
    spec = jax.sharding.PartitionSpec

    def per_device(x, y):
        return estimator.update_curvature_matrix_estimate(
            state0, 0.0, 1.0, x.shape[0], getkey(), (problem.params, (x, y)), "ggn_exact",
            axis_name="batch",
        )

    with pytest.raises(ValueError, match="check_vma=False"):
        jax.shard_map(per_device, mesh=mesh, in_specs=(spec("batch"), spec("batch")), out_specs=spec())(x, y)


class _ConvBatchNorm(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key, mode):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(2, 3, 3, padding=1, use_bias=False, key=k1)
        self.norm = eqx.nn.BatchNorm(3, "batch", mode=mode)
        self.head = eqx.nn.Linear(3, 2, key=k2)

    def __call__(self, x, state):
        y, state = self.norm(self.conv(x), state)
        return self.head(jnp.mean(jnp.tanh(y), axis=(1, 2))), state


@pytest.mark.parametrize("mode", ["batch", "ema"])
def test_batch_norm_on_conv_features_is_an_exact_scale_and_shift_layer(mode, getkey):
    # The batch statistics do not depend on BatchNorm's own scale and shift, so its per-example
    # gradients, and a full block of them, are exact.
    model, state = eqx.nn.make_with_state(_ConvBatchNorm)(getkey(), mode)
    model = eqx.tree_at(lambda m: m.norm.weight, model, jnp.linspace(0.5, 1.5, 3))
    x, t = jax.random.normal(getkey(), (5, 2, 4, 4)), jax.random.normal(getkey(), (5, 2))

    def outputs(m, s, x):
        return jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, s)

    def loss(m, s, batch):
        out, s = outputs(m, s, batch[0])
        register_squared_error_loss(out, batch[1])
        return jnp.mean(jnp.sum((out - batch[1]) ** 2, axis=-1)), s

    estimator = BlockDiagonalCurvature(
        loss, (model, state, (x, t)), default_estimation_mode="ggn_exact",
        layer_tag_to_block_ctor={"scale_and_shift": ScaleAndShiftFull},
    )
    (norm,) = [b for b in estimator.blocks if b.spec.tag == "scale_and_shift"]
    assert norm.spec.param_paths == ("norm.weight", "norm.bias") and norm.spec.get("param_axes") == (-3,)
    curvature, _ = _update(estimator, estimator.init(), getkey(), (model, state, (x, t)), 5, "ggn_exact")
    block_state = curvature.block_states[estimator.blocks.index(norm)]

    def affine_outputs(affine):
        m = eqx.tree_at(lambda m: (m.norm.weight, m.norm.bias), model, affine)
        return outputs(m, state, x)[0].reshape(-1)

    jac = jax.jit(jax.jacobian(affine_outputs))((model.norm.weight, model.norm.bias))
    jac = np.concatenate(jac, axis=1)
    np.testing.assert_allclose(_to_dense(norm, block_state), 2 * jac.T @ jac / 5, rtol=1e-10, atol=1e-13)


# Last in the module: counting compilations clears JAX's caches (`xla_compilations`), so the
# tests before it share the programs that several of them compile (model set-ups of one shape).
@pytest.mark.parametrize("make", [BlockDiagonalCurvature, ExplicitExactCurvature])
def test_an_eager_update_is_one_program_whatever_its_coefficients(make, getkey, xla_compilations):
    problem = mlp_classification(getkey())
    estimator = make(problem.loss_fn, problem.func_args)
    state, key = estimator.init(getkey()), getkey()
    vector = eqx.filter(problem.func_args[0], eqx.is_inexact_array)

    def calls():
        s = state
        for ema_old, ema_new in [(0.0, 1.0), (0.5, 0.5), (0.9, 0.1)]:
            s = estimator.update_curvature_matrix_estimate(
                s, ema_old, ema_new, problem.batch_size, key, problem.func_args, "ggn_exact"
            )
            estimator.multiply_inverse(s, vector, ema_new)

    # One program for the updates and one for the products, whatever the coefficients and the
    # damping, and at most two more converting Python numbers to arrays. (One operation at a
    # time: dozens, and more for every new value.)
    assert xla_compilations(calls) <= 4
