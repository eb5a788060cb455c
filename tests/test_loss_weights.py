"""Per-example loss weights: every product of every loss, and both optimizer paths.

References: a loss with one weight per example equals, product by product, the losses of its
examples taken one at a time with their own scalar weights; and a squared error weighted by `w`
equals the unweighted squared error of `sqrt(w) * prediction` against `sqrt(w) * targets` (the
same loss, gradient and GGN), so `Optimizer` and `kfac_optax` take the same steps on both.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_kfac

_SHAPE = (3, 2, 4)  # (batch, positions, event): the weight has shape (3,), the leading batch axis.
_WEIGHT = jnp.array([0.5, 2.0, 1.5])


def _huber(output, target):
    return jnp.sum(optax.huber_loss(output, target))


def _loss(kind, inputs, weight):
    keys = jax.random.split(jax.random.key(1), 2)
    targets = jax.random.normal(keys[0], _SHAPE)
    if kind == "normal":
        return eqx_kfac.NormalMeanNegativeLogProbLoss(inputs, targets, variance=0.7, weight=weight)
    if kind == "normal_variance":
        variance = jnp.exp(jax.random.normal(keys[1], _SHAPE))
        return eqx_kfac.NormalMeanVarianceNegativeLogProbLoss(inputs, variance, targets, weight=weight)
    if kind == "bernoulli":
        return eqx_kfac.MultiBernoulliNegativeLogProbLoss(inputs, jax.nn.sigmoid(targets), weight=weight)
    if kind == "categorical":
        labels = jax.random.randint(keys[1], _SHAPE[:-1], 0, _SHAPE[-1])
        return eqx_kfac.CategoricalLogitsNegativeLogProbLoss(inputs, labels, weight=weight)
    if kind == "one_hot":
        return eqx_kfac.OneHotCategoricalLogitsNegativeLogProbLoss(inputs, jax.nn.softmax(targets), weight=weight)
    return eqx_kfac.CustomLoss(inputs, _huber, targets, weight=weight)


def _slice(loss, b):
    """Example `b` of `loss` (keeping a batch axis of one) with its scalar weight."""
    sliced = jax.tree.map(lambda x: x[b : b + 1] if x.ndim else x, eqx.filter(loss, eqx.is_array))
    sliced = eqx.combine(sliced, eqx.filter(loss, eqx.is_array, inverse=True))
    return eqx.tree_at(lambda loss: loss.weight, sliced, loss.weight[b])


@eqx.filter_jit
def _products(loss, vectors, factor_vector, samples):
    """Every weighted quantity of a loss, a dict of arrays and tuples with the batch axis first."""
    out = {
        "evaluate": loss.evaluate(),
        "evaluate_sqrt": loss.evaluate(coefficient_mode="sqrt"),
        "grad": loss.grad_of_evaluate(),
        "ggn": loss.multiply_ggn(vectors),
        "ggn_factor": loss.multiply_ggn_factor(factor_vector),
        "ggn_factor_t": loss.multiply_ggn_factor_transpose(vectors),
        "ggn_one_hot": loss.multiply_ggn_factor_replicated_one_hot((1,)),
    }
    if isinstance(loss, eqx_kfac.NegativeLogProbLoss):
        out.update(
            fisher=loss.multiply_fisher(vectors),
            fisher_factor=loss.multiply_fisher_factor(factor_vector),
            fisher_factor_t=loss.multiply_fisher_factor_transpose(vectors),
            fisher_one_hot=loss.multiply_fisher_factor_replicated_one_hot((1,)),
            # The gradient at sampled targets (the `fisher_gradients` mode), weighted by sqrt(w).
            sampled=loss.grad_of_evaluate(samples, coefficient_mode="sqrt"),
        )
    return out


@pytest.mark.parametrize("kind", ["normal", "normal_variance", "bernoulli", "categorical", "one_hot", "custom"])
def test_every_product_weights_each_example(kind):
    inputs = jax.random.normal(jax.random.key(0), _SHAPE)
    loss = _loss(kind, inputs, _WEIGHT)
    keys = jax.random.split(jax.random.key(3), len(loss.inputs) + 1)
    vectors = tuple(jax.random.normal(k, x.shape) for k, x in zip(keys, loss.inputs))
    factor_vector = jax.random.normal(keys[-1], loss.ggn_factor_inner_shape)
    # Sampling per example would draw other noise: sample the batch once and slice the targets.
    samples = loss.sample(jax.random.key(2)) if isinstance(loss, eqx_kfac.NegativeLogProbLoss) else None
    got = _products(loss, vectors, factor_vector, samples)
    one = lambda x, b: None if x is None else x[b : b + 1]  # noqa: E731
    per_example = [
        _products(
            _slice(loss, b), tuple(one(v, b) for v in vectors), one(factor_vector, b), one(samples, b)
        )
        for b in range(_SHAPE[0])
    ]
    expected = jax.tree.map(lambda *xs: jnp.concatenate(xs), *per_example)
    for name in got:
        for value, reference in zip(jax.tree.leaves(got[name]), jax.tree.leaves(expected[name]), strict=True):
            np.testing.assert_allclose(value, reference, rtol=1e-10, atol=1e-12, err_msg=name)


def test_weight_of_the_wrong_shape_is_refused_at_registration():
    with pytest.raises(ValueError, match=r"one weight per example.*\(5,\).*got shape \(4,\)"):
        eqx_kfac.register_squared_error_loss(jnp.ones((5, 3)), weight=jnp.ones(4))
    with pytest.raises(ValueError, match="one weight per example"):
        eqx_kfac.register_softmax_cross_entropy_loss(jnp.ones((5, 3)), weight=jnp.ones((5, 3)))


# ------------------------------------------------------------------------------------------------
# The optimizers: a weighted squared error against the same loss written with rescaled outputs.

_X = jax.random.normal(jax.random.key(5), (8, 3))
_T = jax.random.normal(jax.random.key(6), (8, 2))
_W = jnp.linspace(0.25, 2.0, 8)


def _weighted(m, batch):
    x, t, w = batch
    y = eqx_kfac.register_squared_error_loss(jax.vmap(m)(x), t, weight=w)
    return jnp.mean(w * jnp.sum((y - t) ** 2, axis=-1))


def _weighted_per_example(m, batch):
    # Registered inside `vmap`, as Equinox code does: the scalar weights become a (batch,) weight.
    def one(x, t, w):
        y = eqx_kfac.register_squared_error_loss(m(x), t, weight=w)
        return w * jnp.sum((y - t) ** 2)

    return jnp.mean(jax.vmap(one)(*batch))


def _rescaled(m, batch):
    x, t, w = batch
    root = jnp.sqrt(w)[:, None]
    y = eqx_kfac.register_squared_error_loss(root * jax.vmap(m)(x), root * t)
    return jnp.mean(jnp.sum((y - root * t) ** 2, axis=-1))


def _model():
    return eqx.nn.MLP(3, 2, 5, 1, activation=jnp.tanh, key=jax.random.key(7))


def _optimizer_run(loss):
    optimizer = eqx_kfac.Optimizer(
        eqx.filter_value_and_grad(loss), l2_reg=1e-3, refresh=eqx_kfac.RefreshSchedule(inverse_update_period=1)
    )
    model, batch, key = _model(), (_X, _T, _W), jax.random.key(8)
    state = optimizer.init(model, key, batch)
    losses = []
    for _ in range(3):
        model, state, stats = optimizer.step(model, state, key, batch=batch)
        losses.append(stats["loss"])
    return model, losses


def _optax_run(loss):
    model, batch = _model(), (_X, _T, _W)
    optimizer = eqx_kfac.kfac_optax(loss, (model, batch), inverse_update_period=1)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state):
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params, batch=batch, key=jax.random.key(8))
        return eqx.apply_updates(model, updates), opt_state, value

    losses = []
    for _ in range(3):
        model, opt_state, value = step(model, opt_state)
        losses.append(value)
    return model, losses


# The case (registered per example inside `vmap`) for `Optimizer`, the batch form for optax.
@pytest.mark.parametrize("run, loss", [(_optimizer_run, _weighted_per_example), (_optax_run, _weighted)])
def test_optimizers_take_the_steps_of_the_rescaled_loss(run, loss):
    reference, reference_losses = run(_rescaled)
    model, losses = run(loss)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-10)
    leaves = [jax.tree.leaves(eqx.filter(m, eqx.is_inexact_array)) for m in (model, reference)]
    for a, b in zip(*leaves, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-12)
    assert reference_losses[-1] < reference_losses[0]
