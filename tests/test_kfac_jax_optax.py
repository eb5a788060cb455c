"""`eqx_kfac.kfac_jax.OptaxPreconditioner` against kfac-jax HEAD's, driven by kfac-jax's
`examples/optax_wrapper.py` loop (`reference/optax_wrapper_loop.py`) inside `jax.pmap` on 4 devices
(issue 49); its keywords and defaults, its errors, and the names kfac-jax's examples import."""

import inspect
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_kfac
import eqx_kfac.kfac_jax as kfac_jax
from reference import optax_wrapper_loop
from reference.twins import load


@pytest.fixture(scope="module")
def fixture():
    return load("optax_mlp")


def _data(fixture):
    return {name[len("data_"):]: value for name, value in fixture.items() if name.startswith("data_")}


@pytest.mark.parametrize("case", sorted(optax_wrapper_loop.CASES))
def test_optax_wrapper_loop_matches_kfac_jax(fixture, case):
    out = optax_wrapper_loop.run(kfac_jax, case, _data(fixture))
    np.testing.assert_allclose(out["losses"], fixture[f"{case}_losses"], rtol=1e-9)
    np.testing.assert_allclose(out["params"], fixture[f"{case}_params"], rtol=1e-8, atol=1e-10)


def test_keywords_and_defaults_are_kfac_jax_s(fixture):
    theirs = json.loads(str(fixture["signature"]))
    ours = [
        [p.name, p.default.__name__ if callable(p.default) else repr(p.default)]
        for p in list(inspect.signature(kfac_jax.OptaxPreconditioner.__init__).parameters.values())[1:]
        if p.kind is not inspect.Parameter.KEYWORD_ONLY
    ]
    assert ours == theirs
    assert dict(theirs)["estimation_mode"] == "'fisher_gradients'"


def _loss(params, batch):
    logits = batch["x"] @ params["w"] + params["b"]
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def _args():
    key = jax.random.key(0)
    params = {"w": jax.random.normal(key, (3, 2)), "b": jnp.zeros(2)}
    return params, {"x": jax.random.normal(jax.random.fold_in(key, 1), (5, 3)), "y": jnp.array([0, 1, 1, 0, 1])}


def test_schedule_counts_and_the_optax_transform():
    """Outside a pmap: the damping schedule read at the state's count, `as_gradient_transform`
    equal to `apply` (and to `multiply_curvature`'s inverse for exact inverses without a cache)."""
    precon = kfac_jax.OptaxPreconditioner(
        _loss, l2_reg=1e-3, damping_schedule=lambda count: 0.5**count, estimation_mode="ggn_exact",
        use_exact_inverses=True, inverse_update_period=1,
    )
    args = _args()
    state = precon.init(args, jax.random.key(1))
    state = precon.increment_count(precon.maybe_update(state, args, jax.random.key(2)))
    assert int(state.count) == 1 and precon.get_identity_weight(state) == pytest.approx(0.5 + 1e-3)
    grads = jax.grad(_loss)(*args)
    transform = precon.as_gradient_transform()
    updates, _ = transform.update(grads, transform.init(args[0]), precond_state=state)
    direct = precon.apply(grads, state)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), updates, direct))
    back = precon.multiply_curvature(direct, state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-12)


def test_errors_name_the_keyword():
    with pytest.raises(ValueError, match="exactly one of damping= and damping_schedule="):
        kfac_jax.OptaxPreconditioner(_loss)
    with pytest.raises(ValueError, match="curvature_update_period must be 1"):
        kfac_jax.OptaxPreconditioner(_loss, damping=1.0, curvature_update_period=2)
    with pytest.raises(NotImplementedError, match="use_sqrt_inv=True"):
        kfac_jax.OptaxPreconditioner(_loss, damping=1.0, use_sqrt_inv=True)
    with pytest.raises(NotImplementedError, match="num_samples=2"):
        kfac_jax.OptaxPreconditioner(_loss, damping=1.0, num_samples=2)
    with pytest.raises(ValueError, match="call `init"):
        _ = kfac_jax.OptaxPreconditioner(_loss, damping=1.0).estimator


def test_names_kfac_jax_examples_import():
    # examples/optax_wrapper.py and examples/optimizers.py, at import.
    assert kfac_jax.OptaxPreconditionState is kfac_jax.curvature_estimator.OptaxPreconditionState
    assert kfac_jax.OptaxPreconditioner is kfac_jax.curvature_estimator.OptaxPreconditioner
    assert kfac_jax.curvature_estimator.BlockDiagonalCurvature is eqx_kfac.BlockDiagonalCurvature
    for name in ("ValueAndGradFunc", "ValueFunc", "FuncArgsVariants", "ScheduleType"):
        assert hasattr(kfac_jax.optimizer, name), name
    for name in ("Array", "Numeric", "PRNGKey", "Params", "Batch", "FuncState", "ArrayTree"):
        assert hasattr(kfac_jax.utils, name), name
