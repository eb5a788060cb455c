"""Write differential reference fixtures from kfac-jax 0.0.8 (issues 5 and 6).

Run ONLY in the peer venv (jax 0.8.2 + kfac-jax + dm-haiku), never in the main venv:

    /work/peervenv/bin/python tests/reference/generate_kfac_jax_fixtures.py

It writes, next to this file,
- `kfac_jax_curvature_mlp.npz`, `kfac_jax_curvature_cnn.npz`: dense curvature matrices of
  `kfac_jax.BlockDiagonalCurvature` (K-FAC / full / diagonal blocks; `ggn_exact`, `fisher_exact`)
  after one update, and the exact GGN (which is also the exact Fisher for this loss);
- `kfac_jax_optimizer_mlp.npz`: 4 steps of `kfac_jax.Optimizer` in several settings.

Every array is described in `fixtures.md`. Everything is float64 and deterministic (no randomness
is consumed: the estimation modes are exact and the data come from fixed seeds).
The package `eqx_kfac` never imports kfac-jax; only the scripts in this folder do.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import haiku as hk  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import kfac_jax  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("ggn_exact", "fisher_exact")
BLOCK_KINDS = {
    # "kfac" is kfac-jax's default tag -> block mapping.
    "kfac": None,
    "full": {"dense": kfac_jax.DenseFull, "conv2d": kfac_jax.Conv2DFull},
    "diag": {"dense": kfac_jax.DenseDiagonal, "conv2d": kfac_jax.Conv2DDiagonal},
}


# ----------------------------------------------------------------------------------------------
# Models. The Haiku CNN transposes NHWC -> NCHW before flattening so that the Equinox twin
# (channels-first per example, `y.reshape(-1)`) feeds the dense layer the same feature order.
# ----------------------------------------------------------------------------------------------
# Non-zero biases, so that a twin which drops or misplaces a bias gives different numbers.
BIAS_INIT = hk.initializers.RandomNormal(0.5)


def mlp_logits(x, sizes):
    h = x
    for i, n in enumerate(sizes):
        h = hk.Linear(n, b_init=BIAS_INIT, name=f"linear_{i}")(h)
        if i < len(sizes) - 1:
            h = jnp.tanh(h)
    return h


def cnn_logits(x):
    h = hk.Conv2D(2, kernel_shape=3, stride=1, padding="SAME", b_init=BIAS_INIT,
                  name="conv")(x)
    h = jnp.tanh(h)
    h = jnp.transpose(h, (0, 3, 1, 2)).reshape(h.shape[0], -1)
    return hk.Linear(3, b_init=BIAS_INIT, name="linear")(h)


def make_ce_loss(logits_fn, l2_reg=0.0):
    """Mean softmax cross-entropy with its kfac-jax registration (+ l2_reg/2 * sum p^2)."""
    net = hk.without_apply_rng(hk.transform(logits_fn))

    def loss(params, batch):
        x, y = batch
        logits = net.apply(params, x)
        kfac_jax.register_softmax_cross_entropy_loss(logits, y)
        logp = jax.nn.log_softmax(logits)
        value = -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
        if l2_reg:
            value = value + 0.5 * l2_reg * sum(jnp.sum(p**2) for p in jax.tree.leaves(params))
        return value

    return net, loss


# ----------------------------------------------------------------------------------------------
# Parameter layouts
# ----------------------------------------------------------------------------------------------
def haiku_leaves(params):
    """(module, name, array) in jax.tree.leaves order of the Haiku params dict (sorted keys)."""
    return [(m, n, params[m][n]) for m in sorted(params) for n in sorted(params[m])]


def kfac_layout(estimator, params):
    """The parameter order of kfac-jax's `to_dense_matrix`.

    Blocks in estimator order; inside a block, parameters in the block's canonical order (by
    jaxpr variable creation, i.e. position in `jax.tree.leaves(params)`), so bias `b` before
    weight `w` for Haiku layers. (Block-local vectors, e.g. `multiply`, use tag order (w, b);
    `to_dense_matrix` permutes to the canonical order.)
    """
    leaves = haiku_leaves(params)
    order = [
        block_indices[j]
        for block_indices, block in zip(estimator.jaxpr.layer_indices, estimator.blocks)
        for j in block.parameters_canonical_order
    ]
    return [leaves[i] for i in order], order


def to_eqx(module, name, arr):
    """Equinox twin layout of a Haiku parameter (Linear: (out, in); Conv2d: OIHW, bias (O,1,1))."""
    if name == "w" and arr.ndim == 2:
        return arr.T
    if name == "w" and arr.ndim == 4:
        return arr.transpose(3, 2, 0, 1)
    if name == "b" and "conv" in module:
        return arr.reshape(-1, 1, 1)
    return arr


def eqx_order(layout):
    """Positions in `layout` of the Equinox twin's leaves: per layer, weight then bias."""
    modules = list(dict.fromkeys(m for m, _, _ in layout))
    pos = {(m, n): i for i, (m, n, _) in enumerate(layout)}
    return [pos[(m, n)] for m in modules for n in ("w", "b")]


def eqx_permutation(layout):
    """perm such that M_eqx = M_kfac[np.ix_(perm, perm)] for the Equinox twin layout."""
    idx, offset = [], 0
    for module, name, arr in layout:
        idx.append(np.arange(offset, offset + arr.size).reshape(arr.shape))
        offset += arr.size
    return np.concatenate([
        np.asarray(to_eqx(layout[i][0], layout[i][1], idx[i])).reshape(-1)
        for i in eqx_order(layout)
    ])


def save_params(out, layout):
    """param_{i} in kfac layout; eqx_param_{j} in the Equinox twin's leaf order and shapes."""
    for i, (_, _, arr) in enumerate(layout):
        out[f"param_{i}"] = np.asarray(arr)
    names = []
    for j, i in enumerate(eqx_order(layout)):
        module, name, arr = layout[i]
        out[f"eqx_param_{j}"] = np.asarray(to_eqx(module, name, arr))
        names.append(f"{module}.{'weight' if name == 'w' else 'bias'}")
    out["eqx_param_names"] = np.array(names)


def flat(layout_arrays):
    return np.concatenate([np.asarray(a).reshape(-1) for a in layout_arrays])


def unflat(vec, layout, params_like):
    """A Haiku-params-structured tree from a vector in kfac layout."""
    out = {m: dict(d) for m, d in params_like.items()}
    offset = 0
    for module, name, arr in layout:
        out[module][name] = jnp.asarray(vec[offset:offset + arr.size].reshape(arr.shape))
        offset += arr.size
    return out


def layout_arrays(layout):
    names = np.array([f"{m}/{n}" for m, n, _ in layout])
    shapes = np.array([",".join(str(s) for s in a.shape) for _, _, a in layout])
    sizes = np.array([a.size for _, _, a in layout])
    return names, shapes, np.concatenate([[0], np.cumsum(sizes)])


def dense_by_basis(multiply, layout, params):
    """Dense matrix of a linear map on Haiku-structured vectors, in kfac layout."""
    dim = sum(a.size for _, _, a in layout)
    multiply = jax.jit(multiply)
    cols = []
    for j in range(dim):
        e = np.zeros(dim)
        e[j] = 1.0
        out = multiply(unflat(e, layout, params))
        cols.append(flat([out[m][n] for m, n, _ in layout]))
    return np.stack(cols, axis=1)


# ----------------------------------------------------------------------------------------------
# Curvature fixtures (issue 5)
# ----------------------------------------------------------------------------------------------
def brute_force_ggn(net, params, layout, x):
    """(1/B) sum_b J_b^T (diag(p_b) - p_b p_b^T) J_b with J from jax.jacobian (kfac layout)."""

    def logits_of(vec):
        return net.apply(unflat(vec, layout, params), x)

    vec0 = flat([a for _, _, a in layout])
    jac = np.asarray(jax.jacobian(logits_of)(vec0))  # (B, C, P)
    probs = np.asarray(jax.nn.softmax(logits_of(vec0)))
    batch = x.shape[0]
    ggn = np.zeros((vec0.size, vec0.size))
    for b in range(batch):
        h = np.diag(probs[b]) - np.outer(probs[b], probs[b])
        ggn += jac[b].T @ h @ jac[b]
    return ggn / batch


def curvature_fixture(tag, logits_fn, x, y):
    net, loss = make_ce_loss(logits_fn)
    params = net.init(jax.random.PRNGKey(0), x)
    func_args = (params, (x, y))
    dense, out = {}, {}

    layout = None
    for kind, ctor_map in BLOCK_KINDS.items():
        est = kfac_jax.BlockDiagonalCurvature(
            loss, default_estimation_mode="ggn_exact", layer_tag_to_block_ctor=ctor_map
        )
        state0 = est.init(jax.random.PRNGKey(1), func_args, None, None)
        if layout is None:
            layout, order = kfac_layout(est, params)
            bounds = np.concatenate([[0], np.cumsum(est.block_dims)])
        out["block_classes_" + kind] = np.array([type(b).__name__ for b in est.blocks])
        for mode in MODES:
            state = est.update_curvature_matrix_estimate(
                state0, ema_old=0.0, ema_new=1.0, identity_weight=0.0, batch_size=x.shape[0],
                rng=jax.random.PRNGKey(2), func_args=func_args, estimation_mode=mode,
            )
            mat = np.asarray(est.to_dense_matrix(state))
            # Same matrix from products with basis vectors: checks the layout claim.
            by_basis = dense_by_basis(
                lambda v: est.multiply(state, v, 0.0, True, False, None), layout, params
            )
            np.testing.assert_allclose(mat, by_basis, rtol=1e-12, atol=1e-14)
            # A first update ignores ema_old: the moving average starts with weight 0.
            state_ema = est.update_curvature_matrix_estimate(
                state0, ema_old=0.95, ema_new=1.0, identity_weight=0.0, batch_size=x.shape[0],
                rng=jax.random.PRNGKey(2), func_args=func_args, estimation_mode=mode,
            )
            np.testing.assert_allclose(np.asarray(est.to_dense_matrix(state_ema)), mat, rtol=1e-13)
            dense[f"{kind}_{mode}"] = mat
            for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
                off_block = mat[lo:hi].copy()
                off_block[:, lo:hi] = 0.0
                assert not off_block.any()
                if kind == "diag":
                    out[f"diag_{mode}_block{i}"] = np.diag(mat[lo:hi, lo:hi]).copy()
                else:
                    out[f"{kind}_{mode}_block{i}"] = mat[lo:hi, lo:hi].copy()
            if kind == "kfac":
                for i, (block, bs) in enumerate(zip(est.blocks, state.blocks_states)):
                    out[f"kfac_{mode}_block{i}_A"] = np.asarray(bs.factors[0].value)
                    out[f"kfac_{mode}_block{i}_G"] = np.asarray(bs.factors[1].value)
                    out[f"kfac_{mode}_block{i}_weight"] = np.asarray(bs.factors[0].weight)
                    out[f"kfac_{mode}_block{i}_scale"] = np.asarray(block.scale(bs, False))

    implicit = kfac_jax.ImplicitExactCurvature(loss)
    exact_ggn = dense_by_basis(lambda v: implicit.multiply_ggn(func_args, v), layout, params)
    exact_fisher = dense_by_basis(lambda v: implicit.multiply_fisher(func_args, v), layout, params)
    brute = brute_force_ggn(net, params, layout, x)
    np.testing.assert_allclose(exact_ggn, brute, rtol=1e-10, atol=1e-13)
    # For softmax cross-entropy (canonical link) the Fisher is the GGN: only the GGN is stored.
    np.testing.assert_allclose(exact_fisher, brute, rtol=1e-10, atol=1e-13)
    out["exact_ggn"] = exact_ggn

    # Full blocks are slices of the exact matrix; diagonal blocks are diag(full).
    for mode in MODES:
        full = dense[f"full_{mode}"]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            np.testing.assert_allclose(full[lo:hi, lo:hi], exact_ggn[lo:hi, lo:hi], rtol=1e-10,
                                       atol=1e-13)
        np.testing.assert_allclose(dense[f"diag_{mode}"], np.diag(np.diag(full)), rtol=1e-10,
                                   atol=1e-14)

    names, shapes, offsets = layout_arrays(layout)
    out.update(
        x=np.asarray(x), y=np.asarray(y),
        param_names=names, param_shapes=shapes, param_offsets=offsets,
        block_offsets=bounds,
        haiku_leaf_index=np.array(order),
        eqx_perm=eqx_permutation(layout),
    )
    save_params(out, layout)
    np.savez_compressed(os.path.join(HERE, f"kfac_jax_curvature_{tag}.npz"), **out)
    return out


def curvature_fixtures():
    rng = np.random.default_rng(0)
    x_mlp = rng.standard_normal((6, 5))
    y_mlp = rng.integers(0, 3, size=6)
    curvature_fixture("mlp", lambda x: mlp_logits(x, (4, 3)), x_mlp, y_mlp)
    x_cnn = rng.standard_normal((4, 4, 4, 2))
    y_cnn = rng.integers(0, 3, size=4)
    curvature_fixture("cnn", cnn_logits, x_cnn, y_cnn)


# ----------------------------------------------------------------------------------------------
# Optimizer fixtures (issue 6)
# ----------------------------------------------------------------------------------------------
OPT_L2 = 1e-3
OPT_STEPS = 4
# Constructor arguments shared by every setting (kfac-jax 0.0.8 defaults written out where they
# matter for the result).
OPT_COMMON = dict(
    l2_reg=OPT_L2,
    estimation_mode="ggn_exact",
    inverse_update_period=1,
    curvature_update_period=1,
    curvature_ema=0.95,
    num_burnin_steps=0,
    multi_device=False,
    use_exact_inverses=False,
    norm_constraint=None,
    min_damping=1e-8,
    max_damping=float("inf"),
    include_damping_in_quad_change=False,
    damping_adaptation_decay=0.9,
    damping_lower_threshold=0.25,
    damping_upper_threshold=0.75,
    always_use_exact_qmodel_for_damping_adjustment=False,
    precon_damping_mult=1.0,
    regularized_parameters_path_exclusions="",
    exact_quad_model_matrix_type=None,
)
# name -> (constructor overrides, step kwargs)
OPT_SETTINGS = {
    "fixed": (
        dict(use_adaptive_learning_rate=False, use_adaptive_momentum=False,
             use_adaptive_damping=False, damping_adaptation_interval=5),
        dict(learning_rate=0.1, momentum=0.5, damping=0.1),
    ),
    "adaptive": (
        dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True,
             use_adaptive_damping=True, initial_damping=1.0, damping_adaptation_interval=5),
        {},
    ),
    "adaptive_dai2": (
        dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True,
             use_adaptive_damping=True, initial_damping=1.0, damping_adaptation_interval=2),
        {},
    ),
    "fixed_lr_adaptive_damping_dai2": (
        dict(use_adaptive_learning_rate=False, use_adaptive_momentum=False,
             use_adaptive_damping=True, initial_damping=1.0, damping_adaptation_interval=2),
        dict(learning_rate=0.1, momentum=0.5),
    ),
}
STAT_KEYS = ("loss", "new_loss", "learning_rate", "momentum", "damping", "precon_damping", "rho",
             "quad_model_change", "step", "data_seen")


def check_step_semantics(ctor, stats, quad, kfac_quad, t, new_damping):
    """Asserts the formulas written in fixtures.md against kfac-jax's own step statistics."""
    a, d, r, b = (np.asarray(q) for q in quad)
    damping = float(stats["damping"])
    adaptive = ctor["use_adaptive_learning_rate"]
    if adaptive:
        a_reg = a + OPT_L2 * r
        a_damped = a_reg + damping * d
        if t == 0:  # zero velocity: the last row/column of the model is zero, momentum is 0
            w = np.array([-b[0] / a_damped[0, 0], 0.0])
        else:
            w = -np.linalg.solve(a_damped, b)
        np.testing.assert_allclose([float(stats["learning_rate"]), float(stats["momentum"])],
                                   [-w[0], w[1]], rtol=1e-9, atol=1e-14)
        quad_change = 0.5 * w @ a_reg @ w + w @ b
        np.testing.assert_allclose(float(stats["quad_model_change"]), quad_change, rtol=1e-9)
    updates_damping = ctor["use_adaptive_damping"] and (
        (t + 1) % ctor["damping_adaptation_interval"] == 0)
    if updates_damping:
        if not adaptive:
            np.testing.assert_allclose(float(stats["quad_model_change"]), kfac_quad, rtol=1e-9)
        rho = (float(stats["new_loss"]) - float(stats["loss"])) / float(stats["quad_model_change"])
        np.testing.assert_allclose(float(stats["rho"]), rho, rtol=1e-9)
        factor = OPT_COMMON["damping_adaptation_decay"] ** ctor["damping_adaptation_interval"]
        if rho < OPT_COMMON["damping_lower_threshold"]:
            expected = damping / factor
        elif rho > OPT_COMMON["damping_upper_threshold"]:
            expected = damping * factor
        else:
            expected = damping
        expected = min(max(expected, OPT_COMMON["min_damping"]), OPT_COMMON["max_damping"])
        np.testing.assert_allclose(new_damping, expected, rtol=1e-12)
    else:
        assert np.isnan(float(stats["rho"])) and np.isnan(float(stats["new_loss"]))


def run_optimizer_setting(name, ctor, step_kwargs, loss, params0, batch, layout, out):
    opt = kfac_jax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss), **{**OPT_COMMON, **ctor}
    )
    prefix = name + "/"
    out[prefix + "ctor_keys"] = np.array(sorted({**OPT_COMMON, **ctor}))
    out[prefix + "ctor_values"] = np.array([repr({**OPT_COMMON, **ctor}[k])
                                            for k in sorted({**OPT_COMMON, **ctor})])
    out[prefix + "step_kwargs_keys"] = np.array(sorted(step_kwargs), dtype="<U16")
    out[prefix + "step_kwargs_values"] = np.array([step_kwargs[k] for k in sorted(step_kwargs)],
                                                  dtype=np.float64)
    params = jax.tree.map(jnp.array, params0)
    state = opt.init(params, jax.random.PRNGKey(42), batch)
    out[prefix + "init_damping"] = np.asarray(state.damping)
    est = opt._estimator
    grad_fn = jax.grad(loss)

    hist = {k: [] for k in ("params", "grad", "precon_grad", "velocity", "stats",
                                "quad_A", "quad_D", "quad_R", "quad_b", "kfac_quad_change")}
    factors = {}
    for t in range(OPT_STEPS):
        params_before = flat([params[m][n] for m, n, _ in layout])
        velocity_before = flat([state.velocities[m][n] for m, n, _ in layout])
        grads = grad_fn(params, batch)
        params, state, stats = opt.step(
            jax.tree.map(jnp.array, params), state, jax.random.PRNGKey(100 + t), batch=batch,
            **{k: jnp.asarray(v) for k, v in step_kwargs.items()},
        )
        # The step updates the curvature before preconditioning, so the returned estimator state
        # is the one its preconditioner used.
        identity_weight = OPT_L2 + float(stats["precon_damping"])
        precon = est.multiply_matpower(
            state.estimator_state, grads, identity_weight, -1.0, False, False, None
        )
        new_params = flat([params[m][n] for m, n, _ in layout])
        precon_flat = flat([precon[m][n] for m, n, _ in layout])
        lr, mom = float(stats["learning_rate"]), float(stats["momentum"])
        delta = -lr * precon_flat + mom * velocity_before
        np.testing.assert_allclose(new_params - params_before, delta, rtol=1e-9,
                                   atol=1e-12 * np.abs(delta).max())
        # Exact quadratic model over (precon_grad, previous velocity), as kfac-jax builds it.
        vel_tree = unflat(velocity_before, layout, params)
        quad = opt._compute_exact_quad_model(
            (precon, vel_tree), grads, (unflat(params_before, layout, params), batch)
        )
        # A = V^T G V with G the exact GGN of the registered loss (no l2 term) at the pre-step
        # parameters; b = V^T g with g the gradient of the full loss (l2 term included).
        ggn_v = [flat([gv[m][n] for m, n, _ in layout]) for gv in (
            opt._implicit.multiply_ggn((unflat(params_before, layout, params), batch), v)
            for v in (precon, vel_tree))]
        vecs = (precon_flat, velocity_before)
        np.testing.assert_allclose(np.asarray(quad[0]), [[u @ gv for gv in ggn_v] for u in vecs],
                                   rtol=1e-9, atol=1e-14)
        np.testing.assert_allclose(np.asarray(quad[1]), [[u @ v for v in vecs] for u in vecs],
                                   rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(np.asarray(quad[3]), [u @ flat([grads[m][n] for m, n, _ in
                                                                 layout]) for u in vecs],
                                   rtol=1e-12, atol=1e-14)
        for q_name, q in zip(("quad_A", "quad_D", "quad_R", "quad_b"), quad):
            hist[q_name].append(np.asarray(q))
        grad_flat = flat([grads[m][n] for m, n, _ in layout])
        # The K-FAC (approximate) quadratic model of the step actually taken.
        c_delta = est.multiply(state.estimator_state, unflat(delta, layout, params), 0.0, True,
                               False, None)
        kfac_quad = (0.5 * delta @ flat([c_delta[m][n] for m, n, _ in layout])
                     + 0.5 * OPT_L2 * delta @ delta + grad_flat @ delta)
        hist["kfac_quad_change"].append(kfac_quad)
        check_step_semantics(ctor, stats, quad, kfac_quad, t, float(state.damping))
        hist["params"].append(new_params)
        hist["grad"].append(grad_flat)
        hist["precon_grad"].append(precon_flat)
        hist["velocity"].append(flat([state.velocities[m][n] for m, n, _ in layout]))
        hist["stats"].append([float(stats[k]) for k in STAT_KEYS])
        for i, bs in enumerate(state.estimator_state.blocks_states):
            for j, fac in enumerate(("A", "G")):
                factors.setdefault(f"block{i}_{fac}", []).append(np.asarray(bs.factors[j].value))
            factors.setdefault(f"block{i}_weight", []).append(np.asarray(bs.factors[0].weight))
    for k, v in hist.items():
        out[prefix + k] = np.asarray(v)
    for k, v in factors.items():
        out[prefix + k] = np.asarray(v)


def optimizer_fixtures():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 6))
    y = rng.integers(0, 3, size=8)
    batch = (jnp.asarray(x), jnp.asarray(y))
    net, loss = make_ce_loss(lambda v: mlp_logits(v, (5, 4, 3)), l2_reg=OPT_L2)
    params0 = net.init(jax.random.PRNGKey(3), x)
    probe = kfac_jax.BlockDiagonalCurvature(loss, default_estimation_mode="ggn_exact")
    probe.init(jax.random.PRNGKey(0), (params0, batch), None, None)
    layout, order = kfac_layout(probe, params0)
    names, shapes, offsets = layout_arrays(layout)
    out = dict(
        x=x, y=y, l2_reg=np.float64(OPT_L2), stat_keys=np.array(STAT_KEYS),
        param_names=names, param_shapes=shapes, param_offsets=offsets,
        haiku_leaf_index=np.array(order), eqx_perm=eqx_permutation(layout),
        params0=flat([a for _, _, a in layout]),
    )
    save_params(out, layout)
    for name, (ctor, step_kwargs) in OPT_SETTINGS.items():
        run_optimizer_setting(name, ctor, step_kwargs, loss, params0, batch, layout, out)
    np.savez_compressed(os.path.join(HERE, "kfac_jax_optimizer_mlp.npz"), **out)
    return out


def main():
    curvature_fixtures()
    optimizer_fixtures()
    for f in sorted(os.listdir(HERE)):
        if f.endswith(".npz"):
            print(f, os.path.getsize(os.path.join(HERE, f)), "bytes")


if __name__ == "__main__":
    main()
