"""Losses averaged over more leading axes than the batch (issue 49): a per-token mean over
`(batch, positions)` registered with the batch convention is refused at `init` (both paths), and
`mean_over="all"` gives exactly the curvature of the per-token mean, masked or not.

References: the brute-force GGN `(1/B) Jᵀ H J` of `models.brute_force_ggn`, with `H` the Hessian
of `B` times the user's loss written out by hand (so the reference is the exact GGN of that loss);
for the categorical and Bernoulli losses the GGN is their Fisher.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest

import eqx_kfac
from models import brute_force_ggn, Problem

_B, _T, _V = 4, 3, 5
_KEYS = jax.random.split(jax.random.key(0), 4)
_MODEL = eqx.nn.Linear(2, _V, key=_KEYS[0])  # per token: one dense block, the whole GGN
_X = jax.random.normal(_KEYS[1], (_B, _T, 2))
_LABELS = jax.random.randint(_KEYS[2], (_B, _T), 0, _V)
_TARGETS = jax.random.normal(_KEYS[3], (_B, _T, _V))
_KEEP = jnp.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]], jnp.float64)  # 8 of 12 tokens
_PATHS = ("kfac_optax", "Optimizer")


def _outputs(model, x):
    return (jax.vmap(jax.vmap(model))(x),)


def _ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # (batch, positions)


def _bce(logits, targets):
    return jnp.sum(jax.nn.softplus(logits) - targets * logits, axis=-1)


def _per_token(model, batch, **kwargs):
    x, labels = batch
    logits = eqx_kfac.register_softmax_cross_entropy_loss(_outputs(model, x)[0], labels, **kwargs)
    return jnp.mean(_ce(logits, labels))


def _masked_per_token(model, batch, **kwargs):
    x, labels, keep = batch
    (logits,) = _outputs(model, x)
    eqx_kfac.register_softmax_cross_entropy_loss(logits, labels, mask=keep, **kwargs)
    return jnp.sum(keep * _ce(logits, labels)) / jnp.sum(keep)


def _build(path, loss, batch):
    """`kfac_optax` built, or `Optimizer.init` run, on a new function (estimators are cached per
    function)."""

    def fresh(p, b):
        return loss(p, b)

    if path == "kfac_optax":
        return eqx_kfac.kfac_optax(fresh, (_MODEL, batch))
    return eqx_kfac.Optimizer(eqx.filter_value_and_grad(fresh)).init(_MODEL, jax.random.key(0), batch)


@pytest.mark.parametrize("path", _PATHS)
def test_per_token_mean_is_refused_naming_the_loss_and_the_fix(path):
    with pytest.raises(ValueError) as error:
        _build(path, _per_token, (_X, _LABELS))
    message = str(error.value)
    assert "registered loss #0 (CategoricalLogitsNegativeLogProbLoss, inputs of shape (4, 3, 5))" in message
    assert "over its 3 positions per example" in message and "3 times too large" in message
    assert 'mean_over="all"' in message and "multiply its `weight` by 1/3" in message


def test_masked_mean_is_refused_with_the_count():
    with pytest.raises(ValueError) as error:
        _build("kfac_optax", _masked_per_token, (_X, _LABELS, _KEEP))
    message = str(error.value)
    assert "over its 8 unmasked examples (the mask's sum)" in message and "2 times too large" in message
    assert 'mean_over="all"' in message and "multiply its `weight` by 4 / jnp.sum(mask)" in message


def test_masked_mean_over_examples_is_refused():
    # No positions: a mean over the 2 examples the mask keeps, of 4; the curvature is too small.
    def loss(model, batch):
        x, labels, keep = batch
        logits = eqx_kfac.register_softmax_cross_entropy_loss(jax.vmap(model)(x), labels, keep)
        return jnp.sum(keep * _ce(logits, labels)) / jnp.sum(keep)

    with pytest.raises(ValueError) as error:
        _build("Optimizer", loss, (_X[:, 0], _LABELS[:, 0], jnp.array([1.0, 0.0, 1.0, 0.0])))
    message = str(error.value)
    assert "registered loss #0 (CategoricalLogitsNegativeLogProbLoss, inputs of shape (4, 5))" in message
    assert "over its 2 unmasked examples (the mask's sum)" in message and "2 times too small" in message


@pytest.mark.parametrize("path", _PATHS)
def test_legitimate_means_are_accepted(path):
    # A sum over positions averaged over the batch, plus a per-token mean registered with
    # mean_over="all", plus an L2 term: all match their registrations.
    def loss(model, batch):
        x, labels, targets = batch
        (logits,) = _outputs(model, x)
        eqx_kfac.register_softmax_cross_entropy_loss(logits, labels)
        eqx_kfac.register_squared_error_loss(logits, targets, mean_over="all")
        data = jnp.mean(jnp.sum(_ce(logits, labels), axis=1))
        squared = jnp.mean(jnp.sum((logits - targets) ** 2, axis=-1))
        l2 = 1e-3 * sum(jnp.sum(w**2) for w in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
        return data + squared + l2

    _build(path, loss, (_X, _LABELS, _TARGETS))


def test_of_several_losses_the_one_averaged_over_positions_is_named():
    def loss(model, batch):
        x, labels, targets = batch
        (logits,) = _outputs(model, x)
        eqx_kfac.register_squared_error_loss(logits, targets)
        eqx_kfac.register_softmax_cross_entropy_loss(logits, labels)
        squared = jnp.mean(jnp.sum((logits - targets) ** 2, axis=(1, 2)))
        return squared + jnp.mean(_ce(logits, labels))

    with pytest.raises(ValueError) as error:
        _build("Optimizer", loss, (_X, _LABELS, _TARGETS))
    message = str(error.value)
    assert "registered loss #1 (CategoricalLogitsNegativeLogProbLoss" in message
    assert "over its 3 positions per example" in message and "registered loss #0" not in message


def test_a_loss_summed_over_everything_is_still_refused_as_summed_over_the_batch():
    def summed(model, batch):
        return _B * _T * _per_token(model, batch)

    with pytest.raises(ValueError, match=r"4 \(the batch size\) times the mean .* sums the losses"):
        _build("Optimizer", summed, (_X, _LABELS))


def test_mean_over_must_be_batch_or_all(monkeypatch):
    # The test-time jaxtyping checks would refuse the value first: the user's error is tested.
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    with pytest.raises(ValueError, match=r"^register_squared_error_loss: `mean_over` must be"):
        eqx_kfac.register_squared_error_loss(_TARGETS, mean_over="tokens")


def _exact_curvature(problem, mode):
    # A full block on the whole batch (`ExplicitExactCurvature` calls the function per example,
    # where a masked mean's count would be the example's own).
    estimator = eqx_kfac.BlockDiagonalCurvature(
        problem.loss_fn, problem.func_args, default_estimation_mode=mode,
        layer_tag_to_block_ctor={"dense": eqx_kfac.DenseFull},
    )

    @eqx.filter_jit
    def dense(estimator, func_args):
        state = estimator.update_curvature_matrix_estimate(
            estimator.init(), 0.0, 1.0, _B, jax.random.key(0), func_args
        )
        return estimator.to_dense_matrix(state)

    return np.asarray(dense(estimator, problem.func_args))


def _problem(user_loss, register, batch) -> Problem:
    """`user_loss(outputs, batch)` is the training loss of the outputs; `register(outputs, batch)`
    registers it. The reference's summed loss is `B` times the user's loss."""

    def loss_fn(model, batch):
        (outputs,) = _outputs(model, batch[0])
        register(outputs, batch)
        return user_loss(outputs, batch)

    return Problem(_MODEL, batch, loss_fn, _outputs, lambda z, b: _B * user_loss(z[0], b))


_CASES = {
    "softmax": (
        lambda z, b: jnp.mean(_ce(z, b[1])),
        lambda z, b: eqx_kfac.register_softmax_cross_entropy_loss(z, b[1], mean_over="all"),
        (_X, _LABELS),
    ),
    "squared_error": (
        lambda z, b: 0.5 * jnp.mean(jnp.sum((z - b[1]) ** 2, axis=-1)),
        lambda z, b: eqx_kfac.register_squared_error_loss(z, b[1], weight=0.5, mean_over="all"),
        (_X, _TARGETS),
    ),
    "masked_softmax": (
        lambda z, b: jnp.sum(b[2] * _ce(z, b[1])) / jnp.sum(b[2]),
        lambda z, b: eqx_kfac.register_softmax_cross_entropy_loss(z, b[1], b[2], mean_over="all"),
        (_X, _LABELS, _KEEP),
    ),
    # A per-output mask, constant over each token's outputs: the tokens it keeps are counted.
    "masked_sigmoid": (
        lambda z, b: jnp.sum(b[2] * _bce(z, b[1])) / jnp.sum(b[2]),
        lambda z, b: eqx_kfac.register_sigmoid_cross_entropy_loss(
            z, b[1], mask=jnp.broadcast_to(b[2][..., None], z.shape), mean_over="all"
        ),
        (_X, jax.nn.sigmoid(_TARGETS), _KEEP),
    ),
}


@pytest.mark.parametrize("mode", ["ggn_exact", "fisher_exact"])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_mean_over_all_gives_the_exact_curvature_of_the_users_loss(case, mode):
    # Every case is a negative log-likelihood in natural parameters: its Fisher is its GGN.
    problem = _problem(*_CASES[case])
    expected = brute_force_ggn(problem)
    np.testing.assert_allclose(_exact_curvature(problem, mode), expected, rtol=1e-10, atol=1e-12)


def _huber(output, target):
    return jnp.sum(optax.huber_loss(output, target, delta=0.5))


def test_custom_loss_with_mean_over_all_is_exact():
    # GGN only (no predictive distribution): the per-token Hessian of the loss, scaled by 1/T.
    problem = _problem(
        lambda z, b: jnp.mean(jax.vmap(jax.vmap(_huber))(z, b[1])),
        lambda z, b: eqx_kfac.register_custom_loss(z, _huber, b[1], mean_over="all"),
        (_X, _TARGETS),
    )
    expected = brute_force_ggn(problem)
    np.testing.assert_allclose(_exact_curvature(problem, "ggn_exact"), expected, rtol=1e-10, atol=1e-12)
