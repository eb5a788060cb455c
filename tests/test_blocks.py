"""Curvature blocks against closed forms on random statistics (their algebraic laws, for every
built-in block, are checked by `eqx_kfac.testing.check_block` in `test_testing_kit.py`)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from block_helpers import (
    dense_spec,
    flat_numpy,
    generic_spec,
    random_data,
    random_vector,
)
from eqx_kfac import (
    DenseDiagonal,
    DenseFull,
    DenseTwoKroneckerFactored,
    KroneckerFactored,
    ScaleAndShiftFull,
    WeightedMovingAverage,
)
from eqx_kfac.testing import block_state, dense_spec

RTOL = 1e-8


def kfac_block():
    return DenseTwoKroneckerFactored(dense_spec(3, 2, layout="out_in"))


seeds = st.integers(0, 2**31 - 1)
dampings = st.floats(0.01, 1.0)


def make_state(block, seed, **init_kwargs):
    """A state with two moving-average updates of random data (so it is not a single batch)."""
    return block_state(block, jax.random.key(seed), **init_kwargs)


@eqx.filter_jit
def _eigenvalues_and_dense(block, state):
    # One program (shared by all examples) instead of dozens of eager operations.
    return block.eigenvalues(state), block.to_dense_matrix(state)


def close(a, b, rtol=RTOL):
    a, b = np.asarray(flat_numpy(a) if isinstance(a, tuple) else a), np.asarray(
        flat_numpy(b) if isinstance(b, tuple) else b
    )
    scale = max(np.max(np.abs(b), initial=0.0), 1.0)
    np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale)


@settings(max_examples=10)
@given(seed=seeds)
def test_kronecker_eigenvalues_are_outer_products_of_factor_eigenvalues(seed):
    block = kfac_block()
    state = make_state(block, seed)
    a, g = (np.asarray(f.value) for f in state.factors)
    expected = np.outer(np.linalg.eigvalsh(a), np.linalg.eigvalsh(g)).ravel()
    eigenvalues, dense = _eigenvalues_and_dense(block, state)
    np.testing.assert_allclose(np.sort(eigenvalues), np.sort(expected), atol=1e-12)
    close(np.asarray(dense)[np.ix_(range(6), range(6))],
          np.kron(g, a[:3, :3]))  # out_in weight (2, 3): rows are outputs, columns inputs


@eqx.filter_jit
def _approximate_inverse(block, state, vector, damping, cached):
    """The approximate inverse, after a cache refresh with `damping` if `cached`, and the state it
    used (one program per block and `cached`; `damping` is traced)."""
    if cached:
        state = block.update_cache(state, damping, approx_powers=-1)
    return state, block.multiply_matpower(state, vector, damping, -1, False, cached)


@settings(max_examples=10)
@given(
    seed=seeds, damping=dampings,
    layout=st.sampled_from(["in_out", "out_in"]), bias=st.booleans(), cached=st.booleans(),
)
def test_approximate_inverse_is_pi_adjusted(seed, damping, layout, bias, cached):
    # `(A + π√λ I)⁻¹ X (G + √λ/π I)⁻¹` on the canonical `(in + 1, out)` arrangement `X` of the
    # parameters (built here with numpy), whatever arrangement the block multiplies on.
    block = DenseTwoKroneckerFactored(dense_spec(3, 2, bias=bias, layout=layout))
    v = random_vector(block, jax.random.key(seed))
    state, result = _approximate_inverse(
        block, make_state(block, seed, approx_powers_to_cache=-1), v, jnp.asarray(damping), cached
    )
    a, g = (np.asarray(f.value) for f in state.factors)
    pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
    inv_a = np.linalg.inv(a + pi * np.sqrt(damping) * np.eye(a.shape[0]))
    inv_g = np.linalg.inv(g + np.sqrt(damping) / pi * np.eye(g.shape[0]))
    weight = np.asarray(v[0]) if layout == "in_out" else np.asarray(v[0]).T
    canonical = np.concatenate([weight, np.asarray(v[1])[None]], axis=0) if bias else weight
    expected = inv_a @ canonical @ inv_g
    expected_weight = expected[:3] if layout == "in_out" else expected[:3].T
    close(result, (expected_weight, expected[3]) if bias else (expected_weight,))


@jax.jit
def _two_updates(key, ema_old, ema_new, second):
    # One program for all examples (the coefficients are traced) instead of eager operations.
    x1, x2 = jax.random.normal(key, (2, 3))
    first = WeightedMovingAverage.zeros((3,), jnp.float64).update(x1, ema_old, ema_new)
    return x1, x2, first, first.update(x2, ema_old, second)


@settings(max_examples=20)
@given(
    ema_old=st.floats(0.0, 1.0), ema_new=st.floats(0.01, 1.0), second=st.floats(0.01, 1.0),
    seed=seeds,
)
def test_moving_average_is_bias_corrected(ema_old, ema_new, second, seed):
    x1, x2, average, updated = _two_updates(jax.random.key(seed), ema_old, ema_new, second)
    np.testing.assert_allclose(average.value, x1, rtol=1e-12)
    average = updated
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
    block = kfac_block()
    state = make_state(block, 0)
    v = random_vector(block, jax.random.key(0))
    with pytest.raises(ValueError, match="exact_powers_to_cache"):
        block.multiply_inverse(state, v, 0.1, exact_power=True, use_cached=True)
    with pytest.raises(ValueError, match="approx_powers_to_cache"):
        block.update_cache(state, 0.1, approx_powers=-1)


@eqx.filter_jit
def _refreshed_and_inverses(block, data, damping, v, cached_options, eigenvalues=False):
    """A fresh state updated with `data`, its caches refreshed with `damping`, and the
    approximate and exact inverses of `v` (approximate only for `eigenvalues=False`), cached or
    not per `cached_options`: one program instead of dozens of eager operations."""
    state = block.init(None, exact_powers_to_cache=-1, approx_powers_to_cache=-1,
                       cache_eigenvalues=eigenvalues)
    state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, block.spec.input_shapes[0][0])
    state = block.update_cache(state, damping, exact_powers=-1, approx_powers=-1, eigenvalues=eigenvalues)
    exacts = (False, True) if eigenvalues else (False,)
    inverses = {
        (exact, cached): block.multiply_inverse(state, v, damping, exact_power=exact, use_cached=cached)
        for exact in exacts for cached in cached_options
    }
    extra = (block.eigenvalues(state, use_cached=True), block.to_dense_matrix(state)) if eigenvalues else ()
    return state, inverses, extra


@pytest.mark.parametrize("block_cls", [DenseTwoKroneckerFactored, DenseFull])
def test_singular_statistics_fall_back_without_nan(block_cls):
    # One example without bias: rank-one factors, so Cholesky of the undamped factors fails.
    block = block_cls(dense_spec(3, 2, bias=False, batch=1))
    data = random_data(block.spec, jax.random.key(0), num_vectors=1)
    v = random_vector(block, jax.random.key(1))
    # The exact undamped inverse of a singular matrix is infinite (so is Full's cached one, an
    # eigendecomposition); the Cholesky-based inverses must fall back to floored eigenvalues,
    # or, in a cache refresh, keep the previous (zero) inverse.
    cached_options = (True, False) if block_cls is DenseTwoKroneckerFactored else (False,)
    state, inverses, _ = _refreshed_and_inverses(block, data, 0.0, v, cached_options)
    # (Checked with NumPy: `jnp.isfinite` would compile a program per leaf shape.)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state))
    for result in inverses.values():
        assert all(np.all(np.isfinite(np.asarray(x))) for x in result)


@pytest.mark.parametrize(
    "spec",
    [dense_spec(0, 1, bias=True), dense_spec(1, 1, bias=False), dense_spec(2, 0, bias=True)],
    ids=["in0_bias_1x1A", "1x1_both", "out0"],
)
@pytest.mark.parametrize("block_cls", [DenseTwoKroneckerFactored, DenseFull, DenseDiagonal])
def test_zero_size_and_one_by_one_factors(spec, block_cls):
    block = block_cls(spec)
    v = random_vector(block, jax.random.key(1))
    state, inverses, (eigenvalues, dense) = _refreshed_and_inverses(
        block, random_data(spec, jax.random.key(0)), 0.5, v, (True,), eigenvalues=True
    )
    dense = np.asarray(dense) + 0.5 * np.eye(block.dim)
    for inv in inverses.values():  # exact and approximate, cached
        close(dense @ np.asarray(flat_numpy(inv)), flat_numpy(v))
    assert eigenvalues.shape == (block.dim,)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state))


def test_kronecker_is_an_extension_point():
    assert issubclass(DenseTwoKroneckerFactored, KroneckerFactored)
    with pytest.raises(TypeError):
        KroneckerFactored(dense_spec(2, 2))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(meta=(("has_bias", True), ("weight_layout", "rows"))), "weight_layout must be 'in_out' or 'out_in', got 'rows'"),
        (dict(param_shapes=((3,), (2,))), r"expected a weight and a bias, got parameter shapes \(\(3,\), \(2,\)\)"),
        (dict(input_shapes=()), "expected one input and one output"),
    ],
)
def test_a_malformed_dense_spec_is_refused_with_what_is_wrong(change, message):
    spec = dataclasses.replace(dense_spec(3, 2), **change)
    with pytest.raises(ValueError, match=rf"DenseTwoKroneckerFactored cannot handle the dense layer .*{message}"):
        DenseTwoKroneckerFactored(spec)
