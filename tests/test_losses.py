"""Tests of the loss functions against independent references.

References: dense matrices of every product built with `jax.jacobian`, Hessians from `jax.hessian`
of losses written with optax / `jax.scipy.stats.norm`, and exact expectations over the model's
distribution (sums over classes, or Gauss-Hermite quadrature for normals, exact for the quadratic
dependence of the Hessian on the targets).
"""

import functools
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest
import hypothesis
from hypothesis import given, settings, strategies as st
from jax.scipy.stats import norm

import eqx_kfac as L

KINDS = ["normal", "squared_error", "normal_mean_variance", "bernoulli", "categorical", "one_hot"]
MASKABLE = {"bernoulli", "categorical", "one_hot"}
RTOL, ATOL = 1e-8, 1e-10


def _close(actual, expected, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


class Case(eqx.Module):
    """A loss and an independent reference for its per-example negative log-likelihood."""

    kind: str = eqx.field(static=True)
    loss: L.NegativeLogProbLoss
    params: dict

    def reference(self, inputs, targets):
        """Per-example loss (weighted, masked) written with optax / jax.scipy."""
        p, w = self.params, self.params["weight"]
        if self.kind == "normal":
            nll = -jnp.sum(norm.logpdf(targets, inputs[0], jnp.sqrt(p["variance"])), -1)
        elif self.kind == "squared_error":
            nll = jnp.sum((targets - inputs[0]) ** 2, -1)
        elif self.kind == "normal_mean_variance":
            nll = -jnp.sum(norm.logpdf(targets, inputs[0], jnp.sqrt(inputs[1])), -1)
        elif self.kind == "bernoulli":
            per_output = optax.sigmoid_binary_cross_entropy(inputs[0], targets)
            nll = jnp.sum(per_output * p["mask"], -1)
        elif self.kind == "categorical":
            nll = optax.softmax_cross_entropy_with_integer_labels(inputs[0], targets) * p["mask"]
        else:
            nll = optax.softmax_cross_entropy(inputs[0], targets) * p["mask"]
        return w * nll


def make_case(kind, batch_shape, d, seed, weight=1.5, masked=False):
    # The data is drawn with NumPy: JAX's random functions would compile a program for every
    # shape here.
    rng = np.random.default_rng(seed)
    if kind in {"categorical", "one_hot"}:
        d = max(d, 2)
    x = jnp.asarray(rng.normal(size=(*batch_shape, d)))
    params = {"weight": jnp.asarray(weight)}
    if kind in MASKABLE:
        mask_shape = (*batch_shape, d) if kind == "bernoulli" else batch_shape
        # A random mask that always masks the first entry, so the mask tests never pass vacuously.
        mask = rng.random(mask_shape) < 0.6
        mask[(0,) * len(mask_shape)] = False
        mask = jnp.asarray(mask if masked else np.ones(mask_shape, bool))
        params["mask"] = mask.astype(x.dtype)
        mask_arg = mask if masked else None
    if kind == "normal":
        params["variance"] = 0.7
        t = jnp.asarray(rng.normal(size=x.shape))
        loss = L.NormalMeanNegativeLogProbLoss(x, t, variance=0.7, weight=weight)
    elif kind == "squared_error":
        t = jnp.asarray(rng.normal(size=x.shape))
        loss = L.NormalMeanNegativeLogProbLoss(
            x, t, variance=0.5, weight=weight, normalize_log_prob=False
        )
    elif kind == "normal_mean_variance":
        variance = jnp.asarray(0.3 + np.exp(0.5 * rng.normal(size=x.shape)))
        t = jnp.asarray(rng.normal(size=x.shape))
        loss = L.NormalMeanVarianceNegativeLogProbLoss(x, variance, t, weight=weight)
    elif kind == "bernoulli":
        t = jnp.asarray((rng.random(x.shape) < 0.5).astype(np.float64))
        loss = L.MultiBernoulliNegativeLogProbLoss(x, t, mask=mask_arg, weight=weight)
    elif kind == "categorical":
        t = jnp.asarray(rng.integers(0, d, batch_shape))
        loss = L.CategoricalLogitsNegativeLogProbLoss(x, t, mask=mask_arg, weight=weight)
    else:
        t = jnp.asarray(np.eye(d)[rng.integers(0, d, batch_shape)])
        loss = L.OneHotCategoricalLogitsNegativeLogProbLoss(x, t, mask=mask_arg, weight=weight)
    return Case(kind, loss, params)


def _flatten(arrays):
    return jnp.concatenate([jnp.ravel(a) for a in arrays])


def _unflatten(vector, like):
    sizes = np.cumsum([a.size for a in like])[:-1]
    return tuple(p.reshape(a.shape) for p, a in zip(jnp.split(vector, sizes), like))


def dense_input_map(fn, loss):
    """Matrix of a linear map from tuples shaped like `loss.inputs` to the same."""
    n = sum(a.size for a in loss.inputs)
    return jax.jacobian(lambda v: _flatten(fn(_unflatten(v, loss.inputs))))(jnp.zeros(n))


def dense_factor(factor, inner_shape):
    n = int(np.prod(inner_shape))
    return jax.jacobian(lambda v: _flatten(factor(v.reshape(inner_shape))))(jnp.zeros(n))


def dense_factor_transpose(factor_t, loss):
    n = sum(a.size for a in loss.inputs)
    return jax.jacobian(lambda v: jnp.ravel(factor_t(_unflatten(v, loss.inputs))))(jnp.zeros(n))


def hessian_of_reference(case, targets):
    like = case.loss.inputs
    total = lambda v: jnp.sum(case.reference(_unflatten(v, like), targets))
    return jax.hessian(total)(_flatten(like))


def expected_hessian(case):
    """E_t[Hessian of the summed reference NLL] with t drawn from the model (exactly)."""
    loss = case.loss
    x = loss.inputs[0]
    d = x.shape[-1]
    if case.kind in {"normal", "squared_error", "normal_mean_variance"}:
        # Each Hessian entry depends on one target coordinate, polynomially of degree <= 2, so a
        # Gauss-Hermite rule shared by all coordinates gives every entry's expectation exactly.
        variance = case.params.get("variance", 0.5)
        if case.kind == "normal_mean_variance":
            variance = loss.variance
        nodes, weights = np.polynomial.hermite.hermgauss(3)
        targets = jnp.stack([x + jnp.sqrt(2 * variance) * z for z in nodes])
        return jnp.einsum("k,kij->ij", weights / np.sqrt(np.pi), _hessians_of_reference(case, targets))
    # Discrete targets: the Hessian is block-diagonal over examples, so the expectation weighs the
    # rows of example b, evaluated at one target value for all examples, by its probability.
    if case.kind == "bernoulli":
        probs = jax.nn.sigmoid(x)
        values = [jnp.asarray(v, x.dtype) for v in itertools.product([0, 1], repeat=d)]
        targets = [jnp.broadcast_to(v, x.shape) for v in values]
        row_probs = [jnp.prod(jnp.where(v == 1, probs, 1 - probs), -1) for v in values]
    else:
        probs = jax.nn.softmax(x)
        classes = [jnp.full(x.shape[:-1], c) for c in range(d)]
        targets = classes if case.kind == "categorical" else [jax.nn.one_hot(c, d) for c in classes]
        row_probs = [probs[..., c] for c in range(d)]
    row_weights = jnp.stack([jnp.repeat(jnp.ravel(rp), d) for rp in row_probs])
    return jnp.einsum("ki,kij->ij", row_weights, _hessians_of_reference(case, jnp.stack(targets)))


def _hessians_of_reference(case, targets):
    """`hessian_of_reference` at each of the stacked `targets` (vmapped: one Hessian in the
    compiled program instead of one per target value, up to 2³ for Bernoulli losses)."""
    return jax.vmap(lambda t: hessian_of_reference(case, t))(targets)


# Few distinct shapes (JAX compiles once per shape) but always one with an extra leading axis.
shapes = st.tuples(
    st.sampled_from([(3,), (2, 3), (1, 2)]), st.sampled_from([1, 3]), st.integers(0, 10**6)
)
cases = dict(shape=shapes, weight=st.floats(0.1, 3.0), masked=st.booleans())
# One seed for the property tests below, so that they draw the same cases and each case is
# computed (and compiled) once and checked by every property: the simplest case (one batch axis,
# one output, no mask) and a second one (with this seed and Hypothesis 6.170: batch shape (2, 3),
# three outputs, masked). (Under the suite's derandomised profile each test drew its own second
# case, so the cases were computed once per test; each property still sees two cases.)
same_cases = hypothesis.seed(9)


def _one_hot_array(shape, i):
    one_hot = np.zeros(shape)
    one_hot[..., i] = 1.0
    return jnp.asarray(one_hot)


@eqx.filter_jit
def _compute_quantities(case):
    """Everything the property tests compare, in one compiled function per case structure."""
    loss = case.loss
    out = {}
    for name in ["fisher", "ggn"]:
        inner_shape = getattr(loss, f"{name}_factor_inner_shape")
        factor = getattr(loss, f"multiply_{name}_factor")
        out[name] = {
            "B": dense_factor(factor, inner_shape),
            "Bt": dense_factor_transpose(getattr(loss, f"multiply_{name}_factor_transpose"), loss),
            "matrix": dense_input_map(getattr(loss, f"multiply_{name}"), loss),
            "one_hot": [
                (
                    getattr(loss, f"multiply_{name}_factor_replicated_one_hot")((i,)),
                    factor(_one_hot_array(inner_shape, i)),
                )
                for i in range(inner_shape[-1])
            ],
        }
    total = lambda v: jnp.sum(loss.with_inputs(_unflatten(v, loss.inputs)).evaluate())
    out["hessian"] = jax.hessian(total)(_flatten(loss.inputs))
    out["expected_hessian"] = expected_hessian(case)
    out["evaluate"] = [loss.evaluate(coefficient_mode=m) for m in ("regular", "sqrt", "off")]
    out["reference"] = case.reference(loss.inputs, loss.targets)
    out["grad"] = loss.grad_of_evaluate()
    total_reference = lambda x: jnp.sum(case.reference(x, loss.targets))
    out["reference_grad"] = jax.grad(total_reference)(loss.inputs)
    return out


@functools.cache
def quantities(kind, shape, weight, masked):
    """The case and its computed quantities, shared by the tests that draw the same case."""
    batch_shape, d, seed = shape
    case = make_case(kind, batch_shape, d, seed, weight, masked)
    return case, jax.tree.map(np.asarray, _compute_quantities(case))


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=2)
@same_cases
@given(**cases)
def test_products_equal_factor_products(kind, shape, weight, masked):
    _, q = quantities(kind, shape, weight, masked)
    for name in ["fisher", "ggn"]:
        b = q[name]["B"]
        _close(q[name]["Bt"], b.T)
        _close(q[name]["matrix"], b @ b.T)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=2)
@same_cases
@given(**cases)
def test_replicated_one_hot(kind, shape, weight, masked):
    case, q = quantities(kind, shape, weight, masked)
    inputs = case.loss.inputs
    n = int(np.prod(shape[0]))
    # Indices of each example's entries in the dense matrix (inputs flattened one by one).
    offsets = np.cumsum([0] + [a.size for a in inputs])
    index = np.concatenate(
        [np.arange(a.size).reshape(n, -1) + o for a, o in zip(inputs, offsets)], axis=1
    )
    for name in ["fisher", "ggn"]:
        pairs = q[name]["one_hot"]
        for replicated, applied in pairs:
            for r, a in zip(replicated, applied):
                _close(r, a)
        # Per example, the replicated columns span the whole per-example curvature block.
        columns = np.stack([np.concatenate(r, axis=-1).reshape(n, -1) for r, _ in pairs], -1)
        blocks = np.einsum("nic,njc->nij", columns, columns)
        expected = np.stack([q[name]["matrix"][np.ix_(ix, ix)] for ix in index])
        _close(blocks, expected)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=2)
@same_cases
@given(**cases)
def test_fisher_is_expected_hessian(kind, shape, weight, masked):
    _, q = quantities(kind, shape, weight, masked)
    _close(q["fisher"]["matrix"], q["expected_hessian"])


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=2)
@same_cases
@given(**cases)
def test_ggn_is_hessian_of_evaluate(kind, shape, weight, masked):
    _, q = quantities(kind, shape, weight, masked)
    if kind == "normal_mean_variance":
        # Its Hessian is indefinite in the variance; the GGN is defined as the Fisher.
        _close(q["ggn"]["matrix"], q["fisher"]["matrix"])
    else:
        _close(q["ggn"]["matrix"], q["hessian"])


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=2)
@same_cases
@given(**cases)
def test_evaluate_and_gradient_match_reference(kind, shape, weight, masked):
    _, q = quantities(kind, shape, weight, masked)
    regular, sqrt, off = q["evaluate"]
    assert regular.shape == shape[0]
    _close(regular, q["reference"])
    for g, r in zip(q["grad"], q["reference_grad"]):
        _close(g, r)
    _close(off * weight, regular)
    _close(sqrt * np.sqrt(weight), regular)


@pytest.mark.parametrize("kind", sorted(MASKABLE))
@settings(max_examples=2)
@same_cases
@given(shape=shapes, weight=st.floats(0.1, 3.0))
def test_masks_zero_masked_examples(kind, shape, weight):
    case, q = quantities(kind, shape, weight, True)
    mask = np.asarray(case.params["mask"])
    per_entry = mask if kind == "bernoulli" else mask[..., None]
    masked_out = np.ravel(np.broadcast_to(per_entry, case.loss.inputs[0].shape) == 0)
    for name in ["fisher", "ggn"]:
        matrix = q[name]["matrix"]
        assert np.all(matrix[masked_out] == 0) and np.all(matrix[:, masked_out] == 0)
        assert np.all(q[name]["B"][masked_out] == 0)
    assert np.all(np.ravel(q["grad"][0])[masked_out] == 0)
    if kind != "bernoulli":
        assert np.all(q["evaluate"][0][np.asarray(mask) == 0] == 0)


@eqx.filter_jit
def _all_products(loss):
    v = tuple(jnp.cos(jnp.arange(a.size).reshape(a.shape)) for a in loss.inputs)
    results = [loss.evaluate(), loss.grad_of_evaluate()]
    for name in ["fisher", "ggn"]:
        inner_shape = getattr(loss, f"{name}_factor_inner_shape")
        inner = jnp.sin(jnp.arange(np.prod(inner_shape))).reshape(inner_shape)
        results += [
            getattr(loss, f"multiply_{name}")(v),
            getattr(loss, f"multiply_{name}_factor")(inner),
            getattr(loss, f"multiply_{name}_factor_transpose")(v),
            getattr(loss, f"multiply_{name}_factor_replicated_one_hot")((0,)),
        ]
    return results


@pytest.mark.parametrize("kind", KINDS)
def test_weight_scales_everything(kind):
    w = 2.5
    base = _all_products(make_case(kind, (2, 3), 3, 0, weight=1.0).loss)
    scaled = _all_products(make_case(kind, (2, 3), 3, 0, weight=w).loss)
    # evaluate, gradient, then (product, factor, transpose, one-hot) for the Fisher and the GGN.
    coefficients = [w, w] + [w, np.sqrt(w), np.sqrt(w), np.sqrt(w)] * 2
    for b, s, c in zip(base, scaled, coefficients):
        for b_leaf, s_leaf in zip(jax.tree.leaves(b), jax.tree.leaves(s)):
            _close(s_leaf, c * b_leaf)


@eqx.filter_jit
def _sample_moments(loss, key, num):
    samples = jax.vmap(loss.sample)(jax.random.split(key, num))
    if isinstance(loss, L.CategoricalLogitsNegativeLogProbLoss):
        samples = jax.nn.one_hot(samples, loss.logits.shape[-1])
    grads_on_sample = loss.grad_of_evaluate_on_sample(key, "sqrt")
    return samples.mean(0), grads_on_sample, loss.grad_of_evaluate(loss.sample(key), "sqrt")


@pytest.mark.parametrize("kind", KINDS)
def test_sample_mean(kind, getkey):
    num = 4000
    loss = make_case(kind, (2, 3), 3, 2).loss
    mean, grads_on_sample, grads_at_sample = _sample_moments(loss, getkey(), num)
    # The model's means and variances with NumPy (eager JAX would compile each operation).
    x = np.asarray(loss.inputs[0])
    if kind in {"normal", "squared_error", "normal_mean_variance"}:
        expected_mean = x
        expected_var = {"normal": 0.7, "squared_error": 0.5}.get(kind, np.asarray(loss.inputs[-1]))
        expected_var = np.broadcast_to(expected_var, x.shape)
    else:
        if kind == "bernoulli":
            expected_mean = 1 / (1 + np.exp(-x))
        else:
            expected_mean = np.exp(x - x.max(-1, keepdims=True))
            expected_mean /= expected_mean.sum(-1, keepdims=True)
        expected_var = expected_mean * (1 - expected_mean)
    # Five standard errors per coordinate: a false failure has probability ~1e-5 per entry.
    tolerance = 5 * np.sqrt(expected_var / num)
    assert np.all(np.abs(np.asarray(mean) - expected_mean) < tolerance)
    for g, r in zip(grads_on_sample, grads_at_sample):
        _close(g, r)


@eqx.filter_jit
def _sampled_gradients_outer_product(loss, key, num):
    grads = jax.vmap(lambda k: loss.grad_of_evaluate_on_sample(k, "sqrt")[0].ravel())(
        jax.random.split(key, num)
    )
    return grads.T @ grads / num, dense_input_map(loss.multiply_fisher, loss)


def test_sampled_gradients_estimate_the_fisher(getkey):
    # E[g gᵀ] = F for gradients of the loss at targets sampled from the model.
    loss = make_case("categorical", (2,), 3, 4, weight=2.0).loss
    num = 20000
    estimate, fisher = _sampled_gradients_outer_product(loss, getkey(), num)
    # Entries of g gᵀ are bounded by 2 * weight, so 6 / sqrt(num) * 2 * weight bounds the error.
    np.testing.assert_allclose(estimate, fisher, atol=6 / np.sqrt(num) * 4.0)


class _QuadraticLoss(L.LossFunction):
    """Test-only extension: `0.5 (x - t)ᵀ A (x - t)` per example with a factor `A = C Cᵀ`."""

    input_fields = ("prediction",)
    prediction: jax.Array
    targets: jax.Array | None
    weight: jax.Array
    chol: jax.Array

    def evaluate_unweighted(self, targets):
        r = self.prediction - targets
        return 0.5 * jnp.einsum("...i,ij,...j->...", r, self.chol @ self.chol.T, r)

    @property
    def ggn_factor_inner_shape(self):
        return self.prediction.shape[:-1] + (self.chol.shape[1],)

    def multiply_ggn_factor_unweighted(self, vector):
        return (vector @ self.chol.T,)


@eqx.filter_jit
def _extension_quantities(loss):
    total = lambda v: jnp.sum(loss.with_inputs(_unflatten(v, loss.inputs)).evaluate())
    return (
        dense_factor(loss.multiply_ggn_factor, loss.ggn_factor_inner_shape),
        dense_factor_transpose(loss.multiply_ggn_factor_transpose, loss),
        dense_input_map(loss.multiply_ggn, loss),
        jax.hessian(total)(_flatten(loss.inputs)),
        loss.multiply_ggn_factor_replicated_one_hot((3,))[0],
        loss.multiply_ggn_factor(_one_hot_array(loss.ggn_factor_inner_shape, 3))[0],
    )


def test_extension_defaults_from_factor():
    keys = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(keys[0], (3, 2, 4))
    chol = jax.random.normal(keys[1], (4, 5))
    loss = _QuadraticLoss(x, jnp.zeros_like(x), jnp.asarray(1.7), chol)
    b, bt, ggn, hessian, replicated, applied = _extension_quantities(loss)
    _close(bt, b.T)
    _close(ggn, hessian)
    _close(b @ b.T, hessian)
    _close(replicated, applied)
    with pytest.raises(ValueError, match="index"):
        loss.multiply_ggn_factor_replicated_one_hot((1, 1))


@pytest.mark.parametrize("kind", KINDS)
def test_with_inputs_and_transformations(kind):
    loss = make_case(kind, (3,), 2, 6, masked=True).loss
    new = tuple(a + 1.0 for a in loss.inputs)
    copy = loss.with_inputs(new)
    assert type(copy) is type(loss)
    for c, n in zip(copy.inputs, new):
        _close(c, n)
    assert copy.targets is loss.targets and copy.weight is loss.weight
    with pytest.raises(ValueError, match="expects"):
        loss.with_inputs(new + new)
    # Losses are PyTrees: they pass through jit and vmap like any Module.
    jitted = eqx.filter_jit(lambda l: l.evaluate())(loss)
    _close(jitted, loss.evaluate())
    assert loss.dtype == jnp.float64


@pytest.fixture
def without_runtime_typecheck(monkeypatch):
    """Turns off the test-time jaxtyping checks, which would catch shape errors first, so the
    errors a user sees in normal use are tested."""
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)


def test_errors(without_runtime_typecheck):
    x = jnp.zeros((3, 4))
    with pytest.raises(ValueError, match="targets"):
        L.CategoricalLogitsNegativeLogProbLoss(x, jnp.zeros((3, 4), int))
    with pytest.raises(ValueError, match="mask"):
        L.CategoricalLogitsNegativeLogProbLoss(x, mask=jnp.ones((3, 4)))
    with pytest.raises(ValueError, match="weight"):
        L.MultiBernoulliNegativeLogProbLoss(x, weight=jnp.ones(2))
    with pytest.raises(ValueError, match="variance"):
        L.NormalMeanVarianceNegativeLogProbLoss(x, jnp.ones((3, 3)))
    with pytest.raises(ValueError, match="no targets"):
        L.NormalMeanNegativeLogProbLoss(x).evaluate()
    with pytest.raises(ValueError, match="coefficient_mode"):
        L.NormalMeanNegativeLogProbLoss(x, x).evaluate(coefficient_mode="bad")
    with pytest.raises(ValueError, match="event axis"):
        L.NormalMeanNegativeLogProbLoss(jnp.zeros(()))


CATEGORICAL = L.CategoricalLogitsNegativeLogProbLoss
ONE_HOT = L.OneHotCategoricalLogitsNegativeLogProbLoss
REGISTRATIONS = [
    ("register_softmax_cross_entropy_loss", CATEGORICAL, "int"),
    ("register_softmax_cross_entropy_loss", ONE_HOT, "onehot"),
    ("register_categorical_predictive_distribution", CATEGORICAL, None),
    ("register_categorical_predictive_distribution", ONE_HOT, "onehot"),
    ("register_sigmoid_cross_entropy_loss", L.MultiBernoulliNegativeLogProbLoss, "same"),
    ("register_multi_bernoulli_predictive_distribution", L.MultiBernoulliNegativeLogProbLoss, None),
    ("register_squared_error_loss", L.NormalMeanNegativeLogProbLoss, "same"),
    ("register_normal_predictive_distribution", L.NormalMeanNegativeLogProbLoss, "same"),
]


def _registered_losses(fn, *args):
    losses, _ = L.loss_tags_vjp(fn, params_index=0)(args)
    return list(losses)


@pytest.mark.parametrize("name, cls, targets_kind", REGISTRATIONS)
def test_register_functions(name, cls, targets_kind):
    x = jax.random.normal(jax.random.key(7), (3, 2, 4))
    targets = {
        None: None,
        "int": jnp.array([[0, 1], [2, 3], [3, 0]]),
        "onehot": jax.nn.one_hot(jnp.array([[0, 1], [2, 3], [3, 0]]), 4),
        "same": jnp.cos(x),
    }[targets_kind]
    register = getattr(L, name)
    _close(register(x, targets, weight=0.3), x)
    (loss,) = _registered_losses(lambda x, t: register(x, t, weight=0.3), x, targets)
    assert type(loss) is cls
    _close(loss.inputs[0], x)
    _close(loss.weight, 0.3)
    if targets is not None:
        _close(loss.targets, targets)
    # Gradients flow through the tag as through the identity.
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(register(x, targets))))(x)
    _close(grad, jnp.cos(x))


def test_squared_error_curvature_is_that_of_the_stated_loss():
    p = jax.random.normal(jax.random.key(8), (3, 2, 4))
    t = jnp.sin(p)
    weight = 0.7
    (loss,) = _registered_losses(
        lambda p, t: L.register_squared_error_loss(p, t, weight=weight), p, t
    )
    stated = lambda p: weight * jnp.sum((t - p) ** 2)
    _close(jnp.sum(loss.evaluate()), stated(p))

    @eqx.filter_jit
    def matrices(loss):
        hessian = jax.hessian(lambda v: stated(v.reshape(p.shape)))(p.ravel())
        return hessian, dense_input_map(loss.multiply_ggn, loss), dense_input_map(loss.multiply_fisher, loss)

    hessian, ggn, fisher = matrices(loss)
    _close(ggn, hessian)
    _close(fisher, hessian)


def test_register_errors_and_masks(without_runtime_typecheck):
    x = jnp.zeros((3, 4))
    with pytest.raises(ValueError, match="targets"):
        L.register_categorical_predictive_distribution(x, jnp.zeros((3, 4, 1)))
    mask = jnp.array([1.0, 0.0, 1.0])
    (loss,) = _registered_losses(
        lambda x, m: L.register_softmax_cross_entropy_loss(x, mask=m), x, mask
    )
    _close(loss.mask, mask)
    bernoulli_mask = jnp.ones((3, 4))
    (loss,) = _registered_losses(
        lambda x, m: L.register_sigmoid_cross_entropy_loss(x, mask=m), x, bernoulli_mask
    )
    _close(loss.mask, bernoulli_mask)
