"""kfac-jax-style block classes adapted by `eqx_kfac.kfac_jax`: FermiNet's `RepeatedDenseBlock`
and `QmcBlockedDense` (copied from FermiNet HEAD, written against `eqx_kfac.kfac_jax`) give the
factors of kfac-jax's formulas, computed here with NumPy, and the steps those factors imply;
what cannot be adapted is refused at registration."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_kfac
import eqx_kfac.kfac_jax as kfac_jax

vmap_matmul = jax.vmap(jnp.matmul, in_axes=(0, 0), out_axes=0)


class RepeatedDenseBlock(kfac_jax.DenseTwoKroneckerFactored):
    """FermiNet HEAD's block, verbatim but for the annotations."""

    def fixed_scale(self):
        (x_shape,) = self.inputs_shapes
        return float(kfac_jax.utils.product(x_shape) // (x_shape[0] * x_shape[-1]))

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new, identity_weight, batch_size):
        [x] = estimation_data.primals.inputs
        [dy] = estimation_data.tangents.outputs
        assert x.shape[0] == batch_size
        estimation_data = dataclasses.replace(
            estimation_data,
            primals=dataclasses.replace(estimation_data.primals, inputs=(x.reshape([-1, x.shape[-1]]),)),
            tangents=dataclasses.replace(estimation_data.tangents, outputs=(dy.reshape([-1, dy.shape[-1]]),)),
        )
        batch_size = x.size // x.shape[-1]
        return super().update_curvature_matrix_estimate(
            state=state, estimation_data=estimation_data, ema_old=ema_old, ema_new=ema_new,
            identity_weight=identity_weight, batch_size=batch_size,
        )


class QmcBlockedDense(kfac_jax.KroneckerFactored):
    """FermiNet HEAD's block, verbatim but for the annotations, the unused `input_size` /
    `output_size`, `WeightedMovingAverage` taken from `kfac_jax.curvature_blocks` (the same
    class as FermiNet's `kfac_jax.utils.WeightedMovingAverage`), and the
    `vmap` in `_update_cache`: FermiNet's, `jax.vmap(pi_adjusted_kronecker_inverse, (0, None),
    (0, 0))`, maps the scalar `damping` keyword (vmap maps keywords over axis 0) and not the
    outputs factor, and fails under kfac-jax HEAD too (whose `KroneckerFactored.State` has no
    `inputs_factor` since 2023)."""

    def fixed_scale(self):
        return float(self.parameters_shapes[0][1])

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new, identity_weight, batch_size):
        del identity_weight
        [x] = estimation_data.primals.inputs
        [dy] = estimation_data.tangents.outputs
        assert batch_size == x.shape[0]
        normalizer = x.shape[0] * x.shape[1]
        inputs_cov = jnp.einsum("bijk,bijl->jkl", x, x) / normalizer
        dy = jnp.reshape(dy, dy.shape[:-2] + (-1,))
        outputs_cov = jnp.einsum("bijk,bijl->jkl", dy, dy) / normalizer
        state.inputs_factor.update(inputs_cov, ema_old, ema_new)
        state.outputs_factor.update(outputs_cov, ema_old, ema_new)
        return state

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        del rng, cache_eigenvalues
        k, m, j, n = self.parameters_shapes[0]
        cache = dict()
        if exact_powers_to_cache:
            raise NotImplementedError("Caching of exact powers is not yet implemented for QmcBlockedDense.")
        for power in approx_powers_to_cache:
            if power != -1:
                raise NotImplementedError(f"Approximations for power {power} is not yet implemented.")
            cache[str(power)] = dict(inputs_factor=jnp.zeros([j, k, k]), outputs_factor=jnp.zeros([j, m * n, m * n]))
        average = kfac_jax.curvature_blocks.WeightedMovingAverage
        return kfac_jax.KroneckerFactored.State(
            cache=cache,
            inputs_factor=average.zeros_array((j, k, k)),
            outputs_factor=average.zeros_array((j, m * n, m * n)),
        )

    def _update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues):
        del eigenvalues
        if exact_powers:
            raise NotImplementedError("Caching of exact powers is not yet implemented for QmcBlockedDense.")
        for power in approx_powers:
            if power != -1:
                raise NotImplementedError(f"Approximations for power {power} is not yet implemented.")
            cache = state.cache[str(power)]
            pi_adjusted_inverse = jax.vmap(
                lambda a, g: kfac_jax.utils.pi_adjusted_kronecker_inverse(a, g, damping=identity_weight)
            )
            cache["inputs_factor"], cache["outputs_factor"] = pi_adjusted_inverse(
                state.inputs_factor.value, state.outputs_factor.value
            )
        return state

    def multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        w, = vector
        v = w
        k, m, j, n = v.shape
        if power == 1:
            v = jnp.transpose(v, [2, 0, 1, 3]).reshape([j, k, m * n])
            v = vmap_matmul(state.inputs_factor.value, v)
            v = vmap_matmul(v, state.outputs_factor.value)
            v = jnp.transpose(v.reshape([j, k, m, n]), [1, 2, 0, 3])
            v = v + identity_weight * w
        elif exact_power:
            raise NotImplementedError("Exact powers is not yet implemented for QmcBlockedDense.")
        else:
            if not use_cached:
                raise NotImplementedError("Caching of exact powers is not yet implemented for QmcBlockedDense.")
            v = jnp.transpose(v, [2, 0, 1, 3]).reshape([j, k, m * n])
            v = vmap_matmul(state.cache[str(power)]["inputs_factor"], v)
            v = vmap_matmul(v, state.cache[str(power)]["outputs_factor"])
            v = jnp.transpose(v.reshape([j, k, m, n]), [1, 2, 0, 3])
        return (v,)


def _pi_adjusted(a: np.ndarray, g: np.ndarray, damping: float) -> tuple[np.ndarray, np.ndarray]:
    """kfac-jax's pi-adjusted damped inverse factors (average-trace norm)."""
    pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
    root = np.sqrt(damping)
    return np.linalg.inv(a + pi * root * np.eye(len(a))), np.linalg.inv(g + root / pi * np.eye(len(g)))


def _repeated_problem(key):
    k = jax.random.split(key, 5)
    batch, repeats, n_in, n_out = 5, 3, 4, 2
    params = {
        "w": jax.random.normal(k[0], (n_in, n_out)),
        "b": jax.random.normal(k[1], (n_out,)),
        "head": jax.random.normal(k[2], (n_out, 2)),
    }
    batch_data = (jax.random.normal(k[3], (batch, repeats, n_in)), jax.random.normal(k[4], (batch, 2)))

    def loss(p, data):
        x, y = data
        pre = kfac_jax.register_dense(x @ p["w"] + p["b"], x, p["w"], p["b"], variant="repeated_dense")
        out = jnp.tanh(pre).sum(1) @ p["head"]
        kfac_jax.register_squared_error_loss(out, y)
        return jnp.mean(jnp.sum((out - y) ** 2, -1))

    return params, batch_data, loss


def _estimate(loss, params, data, ctors, approx_powers):
    estimator = kfac_jax.BlockDiagonalCurvature(loss, (params, data), layer_tag_to_block_ctor=ctors, on_unmatched="ignore")
    state = estimator.init(jax.random.key(0), approx_powers_to_cache=approx_powers)
    batch = data[0].shape[0]
    state = estimator.update_curvature_matrix_estimate(
        state, 0.0, 1.0, batch, jax.random.key(1), (params, data), estimation_mode="ggn_exact"
    )
    (index,) = [i for i, b in enumerate(estimator.blocks) if isinstance(b, kfac_jax.curvature_blocks.KfacJaxBlock)]
    return estimator, state, index


def _steps(estimator, state, vector, damping, products):
    """The products `(power, exact_power, use_cached)` after `update_cache(damping)` caches the
    inverse, in one compiled program."""

    @jax.jit
    def run(state):
        state = estimator.update_cache(state, damping, approx_powers=-1)
        return [estimator.multiply_matpower(state, vector, damping, *product) for product in products]

    return run(state)


def test_repeated_dense_block_factors_and_steps():
    params, (x, y), loss = _repeated_problem(jax.random.key(3))
    estimator, state, index = _estimate(loss, params, (x, y), {"repeated_dense": RepeatedDenseBlock}, -1)
    batch, repeats, _ = x.shape
    # kfac-jax's formulas on the repeats flattened into the batch: A = x̃ᵀx̃ / (B T); the exact
    # GGN's output vectors sqrt(2) e_v (kfac-jax's squared error is Σ (out - y)², its GGN 2 I) give
    # dy_v = sqrt(2) (1 - tanh²(pre)) head[:, v], and G = Σ_v dy_vᵀdy_v / (B T).
    xs = np.asarray(x).reshape(batch * repeats, -1)
    xs = np.concatenate([xs, np.ones((len(xs), 1))], axis=1)
    a = xs.T @ xs / (batch * repeats)
    pre = np.asarray(x @ params["w"] + params["b"]).reshape(batch * repeats, -1)
    g = 2 * sum((dy := (1 - np.tanh(pre) ** 2) * np.asarray(params["head"])[:, v]).T @ dy for v in range(2)) / (batch * repeats)
    factors = state.block_states[index].state.factors
    np.testing.assert_allclose(factors[0].value, a, rtol=1e-8)
    np.testing.assert_allclose(factors[1].value, g, rtol=1e-8)

    vector = jax.tree.map(lambda p: jnp.ones_like(p) * jnp.arange(p.size).reshape(p.shape), params)
    canonical = np.concatenate([np.asarray(vector["w"]), np.asarray(vector["b"])[None]])
    damping, scale = 0.3, float(repeats)  # the block's fixed scale: the repeats
    exact = np.linalg.solve(scale * np.kron(a, g) + damping * np.eye(len(a) * len(g)), canonical.reshape(-1))
    inv_a, inv_g = _pi_adjusted(a, g, damping / scale)
    approx = inv_a @ canonical @ inv_g / scale
    steps = _steps(estimator, state, vector, damping, ((-1, True, False), (-1, False, False), (-1, False, True)))
    for step, expected in zip(steps, (exact.reshape(canonical.shape), approx, approx)):
        np.testing.assert_allclose(np.concatenate([step["w"], step["b"][None]]), expected, rtol=1e-8)


def test_qmc_block_factors_and_steps():
    """FermiNet's full-envelope layer `y = einsum("bijk,kmjn->bijmn", x, w)`, registered as
    `register_dense(y, x, w, variant="qmc")` with its n-d weight, gets `QmcBlockedDense`'s
    per-`j` factors; its cached inverse and its product are the ones those factors give."""
    k = jax.random.split(jax.random.key(4), 4)
    batch, i, j, kk, m, n = 4, 2, 3, 2, 2, 2
    params = {"w": jax.random.normal(k[0], (kk, m, j, n)), "head": jax.random.normal(k[1], (j, m, n, 2))}
    data = (jax.random.normal(k[2], (batch, i, j, kk)), jax.random.normal(k[3], (batch, 2)))

    def loss(p, data):
        x, y = data
        out = kfac_jax.register_dense(jnp.einsum("bijk,kmjn->bijmn", x, p["w"]), x, p["w"], variant="qmc")
        out = jnp.einsum("bijmn,jmno->bo", jnp.tanh(out), p["head"])
        kfac_jax.register_squared_error_loss(out, y)
        return jnp.mean(jnp.sum((out - y) ** 2, -1))

    estimator, state, index = _estimate(loss, params, data, {"qmc": QmcBlockedDense}, -1)
    x, w, head = (np.asarray(a) for a in (data[0], params["w"], params["head"]))
    a = np.einsum("bijk,bijl->jkl", x, x) / (batch * i)
    slope = 1 - np.tanh(np.einsum("bijk,kmjn->bijmn", x, w)) ** 2
    dys = [np.sqrt(2) * (slope * head[..., v]).reshape(batch, i, j, m * n) for v in range(2)]
    g = sum(np.einsum("bijk,bijl->jkl", dy, dy) for dy in dys) / (batch * i)
    block_state = state.block_states[index].state
    np.testing.assert_allclose(block_state.inputs_factor.value, a, rtol=1e-8)
    np.testing.assert_allclose(block_state.outputs_factor.value, g, rtol=1e-8)

    damping = 0.3
    vector = jax.tree.map(lambda p: jnp.ones_like(p) * jnp.arange(p.size).reshape(p.shape), params)
    canonical = np.transpose(np.asarray(vector["w"]), (2, 0, 1, 3)).reshape(j, kk, m * n)
    # update_cache divides the damping by the fixed scale (m); the block's product does not scale.
    inverses = [_pi_adjusted(a[s], g[s], damping / m) for s in range(j)]
    expected = {
        -1: np.stack([inv_a @ canonical[s] @ inv_g for s, (inv_a, inv_g) in enumerate(inverses)]),
        1: np.stack([a[s] @ canonical[s] @ g[s] for s in range(j)]) + damping * canonical,
    }
    for step, power in zip(_steps(estimator, state, vector, damping, ((-1, False, True), (1, True, True))), (-1, 1)):
        np.testing.assert_allclose(np.transpose(step["w"], (2, 0, 1, 3)).reshape(j, kk, m * n), expected[power], rtol=1e-8)
