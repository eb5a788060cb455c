"""kfac-jax's `examples/optax_wrapper.py` driving `OptaxPreconditioner`, for any module `kfac_jax`.

The lines of kfac-jax HEAD's `OptaxWrapper` that touch the preconditioner (`_init_preconditioner`,
`_step`, without the statistics) are copied into `run`, which takes the `kfac_jax` module: the
generator (`generate_kfac_jax_optax_fixture.py`, peer venv) runs it with kfac-jax HEAD, and
`tests/test_kfac_jax_optax.py` with `eqx_kfac.kfac_jax`. A two-layer MLP (tanh, softmax cross-entropy
with a registered loss) on 4 devices (`jax.pmap`, 4 examples each), optax SGD with momentum after
the preconditioner's `as_gradient_transform()`. Imports neither library.
"""

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

SIZES = (6, 5, 4)  # inputs, hidden units, classes
BATCH = 16
DEVICES = 4
STEPS = 5
LEARNING_RATE, MOMENTUM = 0.1, 0.9


# Exact estimation modes only: the sampled ones draw different random numbers in each library.
CASES: Mapping[str, Mapping[str, Any]] = {
    # Approximate (pi-adjusted) inverses cached every 2 counts, fixed damping, an L2 term.
    "approx_cached": dict(estimation_mode="ggn_exact", damping=1e-2, l2_reg=1e-3, inverse_update_period=2),
    # Exact inverses without a cache, an active norm constraint. (A damping_schedule is not
    # used: kfac-jax HEAD's maybe_update then raises AttributeError, calling the schedule with
    # the estimator's state, which has no count.)
    "exact_constrained": dict(
        estimation_mode="fisher_exact", damping=1e-1, use_exact_inverses=True, inverse_update_period=1,
        norm_constraint=1e-2,
    ),
}


def problem() -> dict[str, np.ndarray]:
    """The initial parameters (`w0, b0, w1, b1`) and two batches (`x0, y0, x1, y1`), float64."""
    rng = np.random.default_rng(0)
    (n_in, n_hidden, n_out) = SIZES
    arrays = {
        "w0": rng.normal(size=(n_in, n_hidden)) / np.sqrt(n_in), "b0": rng.normal(size=n_hidden) * 0.5,
        "w1": rng.normal(size=(n_hidden, n_out)) / np.sqrt(n_hidden), "b1": rng.normal(size=n_out) * 0.5,
    }
    for i in range(2):
        arrays[f"x{i}"] = rng.normal(size=(BATCH, n_in))
        arrays[f"y{i}"] = rng.integers(0, n_out, size=BATCH)
    return arrays


def run(kfac_jax: ModuleType, case: str, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`STEPS` steps of kfac-jax's `OptaxWrapper` with an `OptaxPreconditioner` of `CASES[case]`.

    **Arguments:**

    - `kfac_jax`: kfac-jax, or `eqx_kfac.kfac_jax`.
    - `case`: a key of `CASES`.
    - `data`: `problem()`'s arrays.

    **Returns:**

    `losses` (one per step, the loss before the step) and `params` (the final parameters,
    flattened in the order `w0, b0, w1, b1`).
    """
    import jax
    import jax.numpy as jnp
    import optax

    kwargs = dict(CASES[case])
    l2_reg = kwargs.get("l2_reg", 0.0)

    def loss(params, batch):
        hidden = jnp.tanh(batch["x"] @ params["linear"]["w"] + params["linear"]["b"])
        logits = hidden @ params["linear_1"]["w"] + params["linear_1"]["b"]
        kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
        log_p = jax.nn.log_softmax(logits)
        nll = -jnp.mean(jnp.take_along_axis(log_p, batch["y"][:, None], axis=1))
        return nll + 0.5 * l2_reg * sum(jnp.sum(p**2) for p in jax.tree.leaves(params))

    preconditioner = kfac_jax.OptaxPreconditioner(loss, pmap_axis_name="batch_axis", **kwargs)
    # As OptaxWrapper.__init__ wraps `optax_optimizer_ctor(learning_rate)`.
    optimizer = optax.with_extra_args_support(
        optax.chain(preconditioner.as_gradient_transform(), optax.sgd(LEARNING_RATE, MOMENTUM))
    )

    def init(params, rng, batch):
        # OptaxWrapper._pmap_init and _init_preconditioner.
        func_args = kfac_jax.optimizer.make_func_args(params, None, rng, batch, has_state=False, has_rng=False)
        return optimizer.init(params), preconditioner.init(func_args, rng)

    def step(params, state, rng, batch):
        # OptaxWrapper._step.
        optax_state, precond_state = state
        rng_func, rng_precon = jax.random.split(rng)
        func_args = kfac_jax.optimizer.make_func_args(
            params, None, rng_func, batch, has_state=False, has_rng=False
        )
        precond_state = preconditioner.maybe_update(precond_state, func_args, rng_precon)
        precond_state = preconditioner.increment_count(precond_state)
        out, grads = jax.value_and_grad(loss)(*func_args)
        value, _, _ = kfac_jax.optimizer.extract_func_outputs(out, has_aux=False, has_state=False)
        value, grads = kfac_jax.utils.pmean_if_pmap((value, grads), axis_name=preconditioner.pmap_axis_name)
        updates, optax_state = optimizer.update(grads, optax_state, params, precond_state=precond_state)
        return optax.apply_updates(params, updates), (optax_state, precond_state), value

    devices = jax.devices()[:DEVICES]
    p_init = jax.pmap(init, axis_name="batch_axis", devices=devices)
    p_step = jax.pmap(step, axis_name="batch_axis", devices=devices)
    replicated = lambda x: jnp.stack([jnp.asarray(x)] * DEVICES)
    params = {
        "linear": {"w": replicated(data["w0"]), "b": replicated(data["b0"])},
        "linear_1": {"w": replicated(data["w1"]), "b": replicated(data["b1"])},
    }
    batches = [
        {"x": jnp.asarray(data[f"x{i}"]).reshape(DEVICES, -1, SIZES[0]),
         "y": jnp.asarray(data[f"y{i}"]).reshape(DEVICES, -1)}
        for i in range(2)
    ]
    rng = jax.random.split(jax.random.PRNGKey(0), DEVICES)
    state = p_init(params, rng, batches[0])
    losses = []
    for i in range(STEPS):
        params, state, value = p_step(params, state, rng, batches[i % 2])
        losses.append(float(value[0]))
    flat = [params[layer][name][0] for layer in ("linear", "linear_1") for name in ("w", "b")]
    return {"losses": np.array(losses), "params": np.concatenate([np.asarray(p).ravel() for p in flat])}
