"""The SOAP and Shampoo baselines of `benchmarks/harness` against independent references: optax's
AdamW/Adam, NumPy written out from the papers, the polar factor of a gradient, and the properties
of the eigenbasis refresh; both compile to one program and train a least-squares problem."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks.harness.shampoo import shampoo
from benchmarks.harness.soap import soap

RTOL = 1e-8


def _random_grads(rng, params, steps):
    return [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape)), params) for _ in range(steps)]


def _updates(transform, params, grads):
    """The updates of `transform` for `grads` in turn (applied to `params`), and its states."""
    state, update = transform.init(params), jax.jit(transform.update)
    updates, states = [], [state]
    for g in grads:
        u, state = update(g, state, params)
        params = optax.apply_updates(params, u)
        updates.append(u)
        states.append(state)
    return updates, states


def _close(actual, expected, rtol=RTOL):
    expected = np.asarray(expected)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=rtol, atol=rtol * np.abs(expected).max())


# SOAP


def test_soap_on_vectors_and_scalars_is_adamw():
    rng = np.random.default_rng(0)
    params = {"bias": jnp.asarray(rng.standard_normal(5)), "scale": jnp.asarray(1.5)}
    grads = _random_grads(rng, params, 6)
    hyper = dict(b1=0.9, b2=0.99, eps=1e-6, weight_decay=0.1)
    soap_updates, _ = _updates(soap(0.05, **hyper), params, grads)
    adamw_updates, _ = _updates(optax.adamw(0.05, **hyper), params, grads[1:])
    # The first update only initialises the preconditioner (none here): zero, no weight decay.
    for leaf in jax.tree.leaves(soap_updates[0]):
        assert not np.any(np.asarray(leaf))
    for ours, theirs in zip(soap_updates[1:], adamw_updates, strict=True):
        jax.tree.map(_close, ours, theirs)


def _numpy_soap_fixed_basis(params, grads, lr, b1, b2, s, eps, wd, max_dim):
    """SOAP with the eigenbases of the first gradient's factors kept throughout, in NumPy: each
    leaf as the matrix (first dimension x the rest), a side longer than `max_dim` the identity."""
    out = {}
    for name, p in params.items():
        shape = p.shape
        w = np.asarray(p).reshape(shape[0], -1)
        gs = [np.asarray(g[name]).reshape(shape[0], -1) for g in grads]
        q_l = np.linalg.eigh((1 - s) * gs[0] @ gs[0].T)[1] if w.shape[0] <= max_dim else np.eye(w.shape[0])
        q_r = np.linalg.eigh((1 - s) * gs[0].T @ gs[0])[1] if w.shape[1] <= max_dim else np.eye(w.shape[1])
        m, v, updates = np.zeros_like(w), np.zeros_like(w), [np.zeros(shape)]
        for t, g in enumerate(gs[1:], start=1):
            rotated = q_l.T @ g @ q_r
            m = b1 * m + (1 - b1) * rotated
            v = b2 * v + (1 - b2) * rotated**2
            adam = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
            u = -lr * (q_l @ adam @ q_r.T + wd * w)
            w = w + u
            updates.append(u.reshape(shape))
        out[name] = updates
    return out


def test_soap_with_a_fixed_basis_matches_numpy():
    """`precondition_frequency` beyond the steps run: the bases stay those of the first factors.
    Square 4 x 4 (factors of full rank, so the eigenbases are unique up to signs, which cancel);
    3 x 7 and 2 x 2 x 3 (as 2 x 6) with their long side over `max_precond_dim` (the identity)."""
    rng = np.random.default_rng(1)
    shapes = {"w": (4, 4), "v": (3, 7), "c": (2, 2, 3)}
    params = {name: jnp.asarray(rng.standard_normal(shape)) for name, shape in shapes.items()}
    grads = _random_grads(rng, params, 6)
    hyper = dict(b1=0.9, b2=0.95, shampoo_beta=0.8, eps=1e-8, weight_decay=0.01)
    updates, _ = _updates(soap(0.1, **hyper, precondition_frequency=100, max_precond_dim=5), params, grads)
    hyper = dict(hyper, s=hyper.pop("shampoo_beta"), wd=hyper.pop("weight_decay"))
    expected = _numpy_soap_fixed_basis(params, grads, 0.1, **hyper, max_dim=5)
    for name in params:
        for ours, theirs in zip(updates, expected[name], strict=True):
            _close(ours[name], theirs)


B1, B2 = 0.9, 0.95
SOAP_EVERY_STEP = soap(0.1, b1=B1, b2=B2, precondition_frequency=1)


def test_soap_refresh_sorts_the_basis_and_permutes_the_second_moment():
    """At a refresh, against the state before it: the columns of `Q` are sorted by estimated
    eigenvalue `diag(Q^T L Q)`, descending, `Q_new` is the QR factor of `L Q_sorted`, the second
    moment's rows and columns follow the same order, and the first moment is rotated along
    (unchanged in the original coordinates)."""
    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.standard_normal((4, 5)))}
    grads = _random_grads(rng, params, 2)
    _, states = _updates(SOAP_EVERY_STEP, params, grads)
    before = states[-1][0]
    basis = before.bases["w"]
    q_l, q_r = np.asarray(basis.q_l), np.asarray(basis.q_r)
    # A gradient along the last (smallest) directions of both bases: the order must change.
    g = 30 * np.outer(q_l[:, -1], q_r[:, -1]) + rng.standard_normal((4, 5))
    _, (after, *_) = jax.jit(SOAP_EVERY_STEP.update)({"w": jnp.asarray(g)}, states[-1], params)
    new = after.bases["w"]
    l, r = np.asarray(new.l), np.asarray(new.r)
    _close(l, B2 * np.asarray(basis.l) + (1 - B2) * g @ g.T)
    order_l = np.argsort(-np.diag(q_l.T @ l @ q_l))
    order_r = np.argsort(-np.diag(q_r.T @ r @ q_r))
    assert order_l[0] == 3 and order_r[0] == 4
    rotated = q_l.T @ g @ q_r
    nu = B2 * np.asarray(before.nu["w"]) + (1 - B2) * rotated**2
    _close(after.nu["w"], nu[order_l][:, order_r])
    for q_new, factor, q_old, order in [(new.q_l, l, q_l, order_l), (new.q_r, r, q_r, order_r)]:
        q_new = np.asarray(q_new)
        _close(q_new.T @ q_new, np.eye(len(order)))
        triangle = q_new.T @ factor @ q_old[:, order]  # the R of the QR: upper triangular
        assert np.abs(np.tril(triangle, -1)).max() < 1e-10 * np.abs(triangle).max()
    mu = B1 * np.asarray(before.mu["w"]) + (1 - B1) * rotated
    _close(np.asarray(new.q_l) @ np.asarray(after.mu["w"]) @ np.asarray(new.q_r).T, q_l @ mu @ q_r.T)


def test_soap_refreshes_track_the_eigenvectors_of_the_factors():
    """Gradients `A Z B` with a fixed `A`, `B` and Gaussian `Z`: after refreshes every step, `Q_L`
    nearly diagonalises `L`, with the estimated eigenvalues in descending order, where the first
    gradient's eigenbasis does not."""
    rng = np.random.default_rng(3)
    a = np.linalg.qr(rng.standard_normal((6, 6)))[0] * 2.0 ** -np.arange(6)
    b = np.linalg.qr(rng.standard_normal((8, 8)))[0] * 1.5 ** -np.arange(8)
    params = {"w": jnp.zeros((6, 8))}
    grads = [{"w": jnp.asarray(a @ rng.standard_normal((6, 8)) @ b.T)} for _ in range(40)]
    _, states = _updates(SOAP_EVERY_STEP, params, grads)
    first, last = states[1][0].bases["w"], states[-1][0].bases["w"]

    def off_diagonal(q, factor):
        """`Q^T P Q`'s off-diagonal norm relative to its diagonal's, and its diagonal."""
        rotated = np.asarray(q).T @ np.asarray(factor) @ np.asarray(q)
        diagonal = np.diag(rotated)
        return np.linalg.norm(rotated - np.diag(diagonal)) / np.linalg.norm(diagonal), diagonal

    for side in ("l", "r"):
        q, factor = getattr(last, "q_" + side), getattr(last, side)
        ratio, eigenvalues = off_diagonal(q, factor)
        assert ratio < 0.05, (side, ratio)
        assert np.all(np.diff(eigenvalues) < 0), eigenvalues
        assert off_diagonal(getattr(first, "q_" + side), factor)[0] > 4 * ratio


# Shampoo


def test_shampoo_first_direction_without_grafting_is_the_polar_factor():
    """At step 1 the bias-corrected factors are `G G^T` and `G^T G` (any `b2`), and with `eps`
    negligible `(G G^T)^(-1/4) G (G^T G)^(-1/4) = U V^T` (`G = U S V^T`), also for a non-square `G`."""
    rng = np.random.default_rng(4)
    params = {"tall": jnp.zeros((5, 3)), "square": jnp.zeros((4, 4))}
    grads = _random_grads(rng, params, 1)
    transform = shampoo(
        1.0, eps=1e-20, precondition_frequency=1, start_preconditioning_step=1, grafting=None
    )
    (updates,), _ = _updates(transform, params, grads)
    for name, g in grads[0].items():
        u, _, vt = np.linalg.svd(np.asarray(g), full_matrices=False)
        _close(updates[name], -u @ vt)


def _numpy_shampoo_directions(grads, b1, b2, eps, frequency, start, right=True):
    """Distributed Shampoo's (ungrafted) direction for one matrix leaf at each step, in NumPy;
    `right=False`: the right side is the identity."""

    def root(factor):
        w, v = np.linalg.eigh(factor)
        return (v * (np.maximum(w, 0) + eps) ** -0.25) @ v.T

    m_rows, n_cols = grads[0].shape
    l, r, m = np.zeros((m_rows, m_rows)), np.zeros((n_cols, n_cols)), np.zeros_like(grads[0])
    directions = []
    for t, g in enumerate(grads, start=1):
        l, r, m = b2 * l + (1 - b2) * g @ g.T, b2 * r + (1 - b2) * g.T @ g, b1 * m + (1 - b1) * g
        if t == start or (t > start and t % frequency == 0):
            root_l, root_r = root(l / (1 - b2**t)), root(r / (1 - b2**t)) if right else np.eye(n_cols)
        directions.append(root_l @ (m / (1 - b1**t)) @ root_r if t >= start else None)
    return directions


def test_shampoo_grafting_takes_adams_norm_and_shampoos_direction():
    rng = np.random.default_rng(5)
    params = {"w": jnp.zeros((4, 3)), "bias": jnp.zeros(3), "wide": jnp.zeros((3, 7))}
    grads = _random_grads(rng, params, 5)
    hyper = dict(b1=0.9, b2=0.99)
    transform = shampoo(0.1, **hyper, eps=1e-12, precondition_frequency=2, max_precond_dim=5)
    updates, _ = _updates(transform, params, grads)
    adam_updates, _ = _updates(optax.adam(0.1, **hyper, eps=1e-8), params, grads)
    jax.tree.map(_close, updates[0], adam_updates[0])  # step 1 < start_preconditioning_step = 2
    for name in ("w", "wide"):  # "wide": its right side (7 > 5) is the identity
        gs = [np.asarray(g[name]) for g in grads]
        directions = _numpy_shampoo_directions(
            gs, **hyper, eps=1e-12, frequency=2, start=2, right=name == "w"
        )
        for t in range(1, 5):
            ours, adam = np.asarray(updates[t][name]), np.asarray(adam_updates[t][name])
            _close(np.linalg.norm(ours), np.linalg.norm(adam))
            _close(ours / np.linalg.norm(ours), -directions[t] / np.linalg.norm(directions[t]))
    for ours, adam in zip(updates, adam_updates, strict=True):
        _close(ours["bias"], adam["bias"])


# Both


def _least_squares(dtype):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 64))
    y = jnp.asarray(rng.standard_normal((4, 3)) @ x + 0.5, dtype)
    x = jnp.asarray(x, dtype)
    params = {"w": jnp.zeros((4, 3), dtype), "b": jnp.zeros(4, dtype)}
    return params, lambda p: jnp.mean((p["w"] @ x + p["b"][:, None] - y) ** 2)


@pytest.mark.parametrize(
    "transform",
    [
        soap(optax.linear_schedule(0.1, 0.02, 40), precondition_frequency=5),
        shampoo(0.1, precondition_frequency=5, weight_decay=1e-4),
    ],
    ids=["soap", "shampoo"],
)
def test_compiles_to_one_program_and_trains_least_squares_in_float32(transform, xla_compilations):
    """Forty steps, across the first update and the refreshes, run one compiled program (a
    state whose dtypes or weak types changed between steps would compile another), keep float32,
    and lower the loss well below its start."""
    params, loss = _least_squares(jnp.float32)
    state = transform.init(params)

    @jax.jit
    def step(params, state):
        updates, state = transform.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    trained = []

    def train():
        p, s = params, state
        for _ in range(40):
            p, s = step(p, s)
        trained.append((p, s))

    assert xla_compilations(train) == 1
    (p, s), = trained
    for leaf in jax.tree.leaves((p, s)):
        assert leaf.dtype in (jnp.float32, jnp.int32), leaf.dtype
    assert float(loss(p)) < 0.05 * float(loss(params)), (float(loss(params)), float(loss(p)))


@pytest.mark.parametrize(
    "factory, keywords, message",
    [
        (soap, dict(b1=1.0), "b1 must be in"),
        (soap, dict(b2=-0.1), "b2 must be in"),
        (soap, dict(shampoo_beta=1.0), "shampoo_beta must be in"),
        (soap, dict(eps=-1e-8), "eps must be"),
        (soap, dict(precondition_frequency=0), "precondition_frequency must be"),
        (soap, dict(precondition_frequency=2.5), "precondition_frequency must be"),
        (soap, dict(max_precond_dim=0), "max_precond_dim must be"),
        (soap, dict(weight_decay=-0.1), "weight_decay must be"),
        (shampoo, dict(b1=-0.5), "b1 must be in"),
        (shampoo, dict(b2=1.0), "b2 must be in"),
        (shampoo, dict(eps=0.0), "eps must be"),
        (shampoo, dict(precondition_frequency=0), "precondition_frequency must be"),
        (shampoo, dict(start_preconditioning_step=0), "start_preconditioning_step must be"),
        (shampoo, dict(grafting="sgd"), "grafting must be"),
        (shampoo, dict(weight_decay=-1.0), "weight_decay must be"),
    ],
)
def test_bad_hyperparameters_raise(factory, keywords, message):
    with pytest.raises(ValueError, match=message):
        factory(1e-3, **keywords)
    with pytest.raises(ValueError, match="learning_rate must be"):
        factory(-1e-3)
