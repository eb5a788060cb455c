"""Algebra of the curvature blocks, checked against dense references on random statistics."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from block_helpers import (
    dense_matpower,
    dense_spec,
    flat,
    generic_spec,
    random_data,
    random_vector,
    scale_shift_spec,
    unflat,
)
from eqx_kfac._blocks import (
    DenseDiagonal,
    DenseFull,
    DenseTwoKroneckerFactored,
    KroneckerFactored,
    NaiveDiagonal,
    NaiveFull,
    ScaleAndShiftDiagonal,
    ScaleAndShiftFull,
    ScaledIdentity,
    WeightedMovingAverage,
)

RTOL = 1e-8

BLOCKS = {
    "naive_diagonal": lambda: NaiveDiagonal(generic_spec((3,), (2, 2))),
    "naive_full": lambda: NaiveFull(generic_spec((3,), (2, 2))),
    "scaled_identity": lambda: ScaledIdentity(generic_spec((4,), (2,)), scale=2.5),
    "dense_diagonal": lambda: DenseDiagonal(dense_spec(3, 2, layout="out_in")),
    "dense_full": lambda: DenseFull(dense_spec(3, 2, extra=(2,))),
    "kfac_out_in_bias": lambda: DenseTwoKroneckerFactored(dense_spec(3, 2, layout="out_in")),
    "kfac_in_out_nobias_seq": lambda: DenseTwoKroneckerFactored(
        dense_spec(2, 3, bias=False, extra=(2,))
    ),
    "scale_shift_diagonal": lambda: ScaleAndShiftDiagonal(scale_shift_spec((3, 2, 4), (4,))),
    "scale_shift_full": lambda: ScaleAndShiftFull(scale_shift_spec((3, 2, 4), (1, 4))),
    "kfac_stacked": lambda: DenseTwoKroneckerFactored(dense_spec(2, 2, stack=2)),
    "full_stacked": lambda: DenseFull(dense_spec(2, 1, stack=3, layout="out_in")),
}

seeds = st.integers(0, 2**31 - 1)
dampings = st.floats(0.01, 1.0)


def make_state(block, seed):
    """A state with two moving-average updates of random data (so it is not a single batch)."""
    return _updated(block, block.init(None), jnp.asarray(seed, jnp.uint32))


@eqx.filter_jit
def _updated(block, state, seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    state = block.update_curvature_matrix_estimate(state, random_data(block.spec, k1), 0.0, 1.0, 3)
    return block.update_curvature_matrix_estimate(state, random_data(block.spec, k2), 0.6, 0.4, 3)


@eqx.filter_jit
def _matpower(block, state, vector, damping, power, exact, cached):
    return block.multiply_matpower(state, vector, damping, power, exact, cached)


def matpower(block, state, vector, damping, power, exact=True, cached=False):
    """`multiply_matpower`, compiled once per block and power (damping is traced)."""
    return _matpower(block, state, vector, jnp.asarray(damping), power, exact, cached)


@eqx.filter_jit
def _dense_views(block, state, damping):
    columns = jax.vmap(
        lambda e: flat(block.multiply(state, unflat(e, block.param_shapes), damping))
    )(jnp.eye(block.dim)).T
    operator_matrix = block.as_linear_operator(state, damping).as_matrix()
    return block.to_dense_matrix(state), columns, operator_matrix


def close(a, b, rtol=RTOL):
    a, b = np.asarray(flat(a) if isinstance(a, tuple) else a), np.asarray(
        flat(b) if isinstance(b, tuple) else b
    )
    scale = max(np.max(np.abs(b), initial=0.0), 1.0)
    np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale)


POWERS = (-1.0, -0.5, 0.5, 2.0, -1.5)
# (p, q) pairs: p + q stays in POWERS or is 1, so each composition reuses compiled powers.
COMPOSITIONS = ((-1.0, 0.5), (0.5, -1.0), (-0.5, -1.0), (2.0, -1.0), (0.5, 0.5))


@eqx.filter_jit
def _algebra(block, state, vector, damping):
    """Every quantity the algebra test compares, computed in one compiled function per block."""
    out = {}
    out["dense"], out["columns"], out["operator"] = _dense_views(block, state, damping)

    def power(v, p, exact=True, cached=False, s=state):
        return flat(block.multiply_matpower(s, v, damping, p, exact, cached))

    for p in (*POWERS, 1.0):
        out[f"power {p}"] = power(vector, p)
    for p, q in COMPOSITIONS:
        inner = unflat(power(vector, q), block.param_shapes)
        out[f"compose {p} {q}"] = power(inner, p)
    for exact in (True, False):
        inverse = unflat(power(vector, -1, exact), block.param_shapes)
        out[f"roundtrip {exact}"] = power(inverse, 1, exact)
    cached_state = block.update_cache(
        state, damping, exact_powers=(-1, 0.5), approx_powers=-1, eigenvalues=True
    )
    for p, exact in ((-1, True), (0.5, True), (-1, False), (1, True), (1, False)):
        out[f"cached {p} {exact}"] = power(vector, p, exact, True, cached_state)
        out[f"fresh {p} {exact}"] = power(vector, p, exact, False, cached_state)
    out["eigenvalues"] = block.eigenvalues(cached_state, use_cached=False)
    out["cached eigenvalues"] = block.eigenvalues(cached_state, use_cached=True)
    return out


@pytest.mark.parametrize("name", sorted(BLOCKS))
@settings(max_examples=6)
@given(seed=seeds, damping=dampings)
def test_block_algebra(name, seed, damping):
    """For random statistics and damping λ, with C = to_dense_matrix and v random:

    `multiply` on basis vectors, the lineax operator and `C + λI` agree; `(C + λI)^p v` matches
    an eigendecomposition reference; exact powers compose; `multiply ∘ multiply_inverse` is the
    identity (exact and approximate); cached results equal fresh ones right after
    `update_cache`; eigenvalues are those of C.
    """
    block = BLOCKS[name]()
    init = ft.partial(
        block.init, None, exact_powers_to_cache=(-1, 0.5), approx_powers_to_cache=-1,
        cache_eigenvalues=True,
    )
    state = _updated(block, init(), jnp.asarray(seed, jnp.uint32))
    vector = random_vector(block, jax.random.key(seed))
    out = _algebra(block, state, vector, jnp.asarray(damping))
    v = np.asarray(flat(vector))

    dense = np.asarray(out["dense"])
    assert dense.shape == (block.dim, block.dim)
    np.testing.assert_allclose(dense, dense.T, atol=1e-12)
    assert lx.is_positive_semidefinite(block.as_linear_operator(state, damping))
    close(out["columns"], dense + damping * np.eye(block.dim))
    close(out["operator"], out["columns"])
    for p in POWERS:
        # Powers amplify rounding by the condition number (λ ≥ 0.01: up to ~1e3) to the |p|.
        close(out[f"power {p}"], dense_matpower(dense, damping, p) @ v, rtol=1e-7)
    for p, q in COMPOSITIONS:
        close(out[f"compose {p} {q}"], out[f"power {p + q}"], rtol=1e-7)
    for exact in (True, False):
        close(out[f"roundtrip {exact}"], v)
    for p, exact in ((-1, True), (0.5, True), (-1, False), (1, True), (1, False)):
        close(out[f"cached {p} {exact}"], out[f"fresh {p} {exact}"])
    close(out["cached eigenvalues"], out["eigenvalues"])
    close(np.sort(out["eigenvalues"]), np.linalg.eigvalsh(dense))


@settings(max_examples=10)
@given(seed=seeds)
def test_kronecker_eigenvalues_are_outer_products_of_factor_eigenvalues(seed):
    block = BLOCKS["kfac_out_in_bias"]()
    state = make_state(block, seed)
    a, g = (np.asarray(f.value) for f in state.factors)
    expected = np.outer(np.linalg.eigvalsh(a), np.linalg.eigvalsh(g)).ravel()
    np.testing.assert_allclose(np.sort(block.eigenvalues(state)), np.sort(expected), atol=1e-12)
    close(block.to_dense_matrix(state)[np.ix_(range(6), range(6))],
          np.kron(g, a[:3, :3]))  # out_in weight (2, 3): rows are outputs, columns inputs


@settings(max_examples=10)
@given(
    seed=seeds, damping=dampings,
    layout=st.sampled_from(["in_out", "out_in"]), bias=st.booleans(), cached=st.booleans(),
)
def test_approximate_inverse_is_pi_adjusted(seed, damping, layout, bias, cached):
    # `(A + π√λ I)⁻¹ X (G + √λ/π I)⁻¹` on the canonical `(in + 1, out)` arrangement `X` of the
    # parameters (built here with numpy), whatever arrangement the block multiplies on.
    block = DenseTwoKroneckerFactored(dense_spec(3, 2, bias=bias, layout=layout))
    init = block.init(None, approx_powers_to_cache=-1)
    state = _updated(block, init, jnp.asarray(seed, jnp.uint32))
    if cached:
        state = block.update_cache(state, damping, approx_powers=-1)
    a, g = (np.asarray(f.value) for f in state.factors)
    pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
    inv_a = np.linalg.inv(a + pi * np.sqrt(damping) * np.eye(a.shape[0]))
    inv_g = np.linalg.inv(g + np.sqrt(damping) / pi * np.eye(g.shape[0]))
    v = random_vector(block, jax.random.key(seed))
    weight = np.asarray(v[0]) if layout == "in_out" else np.asarray(v[0]).T
    canonical = np.concatenate([weight, np.asarray(v[1])[None]], axis=0) if bias else weight
    expected = inv_a @ canonical @ inv_g
    expected_weight = expected[:3] if layout == "in_out" else expected[:3].T
    result = matpower(block, state, v, damping, -1, exact=False, cached=cached)
    close(result, (expected_weight, expected[3]) if bias else (expected_weight,))


@pytest.mark.parametrize("name", ["kfac_stacked", "full_stacked"])
def test_stacked_block_is_block_diagonal_over_slices(name):
    block = BLOCKS[name]()
    size = block.spec.stack_size
    single = type(block)(block.spec.__class__(**{**vars(block.spec), "stack_size": None}))
    data = random_data(block.spec, jax.random.key(3))
    state = block.update_curvature_matrix_estimate(block.init(None), data, 0.0, 1.0, 3)
    dense = np.asarray(block.to_dense_matrix(state))
    sizes = [int(np.prod(s)) for s in block.spec.param_shapes]
    for s in range(size):
        slice_data = jax.tree.map(lambda x: x[s], data)
        slice_data = type(data)(
            params=(), inputs=slice_data.inputs, outputs=(),
            outputs_tangent=tuple(t[:, s] for t in data.outputs_tangent),
            params_tangent=tuple(t[:, s] for t in data.params_tangent),
        )
        slice_state = single.update_curvature_matrix_estimate(
            single.init(None), slice_data, 0.0, 1.0, 3
        )
        index = np.concatenate(
            [size * sum(sizes[:k]) + s * n + np.arange(n) for k, n in enumerate(sizes)]
        )
        close(dense[np.ix_(index, index)], single.to_dense_matrix(slice_state))
        mask = np.ones(block.dim, bool)
        mask[index] = False
        np.testing.assert_array_equal(dense[np.ix_(index, np.flatnonzero(mask))], 0.0)


@settings(max_examples=20)
@given(
    ema_old=st.floats(0.0, 1.0), ema_new=st.floats(0.01, 1.0), second=st.floats(0.01, 1.0),
    seed=seeds,
)
def test_moving_average_is_bias_corrected(ema_old, ema_new, second, seed):
    x1, x2 = jax.random.normal(jax.random.key(seed), (2, 3))
    average = WeightedMovingAverage.zeros((3,), jnp.float64).update(x1, ema_old, ema_new)
    np.testing.assert_allclose(average.value, x1, rtol=1e-12)
    average = average.update(x2, ema_old, second)
    expected = (ema_old * ema_new * x1 + second * x2) / (ema_old * ema_new + second)
    np.testing.assert_allclose(average.value, expected, rtol=1e-12)
    np.testing.assert_allclose(average.weight, ema_old * ema_new + second, rtol=1e-12)


def test_generic_tag_on_kronecker_block_says_which_blocks_fit():
    spec = generic_spec((3, 2))
    with pytest.raises(ValueError) as info:
        DenseTwoKroneckerFactored(spec)
    message = str(info.value)
    for name in ("DenseTwoKroneckerFactored", "generic", "p0", "NaiveDiagonal", "NaiveFull",
                 "ScaledIdentity"):
        assert name in message
    with pytest.raises(ValueError, match="scale_and_shift"):
        ScaleAndShiftFull(dense_spec(2, 2))
    with pytest.raises(ValueError, match="weight_layout"):
        DenseFull(dense_spec(2, 2).__class__(**{**vars(dense_spec(2, 2)), "meta": ()}))


def test_use_cached_without_cache_raises():
    block = BLOCKS["kfac_out_in_bias"]()
    state = make_state(block, 0)
    v = random_vector(block, jax.random.key(0))
    with pytest.raises(ValueError, match="exact_powers_to_cache"):
        block.multiply_inverse(state, v, 0.1, exact_power=True, use_cached=True)
    with pytest.raises(ValueError, match="approx_powers_to_cache"):
        block.update_cache(state, 0.1, approx_powers=-1)


@pytest.mark.parametrize("block_cls", [DenseTwoKroneckerFactored, DenseFull])
def test_singular_statistics_fall_back_without_nan(block_cls):
    # One example without bias: rank-one factors, so Cholesky of the undamped factors fails.
    block = block_cls(dense_spec(3, 2, bias=False, batch=1))
    state = block.init(None, exact_powers_to_cache=-1, approx_powers_to_cache=-1)
    data = random_data(block.spec, jax.random.key(0), num_vectors=1)
    state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, 1)
    state = block.update_cache(state, 0.0, exact_powers=-1, approx_powers=-1)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))
    v = random_vector(block, jax.random.key(1))
    # The exact undamped inverse of a singular matrix is infinite (so is Full's cached one, an
    # eigendecomposition); the Cholesky-based inverses must fall back to floored eigenvalues.
    for cached in (True, False) if block_cls is DenseTwoKroneckerFactored else (False,):
        result = block.multiply_inverse(state, v, 0.0, exact_power=False, use_cached=cached)
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in result)


@pytest.mark.parametrize(
    "spec",
    [dense_spec(0, 1, bias=True), dense_spec(1, 1, bias=False), dense_spec(2, 0, bias=True)],
    ids=["in0_bias_1x1A", "1x1_both", "out0"],
)
@pytest.mark.parametrize("block_cls", [DenseTwoKroneckerFactored, DenseFull, DenseDiagonal])
def test_zero_size_and_one_by_one_factors(spec, block_cls):
    block = block_cls(spec)
    state = block.init(None, exact_powers_to_cache=-1, approx_powers_to_cache=-1,
                       cache_eigenvalues=True)
    state = block.update_curvature_matrix_estimate(
        state, random_data(spec, jax.random.key(0)), 0.0, 1.0, 3
    )
    state = block.update_cache(state, 0.5, exact_powers=-1, approx_powers=-1, eigenvalues=True)
    v = random_vector(block, jax.random.key(1))
    dense = np.asarray(block.to_dense_matrix(state)) + 0.5 * np.eye(block.dim)
    for exact in (True, False):
        inv = block.multiply_inverse(state, v, 0.5, exact_power=exact, use_cached=True)
        close(dense @ np.asarray(flat(inv)), flat(v))
    assert block.eigenvalues(state, use_cached=True).shape == (block.dim,)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))


def test_kronecker_is_an_extension_point():
    assert issubclass(DenseTwoKroneckerFactored, KroneckerFactored)
    with pytest.raises(TypeError):
        KroneckerFactored(dense_spec(2, 2))
