"""FermiNet-style variational Monte Carlo, written as FermiNet writes it for kfac-jax.

A tiny two-electron ansatz (a per-electron dense layer, an orbital layer and an exponential
envelope `exp(-r[..., None] * sigma)`), its local energy (which evaluates the network again, inside
`jax.grad`), and the energy as a `jax.custom_jvp` function whose rule registers `log|psi|` and is
handed straight to `jax.value_and_grad`. (The kinetic term is the gradient form
`|grad log|psi||^2 / 2`, equal to the Laplacian form in expectation and cheaper to compile; the
benchmark `benchmarks/vmc_atoms.py` uses the Laplacian.)
"""

import functools

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_kfac


def _params(key, hidden=4):
    k1, k2 = jax.random.split(key)
    return {
        "layer": {"w": 0.5 * jax.random.normal(k1, (4, hidden)), "b": jnp.full((hidden,), 0.1)},
        "orbital": {"w": 0.5 * jax.random.normal(k2, (hidden, 2)), "b": jnp.full((2,), 0.3)},
        "envelope": {"pi": jnp.full((1, 2), 1.1), "sigma": jnp.full((1, 2), 0.9)},
    }


def _log_psi(params, x, manual=False):
    """`log|psi|` of one walker `x: (2, 3)` (two electrons, one nucleus at the origin)."""
    r = jnp.linalg.norm(x, axis=-1, keepdims=True)
    features = jnp.concatenate([x, r], -1)
    layer = params["layer"]
    pre = features @ layer["w"] + layer["b"]
    if manual:  # FermiNet's own network registers its layers (`register_repeated_dense`).
        pre = eqx_kfac.register_repeated_dense(pre, features, layer["w"], layer["b"])
    h = jnp.tanh(pre)
    env = jnp.sum(jnp.exp(-r[..., None] * params["envelope"]["sigma"]) * params["envelope"]["pi"], axis=1)
    phi = (h @ params["orbital"]["w"] + params["orbital"]["b"]) * env
    return jnp.log(jnp.abs(phi[0, 0] * phi[1, 1] - phi[0, 1] * phi[1, 0]))


def _local_energy(params, x, manual=False):
    g = jax.grad(lambda y: _log_psi(params, y, manual))(x)
    r = jnp.linalg.norm(x, axis=-1)
    return 0.5 * jnp.sum(g**2) - 2.0 * jnp.sum(1.0 / r) + 1.0 / jnp.linalg.norm(x[0] - x[1])


def _energy(register_in_rule=True, aux_in_rule=None, manual=False):
    """FermiNet's loss: `(mean local energy, local energies)` with the VMC gradient as its JVP
    rule. `aux_in_rule` replaces the local energies in the rule's output (FermiNet returns a
    scalar `clipped_energy` there, where its function returned a vector)."""
    log_psi = jax.vmap(functools.partial(_log_psi, manual=manual), (None, 0))
    local_energy = jax.vmap(functools.partial(_local_energy, manual=manual), (None, 0))

    @jax.custom_jvp
    def energy(params, walkers):
        e = local_energy(params, walkers)
        return jnp.mean(e), e

    @energy.defjvp
    def energy_jvp(primals, tangents):
        params, walkers = primals
        loss, e = energy(params, walkers)
        psi, psi_tangent = jax.jvp(lambda p: log_psi(p, walkers), (params,), (tangents[0],))
        if register_in_rule:
            eqx_kfac.register_normal_predictive_distribution(psi[:, None])
        aux = e if aux_in_rule is None else aux_in_rule(e)
        return (loss, aux), (2.0 * jnp.mean((e - loss) * psi_tangent), jnp.zeros_like(aux))

    return energy


def _registered_in_loss(params, walkers):
    """The same loss, `log|psi|` registered beside the energy instead of inside its rule."""
    eqx_kfac.register_normal_predictive_distribution(jax.vmap(_log_psi, (None, 0))(params, walkers)[:, None])
    return _energy(register_in_rule=False)(params, walkers)


def _walkers(key, n=8):
    return jax.random.normal(key, (n, 2, 3))


def _optimizer(value_and_grad, **kwargs):
    # FermiNet's settings, with kfac-jax's keywords and defaults.
    return eqx_kfac.kfac_jax.Optimizer(
        value_and_grad,
        l2_reg=0.0,
        value_func_has_aux=True,
        learning_rate_schedule=lambda t: 0.05,
        momentum_schedule=lambda t: 0.0,
        damping_schedule=lambda t: 1e-3,
        norm_constraint=1e-3,
        inverse_update_period=1,
        estimation_mode="fisher_exact",
        num_burnin_steps=0,
        on_unmatched="error",
        **kwargs,
    )


@eqx.filter_jit
def _curvature_matrix(estimator, func_args, batch_size):
    """The estimator's dense matrix after one update from zero (compiled: quicker than eager)."""
    state = estimator.update_curvature_matrix_estimate(
        estimator.init(jax.random.key(0)), 0.0, 1.0, batch_size, jax.random.key(0), func_args
    )
    return estimator.to_dense_matrix(state)


def _step(optimizer, params, walkers):
    state = optimizer.init(params, jax.random.key(1), walkers)
    return optimizer.step(params, state, jax.random.key(2), batch=walkers)[::2]


def _close(a, b, rtol=1e-9):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-12)


_PARAMS, _WALKERS = _params(jax.random.key(10)), _walkers(jax.random.key(11))


@pytest.fixture(scope="module")
def reference_step():
    """One step of the loss registering `log|psi|` beside the custom-JVP energy."""
    return _step(_optimizer(jax.value_and_grad(_registered_in_loss, has_aux=True)), _PARAMS, _WALKERS)


def test_custom_jvp_energy_straight_to_value_and_grad(reference_step):
    """FermiNet hands its `jax.custom_jvp` energy to `jax.value_and_grad`; the registration in
    its rule is found (no `value_func=`), every parameter gets a structured block, and the step
    is that of the same loss registering `log|psi|` beside the energy."""
    optimizer = _optimizer(jax.value_and_grad(_energy(), has_aux=True))
    registrations = optimizer.estimators((_PARAMS, _WALKERS))[0].registrations()
    assert {reg.block for reg in registrations.values()} == {"DenseTwoKroneckerFactored", "ScaleAndShiftDiagonal"}
    (new, stats), (expected, expected_stats) = _step(optimizer, _PARAMS, _WALKERS), reference_step
    _close(new, expected)
    assert not np.allclose(np.asarray(new["layer"]["w"]), np.asarray(_PARAMS["layer"]["w"]))
    np.testing.assert_allclose(stats["loss"], expected_stats["loss"], rtol=1e-12)


def test_rule_whose_outputs_differ_in_shape_from_the_function(reference_step):
    """FermiNet's rule returns a scalar `clipped_energy` where its function returned a vector;
    JAX accepts that under `jit(grad)` (not under `grad(jit)`), and so does eqx_kfac: the
    curvature is computed from the part of the function `log|psi|` depends on, the values come
    from the user's `value_and_grad`."""
    scalar_aux = _energy(aux_in_rule=jnp.mean)
    with pytest.raises(TypeError, match="Custom JVP rule energy_jvp"):
        jax.grad(jax.jit(scalar_aux), has_aux=True)(_PARAMS, _WALKERS)
    new, _ = _step(_optimizer(jax.value_and_grad(scalar_aux, has_aux=True)), _PARAMS, _WALKERS)
    _close(new, reference_step[0])


def test_envelope_sigma_is_a_broadcast_scale(getkey):
    """`exp(-r[..., None] * sigma)`: the input has a unit axis that JAX broadcasts against
    `sigma`; the scale-and-shift tag gets the broadcast input, and its diagonal block is the
    exact diagonal of the curvature (fisher_exact: the Fisher of the registered `log|psi|`)."""
    params, walkers = _params(getkey()), _walkers(getkey())
    estimator = eqx_kfac.BlockDiagonalCurvature(
        _registered_in_loss, (params, walkers), default_estimation_mode="fisher_exact", on_unmatched="error"
    )
    registration = estimator.registrations()["['envelope']['sigma']"]
    assert (registration.tag, registration.block, registration.origin) == ("scale_and_shift", "ScaleAndShiftDiagonal", "scale_only")
    matrix = _curvature_matrix(estimator, (params, walkers), walkers.shape[0])
    # The normal predictive distribution has variance 1/2: its Fisher is 2 J^T J / B, with J the
    # Jacobian of log|psi|.
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    jac = jax.jit(jax.jacobian(lambda p: jax.vmap(_log_psi, (None, 0))(unravel(p), walkers)))(flat)
    exact = np.diag(2.0 * jac.T @ jac / walkers.shape[0])
    envelope = slice(0, 4)  # the leaves in order: envelope pi and sigma, layer, orbital
    np.testing.assert_allclose(np.diag(matrix)[envelope], exact[envelope], rtol=1e-8)


def test_parameter_in_several_tagged_evaluations(getkey):
    """FermiNet's network registers its layers by hand and the local energy evaluates it again:
    the registrations `log|psi|` depends on define the blocks (the others are ignored, as in
    kfac-jax), and the curvature is that of the network registered once."""
    params, walkers = _params(getkey()), _walkers(getkey())

    def manual_energy(params, walkers):
        return _energy(manual=True)(params, walkers)

    def once(params, walkers):
        log_psi = jax.vmap(functools.partial(_log_psi, manual=True), (None, 0))(params, walkers)
        eqx_kfac.register_normal_predictive_distribution(log_psi[:, None])
        return jnp.mean(log_psi)

    def curvature(func):
        estimator = eqx_kfac.BlockDiagonalCurvature(func, (params, walkers), default_estimation_mode="fisher_exact", on_unmatched="error")
        return estimator, _curvature_matrix(estimator, (params, walkers), walkers.shape[0])

    estimator, matrix = curvature(manual_energy)
    layer = estimator.registrations()["['layer']['w']"]
    assert (layer.tag, layer.block, layer.origin) == ("dense", "DenseTwoKroneckerFactored", "manual")
    _close(matrix, curvature(once)[1])


def test_unused_registration_with_the_parameter_used_elsewhere_is_an_error(getkey):
    """A registration whose output is dropped while the losses use the parameter elsewhere is
    no second evaluation: it is reported, naming the parameter."""
    params, walkers = _params(getkey()), _walkers(getkey())

    def forgot_the_returned_value(params, walkers):
        def log_psi(x):
            r = jnp.linalg.norm(x, axis=-1, keepdims=True)
            features = jnp.concatenate([x, r], -1)
            pre = features @ params["layer"]["w"] + params["layer"]["b"]
            eqx_kfac.register_dense(pre, features, params["layer"]["w"], params["layer"]["b"])
            return jnp.sum(jnp.tanh(pre) @ params["orbital"]["w"])

        out = jax.vmap(log_psi)(walkers)
        eqx_kfac.register_normal_predictive_distribution(out[:, None])
        return jnp.mean(out)

    with pytest.raises(ValueError, match=r"`\['layer'\]\['b'\]` is registered by a layer tag whose outputs"):
        eqx_kfac.BlockDiagonalCurvature(forgot_the_returned_value, (params, walkers), auto_register_tags=False)


def test_estimation_mode_that_does_not_fit_the_losses_raises_at_init(getkey):
    """A custom loss has no predictive distribution: the default `fisher_gradients` is refused
    by `Optimizer.init` and by `kfac_optax` itself, before any step."""
    model = eqx.nn.Linear(3, 2, key=getkey())
    batch = (jax.random.normal(getkey(), (6, 3)), jax.random.normal(getkey(), (6, 2)))

    def loss(model, batch):
        x, y = batch
        out = jax.vmap(model)(x)
        eqx_kfac.register_custom_loss(out, lambda o, t: jnp.sum((o - t) ** 4), targets=y)
        return jnp.mean(jnp.sum((out - y) ** 4, -1))

    optimizer = eqx_kfac.Optimizer(eqx.filter_value_and_grad(loss))
    with pytest.raises(TypeError, match="fisher_gradients.*CustomLoss"):
        optimizer.init(model, getkey(), batch)
    with pytest.raises(TypeError, match="fisher_gradients.*CustomLoss"):
        eqx_kfac.kfac_optax(loss, (model, batch))
    eqx_kfac.kfac_optax(loss, (model, batch), estimation_mode="ggn_exact")


def test_init_evaluates_no_energy_for_the_loss_checks(xla_compilations):
    # `log|psi|` is registered without targets and no loss is categorical: the loss checks have
    # nothing to compare, so `init` does not compile the energy (whose Laplacian took 1.6 s of
    # the 2.9 s `init` of `benchmarks/vmc_atoms.py`'s Li ansatz); the state's arrays, all
    # constants, are made on the host (`host_built`): `init` compiles nothing.
    optimizer = _optimizer(jax.value_and_grad(_energy(), has_aux=True))
    key = jax.random.key(1)
    optimizer.init(_PARAMS, key, _WALKERS)  # the estimator, built once
    assert xla_compilations(lambda: optimizer.init(_PARAMS, key, _WALKERS)) == 0
