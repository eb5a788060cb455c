"""`import eqx_kfac.kfac_jax as kfac_jax` runs kfac-jax code: its README quickstart unchanged
but for the import (its optimizer equal, part by part, to `eqx_kfac.Optimizer` built from the
parts kfac-jax's keywords name), the pmap helpers of `kfac_jax.utils` on the 4 host CPU devices, the replicated calling
convention of the multi-device optimizer, kfac-jax HEAD's constructor keywords, FermiNet's
graph-matcher names, and the kfac-jax-style blocks that cannot be adapted refused at
registration (tests/test_kfac_jax_blocks.py: those that can)."""

import functools
import inspect
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_kfac
import eqx_kfac.kfac_jax as kfac_jax

# kfac-jax's README quickstart (HEAD), verbatim but for the import; NUM_BATCHES is 3 here (100 there).
README = '''
import haiku as hk
import jax
import jax.numpy as jnp
import kfac_jax

# Hyper parameters
NUM_CLASSES = 10
L2_REG = 1e-3
NUM_BATCHES = 3


def make_dataset_iterator(batch_size):
  # Dummy dataset, in practice this should be your dataset pipeline
  for _ in range(NUM_BATCHES):
    yield jnp.zeros([batch_size, 100]), jnp.ones([batch_size], dtype="int32")


def softmax_cross_entropy(logits: jnp.ndarray, targets: jnp.ndarray):
  """Softmax cross entropy loss."""
  # We assume integer labels
  assert logits.ndim == targets.ndim + 1

  # Tell KFAC-JAX this model represents a classifier
  # See https://kfac-jax.readthedocs.io/en/latest/overview.html#supported-losses
  kfac_jax.register_softmax_cross_entropy_loss(logits, targets)
  log_p = jax.nn.log_softmax(logits, axis=-1)
  return - jax.vmap(lambda x, y: x[y])(log_p, targets)


def model_fn(x):
  """A Haiku MLP model function - three hidden layer network with tanh."""
  return hk.nets.MLP(
    output_sizes=(50, 50, 50, NUM_CLASSES),
    with_bias=True,
    activation=jax.nn.tanh,
  )(x)


# The Haiku transformed model
hk_model = hk.without_apply_rng(hk.transform(model_fn))


def loss_fn(model_params, model_batch):
  """The loss function to optimize."""
  x, y = model_batch
  logits = hk_model.apply(model_params, x)
  loss = jnp.mean(softmax_cross_entropy(logits, y))

  # The optimizer assumes that the function you provide has already added
  # the L2 regularizer to its gradients.
  return loss + L2_REG * kfac_jax.utils.inner_product(params, params) / 2.0


# Create the optimizer
optimizer = kfac_jax.Optimizer(
  value_and_grad_func=jax.value_and_grad(loss_fn),
  l2_reg=L2_REG,
  value_func_has_aux=False,
  value_func_has_state=False,
  value_func_has_rng=False,
  use_adaptive_learning_rate=True,
  use_adaptive_momentum=True,
  use_adaptive_damping=True,
  initial_damping=1.0,
  multi_device=False,
)

input_dataset = make_dataset_iterator(128)
rng = jax.random.PRNGKey(42)
dummy_images, dummy_labels = next(input_dataset)
rng, key = jax.random.split(rng)
params = hk_model.init(key, dummy_images)
rng, key = jax.random.split(rng)
opt_state = optimizer.init(params, key, (dummy_images, dummy_labels))

# Training loop
for i, batch in enumerate(input_dataset):
  rng, key = jax.random.split(rng)
  params, opt_state, stats = optimizer.step(
      params, opt_state, key, batch=batch, global_step_int=i)
  print(i, stats)
'''


def _run(source, **names):
    printed = []
    namespace = dict(print=lambda *args: printed.append(args), **names)
    exec(compile(source, "README.md", "exec"), namespace)
    return namespace, printed


@pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)
def test_readme_quickstart_runs_on_eqx_kfac_parts():
    """The README with the import renamed runs and trains; its optimizer is `eqx_kfac.Optimizer`
    built from the parts that kfac-jax's keywords name: every field but the value function
    (the same `loss_fn`, wrapped by another `jax.value_and_grad`) is equal, and both take their
    steps through the same `init` and `step`, so the two runs are the same step by step (each run
    would compile its own step: comparing the parts costs nothing)."""
    pytest.importorskip("haiku")
    source = README.replace("import kfac_jax\n", "import eqx_kfac.kfac_jax as kfac_jax\n")
    dropin, printed = _run(source)
    optimizer = dropin["optimizer"]
    assert isinstance(optimizer, kfac_jax.Optimizer) and len(printed) == 2
    losses = [float(stats["loss"]) for _, stats in printed]
    assert all(np.isfinite(losses)) and losses[1] < losses[0]
    assert all(not bool(stats["skipped"]) for _, stats in printed)

    unbounded = eqx_kfac.AdaptiveHyperparameter(-math.inf, math.inf)
    core = eqx_kfac.Optimizer(
        jax.value_and_grad(dropin["loss_fn"]), dropin["L2_REG"],
        curvature=eqx_kfac.CurvatureOptions(estimation_mode="ggn_curvature_prop"),
        refresh=eqx_kfac.RefreshSchedule(max_statistics_growth=None),
        step_rule=eqx_kfac.MomentumStep(unbounded, unbounded),
        damping_rule=eqx_kfac.LevenbergMarquardtDamping(1.0, minimum=1e-8, fault_increase=1.0),
        guard=eqx_kfac.StepGuard(max_consecutive_faults=None, max_consecutive_stalls=None),
    )
    for field in ("l2_reg", "preconditioner", "step_rule", "damping_rule", "guard", "devices", "options"):
        assert eqx.tree_equal(getattr(optimizer, field), getattr(core, field)), field
    assert optimizer.function.value is core.function.value  # the README's loss_fn, recovered


# kfac-jax HEAD's `Optimizer.__init__` parameters, in order.
HEAD_PARAMETERS = (
    "value_and_grad_func l2_reg regularized_parameters_path_exclusions value_func_has_aux "
    "value_func_has_state value_func_has_rng value_func_for_estimator use_adaptive_learning_rate "
    "learning_rate_schedule use_adaptive_momentum momentum_schedule use_adaptive_damping "
    "damping_schedule initial_damping use_initial_damping_calibration min_damping max_damping "
    "include_damping_in_quad_change damping_adaptation_interval damping_adaptation_decay "
    "damping_lower_threshold damping_upper_threshold always_use_exact_qmodel_for_damping_adjustment "
    "precon_damping_mult precon_damping_schedule use_step_rejection reject_damping_increase_factor "
    "norm_constraint num_burnin_steps estimation_mode custom_estimator_ctor curvature_ema "
    "curvature_update_period inverse_update_period use_exact_inverses batch_process_func "
    "register_only_generic patterns_to_skip use_automatic_registration auto_register_kwargs "
    "layer_tag_to_block_ctor multi_device debug invalid_metric_value batch_size_extractor "
    "pmap_axis_name forbid_setting_attributes_after_finalize modifiable_attribute_exceptions "
    "include_norms_in_stats include_per_param_norms_in_stats include_registered_loss_in_stats "
    "distributed_precon_apply distributed_inverses num_estimator_samples "
    "should_vmap_estimator_samples norm_to_scale_identity_weight_per_block precon_power "
    "exact_quad_model_matrix_type"
).split()


def _loss(params, batch):
    x, y = batch
    out = jnp.tanh(x @ params["w"] + params["b"]) @ params["head"]
    eqx_kfac.register_squared_error_loss(out, y)
    return 0.5 * jnp.mean(jnp.sum((out - y) ** 2, -1))


def _problem(key, n=8):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    params = {"w": jax.random.normal(k1, (3, 5)), "b": jnp.zeros(5), "head": jax.random.normal(k2, (5, 2))}
    return params, (jax.random.normal(k3, (n, 3)), jax.random.normal(k4, (n, 2)))


def test_constructor_keywords_are_heads():
    """kfac-jax HEAD's parameters, in its order (the positional calls of kfac-jax code bind
    alike), then eqx_kfac's keyword-only ones; the defaults that HEAD documents."""
    parameters = inspect.signature(kfac_jax.Optimizer).parameters
    assert tuple(parameters)[: len(HEAD_PARAMETERS)] == tuple(HEAD_PARAMETERS)
    assert all(p.kind is p.KEYWORD_ONLY for p in list(parameters.values())[len(HEAD_PARAMETERS):])
    defaults = {k: p.default for k, p in parameters.items()}
    assert (defaults["pmap_axis_name"], defaults["estimation_mode"], defaults["min_damping"]) == ("batch_axis", None, 1e-8)
    # The defaults the translation is written against (`_keywords`) are the signature's.
    from eqx_kfac.kfac_jax._keywords import IGNORED, KEYWORDS, REFUSED

    written = {k: v for part in KEYWORDS.values() for k, v in part.items()}
    written.update({k: v for k, (v, _) in {**REFUSED, **IGNORED}.items()})
    assert all(defaults[k] == v or (v != v and defaults[k] != defaults[k]) for k, v in written.items())
    optimizer = kfac_jax.Optimizer(jax.value_and_grad(_loss), 0.0, multi_device=True)
    assert optimizer.pmap_axis_name == "batch_axis"
    assert optimizer.preconditioner.curvature.estimation_mode == "ggn_curvature_prop"


@pytest.mark.parametrize(
    "keyword, value",
    [("precon_power", -0.5), ("precon_damping_mult", 2.0), ("custom_estimator_ctor", object),
     ("regularized_parameters_path_exclusions", "b,bias"), ("num_estimator_samples", 4),
     ("include_registered_loss_in_stats", True), ("invalid_metric_value", 0.0),
     ("norm_to_scale_identity_weight_per_block", "trace"), ("exact_quad_model_matrix_type", "fisher_empirical")],
)
def test_keywords_without_a_part_are_refused_by_name(keyword, value):
    with pytest.raises(NotImplementedError, match=f"kfac_jax.Optimizer\\({keyword}="):
        kfac_jax.Optimizer(jax.value_and_grad(_loss), 0.0, **{keyword: value})


def test_keywords_that_map_or_are_ignored():
    """Ignored keywords leave the optimizer as it was; `use_automatic_registration=False` and
    `exact_quad_model_matrix_type="fisher"` map onto the curvature's options."""
    vg = jax.value_and_grad(_loss)
    plain = kfac_jax.Optimizer(vg, 0.0)
    ignored = kfac_jax.Optimizer(
        vg, 0.0, debug=True, forbid_setting_attributes_after_finalize=False,
        modifiable_attribute_exceptions=("x",), should_vmap_estimator_samples=True,
        precon_power=-1, norm_to_scale_identity_weight_per_block="none", exact_quad_model_matrix_type="fisher",
        batch_size_extractor=kfac_jax.utils.default_batch_size_extractor,
    )
    assert eqx.tree_equal(plain, ignored)
    manual = kfac_jax.Optimizer(vg, 0.0, use_automatic_registration=False)
    assert dict(manual.preconditioner.curvature.auto_register_kwargs)["auto_register_tags"] is False


def test_pmap_helpers_on_four_devices(monkeypatch):
    n = jax.local_device_count()
    assert n == 4
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "s": jnp.asarray(2.0)}
    replicated = kfac_jax.utils.replicate_all_local_devices(tree)
    assert replicated["w"].shape == (n, 2, 3) and len(replicated["w"].sharding.device_set) == n
    assert eqx.tree_equal(kfac_jax.utils.get_first(replicated), tree)
    np.testing.assert_array_equal(kfac_jax.utils.get_mean(replicated)["w"], tree["w"])
    np.testing.assert_array_equal(kfac_jax.utils.get_sum(replicated)["s"], n * 2.0)
    keys = kfac_jax.utils.make_different_rng_key_on_all_devices(jax.random.key(0))
    data = jax.random.key_data(keys)
    assert keys.shape == (n,) and len({tuple(np.asarray(d)) for d in data}) == n
    first, second = kfac_jax.utils.p_split(keys)
    expected = jax.vmap(jax.random.split)(keys)
    np.testing.assert_array_equal(jax.random.key_data(first), jax.random.key_data(expected[:, 0]))
    np.testing.assert_array_equal(jax.random.key_data(second), jax.random.key_data(expected[:, 1]))
    assert len(kfac_jax.utils.p_split_num(keys, 3)) == 3
    # One compiled program, the stacks split over the devices as the keys came: FermiNet calls
    # p_split twice per iteration, and its eager `vmap` ran `jax.random.split` at every call (3 ms).
    split, splits = jax.random.split, []
    monkeypatch.setattr(jax.random, "split", lambda *a, **k: splits.append(1) or split(*a, **k))
    for _ in range(3):
        first, second = kfac_jax.utils.p_split(first)
    assert len(splits) <= 1
    assert first.sharding.is_equivalent_to(keys.sharding, 1) and len(second.sharding.device_set) == n

    mesh = jax.make_mesh((n,), ("batch_axis",))
    x = jax.device_put(jnp.arange(float(n)), jax.NamedSharding(mesh, jax.P("batch_axis")))
    collectives = jax.shard_map(
        lambda v: (kfac_jax.utils.pmean_if_pmap(v, "batch_axis"), kfac_jax.utils.psum_if_pmap(v, "batch_axis")),
        mesh=mesh, in_specs=jax.P("batch_axis"), out_specs=jax.P("batch_axis"),
    )
    mean, total = collectives(x)
    np.testing.assert_array_equal(mean, np.full(n, 1.5))
    np.testing.assert_array_equal(total, np.full(n, 6.0))
    assert kfac_jax.utils.pmean_if_pmap(x, "batch_axis") is x  # outside the map: unchanged
    assert kfac_jax.utils.product((2, 3, 4)) == 24
    np.testing.assert_allclose(kfac_jax.utils.inner_product(tree, tree), 1 + 4 + 9 + 16 + 25 + 4)


def test_replicated_calling_convention_equals_plain_arguments(getkey):
    """FermiNet's calls: replicated parameters, one key per device, the batch with a leading
    device axis, replicated damping and momentum; outputs replicated (`stats["loss"][0]`). The
    parameters equal those of the plain call with the global batch, devices first (an exact
    estimation mode: the keys differ)."""
    params, (x, y) = _problem(getkey(), n=8)
    optimizer = kfac_jax.Optimizer(
        jax.value_and_grad(_loss), 0.0, learning_rate_schedule=lambda t: 0.1, num_burnin_steps=0,
        inverse_update_period=1, multi_device=True, pmap_axis_name="qmc_axis", estimation_mode="ggn_exact",
    )
    u = kfac_jax.utils
    per_device = lambda a: u.broadcast_all_local_devices(a.reshape(4, 2, *a.shape[1:]))
    batch = (per_device(x), per_device(y))
    keys = u.make_different_rng_key_on_all_devices(jax.random.key(1))
    momentum, damping = u.replicate_all_local_devices(jnp.asarray(0.5)), u.replicate_all_local_devices(jnp.asarray(1e-2))
    replicated_params = u.replicate_all_local_devices(params)
    state = optimizer.init(replicated_params, keys, batch)
    assert jax.tree.leaves(state)[0].shape[0] == 4
    plain_state = optimizer.init(params, jax.random.key(1), (x, y))
    plain = params
    for _ in range(2):
        keys, step_keys = u.p_split(keys)
        replicated_params, state, stats = optimizer.step(
            replicated_params, state, step_keys, batch=batch, momentum=momentum, damping=damping
        )
        # (Arrays, as the replicated call's are: the step is compiled once for both.)
        plain, plain_state, plain_stats = optimizer.step(
            plain, plain_state, jax.random.key(2), batch=(x, y), momentum=jnp.asarray(0.5), damping=jnp.asarray(1e-2)
        )
        assert stats["loss"].shape == (4,)
        np.testing.assert_allclose(stats["loss"][0], plain_stats["loss"], rtol=1e-12)
    for a, b in zip(jax.tree.leaves(u.get_first(replicated_params)), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)


def test_ferminet_graph_matcher_names(getkey):
    """FermiNet's repeated-dense pattern, written with kfac-jax's names (`layer_tag`,
    `_dense`, `_dense_parameter_extractor` with a variant), registers the layer with that
    variant; `register_dense(..., type=...)` is `variant=`."""
    tgm = kfac_jax.tag_graph_matcher
    dense = functools.partial(tgm._dense, axes=1, with_reshape=False)
    pattern = tgm.GraphPattern(
        name="repeated_dense1_with_bias",
        tag_primitive=kfac_jax.layers_and_loss_tags.layer_tag,
        compute_func=jax.vmap(dense, in_axes=[0, [None, None]]),
        parameters_extractor_func=functools.partial(tgm._dense_parameter_extractor, variant="repeated_dense"),
        example_args=[np.zeros([9, 11, 13]), [np.zeros([13, 7]), np.zeros([7])]],
    )
    assert pattern.tag is eqx_kfac.dense_tag
    params, (x, y) = _problem(getkey())
    x = jnp.stack([x, 2 * x], axis=1)  # (batch, repeats, features)

    def loss(p, batch):
        x, y = batch
        h = jnp.tanh(jax.vmap(lambda e: jnp.tensordot(e, p["w"], axes=1) + p["b"])(x)).sum(1)
        out = h @ p["head"]
        kfac_jax.register_squared_error_loss(out, y)
        return 0.5 * jnp.mean(jnp.sum((out - y) ** 2, -1))

    estimator = kfac_jax.BlockDiagonalCurvature(loss, (params, (x, y)), graph_patterns=(pattern, *tgm.DEFAULT_GRAPH_PATTERNS))
    (layer,) = [b for b in estimator.blocks if "['w']" in b.spec.param_paths]
    assert (layer.spec.origin, layer.spec.get("variant")) == ("repeated_dense1_with_bias", "repeated_dense")
    with pytest.raises(TypeError, match="_dense_parameter_extractor"):
        tgm.GraphPattern("p", kfac_jax.layers_and_loss_tags.layer_tag, dense, lambda eqns: {}, pattern.example_args[0])

    def manual(p, batch):
        x, y = batch
        pre = x @ p["w"] + p["b"]
        out = jnp.tanh(kfac_jax.register_dense(pre, x, p["w"], p["b"], type="qmc")) @ p["head"]
        kfac_jax.register_squared_error_loss(out, y)
        return 0.5 * jnp.mean(jnp.sum((out - y) ** 2, -1))

    (tagged,) = [b for b in kfac_jax.BlockDiagonalCurvature(manual, (params, (x[:, 0], y))).blocks if "['w']" in b.spec.param_paths]
    assert tagged.spec.get("variant") == "qmc"


class SyncedBlock(kfac_jax.DenseTwoKroneckerFactored):
    """A kfac-jax-style block that syncs its own state: not adapted."""

    def sync(self, state, pmap_axis_name):
        return state


class PartialBlock(kfac_jax.CurvatureBlock):
    """kfac-jax's abstract base with only some of its abstract methods written: not adapted."""

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        raise AssertionError("never called")


class ScaledDiagonal(kfac_jax.Diagonal):
    """An eqx_kfac family (kfac_jax.Diagonal is eqx_kfac's) with kfac-jax's methods: refused."""

    def fixed_scale(self):
        return 2.0


def test_blocks_that_cannot_be_adapted_are_refused_at_registration():
    with pytest.raises(TypeError, match=r"SyncedBlock\.sync is not adapted"):
        kfac_jax.set_default_tag_to_block_ctor("synced", SyncedBlock)
    with pytest.raises(TypeError, match=r"does not implement kfac-jax's .*_multiply_matpower_unscaled.*subclass kfac_jax.KroneckerFactored"):
        kfac_jax.set_default_tag_to_block_ctor("partial", PartialBlock)
    with pytest.raises(TypeError, match=r"subclasses eqx_kfac's Diagonal.*ScaledDiagonal\.fixed_scale.*Subclass kfac_jax.KroneckerFactored"):
        kfac_jax.Optimizer(jax.value_and_grad(_loss), 0.0, layer_tag_to_block_ctor={"dense": ScaledDiagonal})
    with pytest.raises(ValueError, match="No default block for tag 'synced'"):
        kfac_jax.get_default_tag_to_block_ctor("synced")
    # kfac-jax's bases, given as blocks, are eqx_kfac's.
    assert kfac_jax.get_default_tag_to_block_ctor("dense") is eqx_kfac.DenseTwoKroneckerFactored
    params, (x, y) = _problem(jax.random.key(0))
    for ctor in (kfac_jax.DenseTwoKroneckerFactored, kfac_jax.KroneckerFactored):
        estimator = kfac_jax.BlockDiagonalCurvature(_loss, (params, (x, y)), layer_tag_to_block_ctor={"dense": ctor})
        assert {type(b) for b in estimator.blocks if b.spec.tag == "dense"} == {eqx_kfac.DenseTwoKroneckerFactored}


def test_function_forms_of_the_examples():
    """`kfac_jax.optimizer.make_func_args` and `extract_func_outputs`, as kfac-jax's examples call
    them, in every form."""
    o, k = kfac_jax.optimizer, jax.random.key(0)
    assert o.make_func_args("p", None, None, "b", has_state=False, has_rng=False) == ("p", "b")
    assert o.make_func_args("p", "s", k, "b", has_state=True, has_rng=True) == ("p", "s", k, "b")
    assert o.make_func_args("p", None, k, "b", has_state=False, has_rng=True) == ("p", k, "b")
    # examples/training.py's evaluation passes `()` as the state of a stateless model.
    assert o.make_func_args("p", (), None, "b", has_state=False, has_rng=False) == ("p", "b")
    with pytest.raises(ValueError, match="func_state"):
        o.make_func_args("p", None, None, "b", has_state=True, has_rng=False)
    with pytest.raises(ValueError, match="rng=None"):
        o.make_func_args("p", None, None, "b", has_state=False, has_rng=True)
    loss = jnp.asarray(1.0)
    assert o.extract_func_outputs(loss, has_aux=False, has_state=False) == (loss, None, None)
    assert o.extract_func_outputs((loss, ("s", "a")), has_aux=True, has_state=True) == (loss, "s", "a")
    assert o.extract_func_outputs((loss, "s"), has_aux=False, has_state=True) == (loss, "s", None)
