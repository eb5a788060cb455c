"""Laplace approximation with a K-FAC posterior: predictive uncertainty on scikit-learn's digits.

Trains a small MLP classifier (64-64-10, tanh) with Adam, builds the K-FAC GGN of the training set
as a lineax operator (`kfac_linear_operator`), picks the prior precision by the Laplace estimate
of the marginal likelihood (which needs `logdet` of the posterior precision), then compares the
MAP network's predictions with two Laplace posterior predictives (Monte Carlo over posterior
samples drawn with `KFACLinearOperator.sample`, applied to the network itself or to its
linearisation at the MAP): accuracy, negative log-likelihood, expected
calibration error, and the predictive entropy on test digits and on out-of-distribution inputs
(the test digits with their pixels shuffled).

Run: `python benchmarks/laplace_digits.py` (CPU, under a minute). The output is shown on the
docs page "Research variants".
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_kfac
from benchmarks.harness import Method, digits, full_batch, train
from benchmarks.model_zoo.losses import cross_entropy
from benchmarks.model_zoo.tanh_mlp import TanhMLP, l2_penalty


SIZES = (64, 64, 10)
NUM_SAMPLES = 200
WEIGHT_DECAY = 1e-3


def data_loss(model, batch):
    """Mean softmax cross-entropy, registered for K-FAC (an identity at run time)."""
    x, y = batch
    return cross_entropy(jax.vmap(model)(x), y)


def objective(model, batch):
    """The trained objective: `data_loss` plus the weight decay."""
    return data_loss(model, batch) + l2_penalty(model, WEIGHT_DECAY)


def load():
    """1,200 training digits and the other 597 as the test set (a fixed shuffle)."""
    x, y = (np.asarray(a) for a in digits(jnp.float32))
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1200], y[:1200]), (x[1200:], y[1200:])


def fit(train_set, key, steps=2000):
    """The MAP network: Adam (3e-3) on the whole training set."""
    problem = full_batch("laplace_digits", TanhMLP(SIZES, key), objective, train_set)
    return train(problem, Method("adam", 3e-3), steps, keep_final=True).model


def metrics(probs, labels, bins=10):
    confidence, prediction = probs.max(1), probs.argmax(1)
    correct = prediction == labels
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.digitize(confidence, edges) - 1, 0, bins - 1)
    ece = sum(
        abs(correct[which == b].mean() - confidence[which == b].mean()) * np.mean(which == b)
        for b in range(bins)
        if np.any(which == b)
    )
    nll = -np.mean(np.log(probs[np.arange(len(labels)), labels] + 1e-12))
    return correct.mean(), nll, ece


def entropy(probs):
    return float(np.mean(-np.sum(probs * np.log(probs + 1e-12), axis=1)))


def main():
    train_set, (x_test, y_test) = load()
    model = fit(train_set, jax.random.key(0))
    num_data = len(train_set[0])
    batches = [tuple(a[i : i + 300] for a in train_set) for i in range(0, num_data, 300)]
    ggn = eqx_kfac.kfac_linear_operator(data_loss, model, batches, fisher_type="type-2")
    # The GGN of the summed training loss; the posterior precision adds the prior precision.
    likelihood = ggn.scaled(num_data)
    params = eqx.filter(model, eqx.is_inexact_array)
    flat_params = jnp.concatenate([jnp.ravel(p) for p in jax.tree.leaves(params)])
    num_params = flat_params.size
    train_nll = float(data_loss(model, train_set)) * num_data

    def log_evidence(prior):
        # Laplace: log p(D|θ*) + log N(θ*; 0, prior⁻¹ I) + (P/2) log 2π - ½ logdet(precision).
        return (
            -train_nll
            - 0.5 * prior * float(flat_params @ flat_params)
            + 0.5 * num_params * np.log(prior)
            - 0.5 * float(likelihood.damped(prior).logdet())
        )

    priors = [0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0]
    evidences = [log_evidence(p) for p in priors]
    prior = priors[int(np.argmax(evidences))]
    print(f"parameters: {num_params}, training examples: {num_data}")
    print("prior precision | log evidence (Laplace, K-FAC)")
    for p, e in zip(priors, evidences):
        print(f"{p:15g} | {e:12.1f}{'  <- chosen' if p == prior else ''}")

    samples = likelihood.sample(jax.random.key(1), prior, num_samples=NUM_SAMPLES)
    static = eqx.filter(model, eqx.is_inexact_array, inverse=True)

    def logits(p, x):
        return jax.vmap(eqx.combine(p, static))(x)

    @eqx.filter_jit
    def sampled_predictive(x):
        # The network evaluated at posterior samples θ* + δ.
        one = lambda delta: jax.nn.softmax(logits(jax.tree.map(jnp.add, params, delta), x))
        return jnp.mean(jax.vmap(one)(samples), axis=0)

    @eqx.filter_jit
    def linearised_predictive(x):
        # The network linearised at θ* (the GLM predictive of Immer et al. 2021), which matches
        # the GGN the posterior was built from.
        def one(delta):
            mean, tangent = jax.jvp(lambda p: logits(p, x), (params,), (delta,))
            return jax.nn.softmax(mean + tangent)

        return jnp.mean(jax.vmap(one)(samples), axis=0)

    shuffled = np.random.default_rng(1).permuted(x_test, axis=1)
    rows = []
    for name, fn in (
        ("MAP", lambda x: jax.nn.softmax(jax.vmap(model)(x))),
        ("Laplace, sampled network", sampled_predictive),
        ("Laplace, linearised network", linearised_predictive),
    ):
        probs = np.asarray(fn(jnp.asarray(x_test)), np.float64)
        acc, nll, ece = metrics(probs, y_test)
        ood = np.asarray(fn(jnp.asarray(shuffled)), np.float64)
        rows.append((name, acc, nll, ece, entropy(probs), entropy(ood)))
    print()
    print("| predictive | accuracy | NLL | ECE | entropy (test) | entropy (shuffled pixels) |")
    print("|---|---|---|---|---|---|")
    for name, acc, nll, ece, ent, ood in rows:
        print(f"| {name} | {acc:.3f} | {nll:.3f} | {ece:.3f} | {ent:.3f} | {ood:.3f} |")


if __name__ == "__main__":
    main()
