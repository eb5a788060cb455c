"""Tests for `eqx_kfac._curvature.operators` and `eqx_kfac._curvature.solvers.kronecker` against
dense numpy references (internal on purpose: the factor-wise damped powers and pi-adjusted
inverses under the public operators and blocks).

Random PSD factors are built as `Q diag(s) Qᵀ` with controlled eigenvalues `s`, so each test can
state the conditioning its tolerance relies on.
"""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from eqx_kfac._curvature.operators import kronecker_powers as KR, spectral as S, structured as O
from eqx_kfac._curvature.solvers import kronecker as LS


PSD = lx.positive_semidefinite_tag


def _psd(rng, n, low=-2.0, high=1.0, rank=None):
    """A random PSD matrix with eigenvalues 10**uniform(low, high) (the last n - rank are zero)."""
    q, _ = np.linalg.qr(rng.normal(size=(n, n))) if n > 0 else (np.zeros((0, 0)), None)
    s = 10.0 ** rng.uniform(low, high, size=n)
    if rank is not None:
        s[rank:] = 0.0
    return (q * s) @ q.T


def _dense_kron(factors):
    return ft.reduce(np.kron, [np.asarray(f) for f in factors])


def _block_diag(matrices):
    rows = sum(m.shape[0] for m in matrices)
    cols = sum(m.shape[1] for m in matrices)
    out = np.zeros((rows, cols))
    r = c = 0
    for m in matrices:
        out[r : r + m.shape[0], c : c + m.shape[1]] = m
        r, c = r + m.shape[0], c + m.shape[1]
    return out


def _rel(a, b):
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), np.finfo(float).tiny)


# Every shape is a program of its own (traced and compiled), so shapes come from a small set
# that later examples reuse: one, two and three factors, one of size 1, and an empty product
# (the functions under test treat a factor of size 1 like any other); values and dampings vary
# freely.
seeds = st.integers(0, 2**32 - 1)
positive_dims = st.sampled_from([(3,), (2, 3), (2, 1, 3)])
dims = st.one_of(positive_dims, st.just((0, 2)))
dampings = st.floats(-6.0, 3.0).map(lambda e: 10.0**e)
rect_shapes = st.sampled_from([((2, 3),), ((3, 2), (1, 2)), ((2, 2), (0, 3)), ((1, 1), (2, 3), (3, 1))])


def _kron_op(rng, ns, **kwargs):
    factors = [jnp.asarray(_psd(rng, n, **kwargs)) for n in ns]
    return O.KroneckerOperator(factors, PSD), factors


# The operators themselves


@jax.jit
def _products(op, v, w):
    """Everything the operator tests compare, in one program per shape."""
    return op.as_matrix(), op.mv(v), op.T.mv(w), op.T.as_matrix(), lx.diagonal(op)


@given(seed=seeds, shapes=rect_shapes)
def test_kronecker_mv_as_matrix_and_transpose_match_dense_kron(seed, shapes):
    rng = np.random.default_rng(seed)
    factors = [jnp.asarray(rng.normal(size=s)) for s in shapes]
    op = O.KroneckerOperator(factors)
    dense = _dense_kron(factors)
    v = rng.normal(size=tuple(n for _, n in shapes))
    w = rng.normal(size=tuple(m for m, _ in shapes))
    assert op.in_structure() == jax.ShapeDtypeStruct(v.shape, jnp.float64)
    assert op.out_structure() == jax.ShapeDtypeStruct(w.shape, jnp.float64)
    matrix, mv, transpose_mv, transpose, diagonal = _products(op, jnp.asarray(v), jnp.asarray(w))
    np.testing.assert_allclose(matrix, dense, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(mv.ravel(), dense @ v.ravel(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(transpose_mv.ravel(), dense.T @ w.ravel(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(transpose, dense.T, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(diagonal, np.diagonal(dense), rtol=1e-12, atol=1e-12)


def test_kronecker_construction_errors_and_tags():
    with pytest.raises(ValueError, match="at least one factor"):
        O.KroneckerOperator([])
    with pytest.raises(ValueError, match=r"factors\[1\]"):
        O.KroneckerOperator([jnp.eye(2), jnp.ones(3)])
    op = O.KroneckerOperator([jnp.eye(2), 2 * jnp.eye(3)], PSD)
    assert op.T is op
    assert lx.is_symmetric(op) and lx.is_positive_semidefinite(op)
    assert not lx.is_negative_semidefinite(op) and not lx.is_diagonal(op)
    assert lx.is_diagonal(O.KroneckerOperator([jnp.eye(2)], lx.diagonal_tag))
    plain = O.KroneckerOperator([jnp.ones((2, 2), dtype=jnp.int32)])
    assert plain.in_structure().dtype == jnp.float64
    assert not lx.is_symmetric(plain) and not lx.is_positive_semidefinite(plain)
    # A symmetric tag needs matching input and output structures (lineax's own check).
    with pytest.raises(ValueError):
        O.KroneckerOperator([jnp.ones((2, 3))], lx.symmetric_tag)


block_dims = st.sampled_from([((3,), (2,)), ((2, 2), (0,), (1, 3))])


@given(seed=seeds, ns=block_dims)
def test_block_diagonal_matches_dense_block_diag(seed, ns):
    rng = np.random.default_rng(seed)
    blocks, dense_blocks, vectors = [], [], []
    for i, block_dims in enumerate(ns):
        if i % 2 == 0:
            op, factors = _kron_op(rng, block_dims)
            dense_blocks.append(_dense_kron(factors))
        else:
            m = _psd(rng, sum(block_dims))
            op = lx.MatrixLinearOperator(jnp.asarray(m), PSD)
            dense_blocks.append(m)
        blocks.append(op)
        vectors.append(jnp.asarray(rng.normal(size=op.in_structure().shape)))
    op = O.BlockDiagonalOperator(blocks)
    dense = _block_diag(dense_blocks)
    flat = np.concatenate([np.asarray(v).ravel() for v in vectors])
    matrix, out, transpose_out, transpose, diagonal = _products(op, tuple(vectors), tuple(vectors))
    np.testing.assert_allclose(matrix, dense, rtol=1e-12, atol=1e-12)
    for got in (out, transpose_out):
        got_flat = np.concatenate([np.asarray(o).ravel() for o in got])
        np.testing.assert_allclose(got_flat, dense @ flat, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(transpose, dense.T, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(diagonal, np.diagonal(dense), rtol=1e-12, atol=1e-12)
    assert op.in_structure() == tuple(b.in_structure() for b in blocks)
    assert lx.is_symmetric(op) and lx.is_positive_semidefinite(op)


def test_block_diagonal_errors_and_mixed_properties():
    with pytest.raises(ValueError, match="at least one block"):
        O.BlockDiagonalOperator([])
    with pytest.raises(TypeError):
        O.BlockDiagonalOperator([jnp.eye(2)])
    psd, plain = lx.MatrixLinearOperator(jnp.eye(2), PSD), lx.MatrixLinearOperator(jnp.eye(2))
    op = O.BlockDiagonalOperator([psd, plain])
    assert not lx.is_symmetric(op) and not lx.is_positive_semidefinite(op)
    with pytest.raises(ValueError, match="tuple of 2"):
        op.mv((jnp.ones(2),))


# Lineax's own functions on our operators


def test_lineax_functions_on_kronecker_and_block_diagonal():
    rng = np.random.default_rng(0)
    kron, factors = _kron_op(rng, [2, 3], low=-1.0)
    matrix = lx.MatrixLinearOperator(jnp.asarray(_psd(rng, 3, low=-1.0)), PSD)
    block = O.BlockDiagonalOperator([kron, matrix])
    for op in (kron, block):
        dense = np.asarray(op.as_matrix())
        assert lx.materialise(op) is op or eqx.tree_equal(lx.materialise(op), op)
        assert eqx.tree_equal(lx.linearise(op), op)
        np.testing.assert_allclose(lx.conj(op).as_matrix(), dense)
        main, lower, upper = lx.tridiagonal(op)
        np.testing.assert_allclose(main, np.diagonal(dense))
        np.testing.assert_allclose(lower, np.diagonal(dense, -1))
        np.testing.assert_allclose(upper, np.diagonal(dense, 1))
        for check in (lx.is_diagonal, lx.is_tridiagonal, lx.has_unit_diagonal, lx.is_lower_triangular,
                      lx.is_upper_triangular, lx.is_negative_semidefinite):
            assert check(op) is False
        b = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape)), op.out_structure())
        x = lx.linear_solve(op, b, solver=lx.Cholesky()).value
        flat_x = np.concatenate([np.asarray(leaf).ravel() for leaf in jax.tree.leaves(x)])
        flat_b = np.concatenate([np.asarray(leaf).ravel() for leaf in jax.tree.leaves(b)])
        # Eigenvalues lie in [1e-2, 1e2] (cond <= 1e4): the residual is at rounding level.
        np.testing.assert_allclose(dense @ flat_x, flat_b, rtol=1e-10, atol=1e-10)


# Damped exact solves and powers


@jax.jit
def _damped_solves(op, v, damping):
    """The damped solve from the factors, from their precomputed eigendecompositions and through
    lineax, in one program per shape (the damping is traced, so examples share it)."""
    damped = op + damping * lx.IdentityLinearOperator(op.in_structure())
    return (
        KR.kronecker_damped_solve(op, v, damping),
        KR.kronecker_damped_solve(KR.kronecker_eigh(op), v, damping),
        lx.linear_solve(damped, v, solver=LS.KroneckerEigenSolver()).value,
    )


@given(seed=seeds, ns=dims, damping=dampings)
def test_damped_exact_solve_inverts_kron_plus_damping(seed, ns, damping):
    rng = np.random.default_rng(seed)
    # Some factors are rank-deficient: the damping alone keeps the system invertible.
    factors = [jnp.asarray(_psd(rng, n, rank=rng.integers(0, n + 1))) for n in ns]
    op = O.KroneckerOperator(factors, PSD)
    v = rng.normal(size=tuple(ns))
    dense = _dense_kron(factors) + damping * np.eye(v.size)
    solves = _damped_solves(op, jnp.asarray(v), damping)
    x, from_eigh, via_lineax = (np.asarray(r).ravel() for r in solves)
    if v.size == 0:
        assert x.shape == (0,)
        return
    # Backward error is independent of conditioning: a stable solve leaves a residual of a few
    # ulps of ‖A‖‖x‖, far below 1e-8 for these sizes (N <= 64).
    residual = np.linalg.norm(dense @ x - v.ravel())
    assert residual <= 1e-8 * np.linalg.norm(dense, 2) * np.linalg.norm(x)
    # Forward error grows with the condition number (up to ~1e9 for λ = 1e-6): compare with
    # numpy's solve to cond * 1e-13, which is 1e-8 relative for well-conditioned draws.
    cond = np.linalg.cond(dense)
    assert _rel(x, np.linalg.solve(dense, v.ravel())) <= max(1e-8, 1e-13 * cond)
    # Precomputed eigendecompositions give the same result, as does lineax with our solver.
    np.testing.assert_allclose(from_eigh, x, rtol=1e-12, atol=0)
    np.testing.assert_allclose(via_lineax, x, rtol=1e-12, atol=0)


@jax.jit
def _composed_and_once(op, v, damping, p, q, p_plus_q):
    # Traced powers (one program per shape): `kronecker_damped_matpower` takes its general
    # branch, as it does for these Python floats (only a literal -1 is special-cased).
    eigh = KR.kronecker_eigh(op)
    first = KR.kronecker_damped_matpower(eigh, v, damping, p)
    both = KR.kronecker_damped_matpower(eigh, first, damping, q)
    return both, KR.kronecker_damped_matpower(op, v, damping, p_plus_q)


@given(seed=seeds, ns=dims, damping=dampings, p=st.floats(-1.5, 1.5), q=st.floats(-1.5, 1.5))
def test_damped_powers_compose(seed, ns, damping, p, q):
    rng = np.random.default_rng(seed)
    # Factor eigenvalues in [0.5, 2] so the damped product's eigenvalues span a ratio r <= 64
    # (three factors, any λ). Rounding after the first power is amplified by at most
    # r^(|p|+|q|) <= 64^3 ≈ 2.6e5 relative to the result, i.e. ~1e-10 at double precision.
    op, factors = _kron_op(rng, ns, low=np.log10(0.5), high=np.log10(2.0))
    v = jnp.asarray(rng.normal(size=tuple(ns)))
    both, once = _composed_and_once(op, v, damping, p, q, p + q)
    if v.size == 0:
        return
    assert _rel(both, once) <= 1e-8
    vals, vecs = np.linalg.eigh(_dense_kron(factors) + damping * np.eye(v.size))
    dense_power = (vecs * vals ** (p + q)) @ vecs.T
    assert _rel(np.asarray(once).ravel(), dense_power @ np.asarray(v).ravel()) <= 1e-8


def test_damped_solve_under_jit_and_grad_matches_dense():
    rng = np.random.default_rng(1)
    op, factors = _kron_op(rng, [3, 2], low=-1.0)
    v = jnp.asarray(rng.normal(size=(3, 2)))
    dense = _dense_kron(factors)
    structure = op.in_structure()

    @jax.jit
    def solve(factors, damping):
        damped = O.KroneckerOperator(factors, PSD) + damping * lx.IdentityLinearOperator(structure)
        return jnp.sum(lx.linear_solve(damped, v, solver=LS.KroneckerEigenSolver()).value ** 2)

    # With x = (D + λI)⁻¹ v: d/dλ ‖x‖² = -2 xᵀ (D + λI)⁻¹ x.
    damped = dense + 0.1 * np.eye(6)
    x = np.linalg.solve(damped, np.asarray(v).ravel())
    np.testing.assert_allclose(solve(op.factors, 0.1), np.sum(x**2), rtol=1e-10)
    grad = jax.grad(solve, argnums=1)(op.factors, 0.1)
    np.testing.assert_allclose(grad, -2 * x @ np.linalg.solve(damped, x), rtol=1e-8)


def test_solver_rejects_other_operators_and_wrong_shapes():
    op = O.KroneckerOperator([jnp.eye(2)])  # not PSD-tagged
    structure = op.in_structure()
    with pytest.raises(ValueError, match="positive_semidefinite_tag"):
        lx.linear_solve(
            op + lx.IdentityLinearOperator(structure), jnp.ones(2), solver=LS.KroneckerEigenSolver()
        )
    psd = O.KroneckerOperator([jnp.eye(2)], PSD)
    with pytest.raises(ValueError, match="KroneckerPiAdjustedSolver"):
        lx.linear_solve(
            psd + lx.MatrixLinearOperator(jnp.eye(2)), jnp.ones(2),
            solver=LS.KroneckerPiAdjustedSolver(),
        )
    with pytest.raises(ValueError, match="one axis per factor"):
        KR.kronecker_damped_solve(psd, jnp.ones(3), 1.0)
    # A scaled K has no known sign under lineax's tracing; the damping may be written freely.
    with pytest.raises(ValueError, match="unscaled"):
        lx.linear_solve(
            2.0 * psd + lx.IdentityLinearOperator(structure), jnp.ones(2),
            solver=LS.KroneckerEigenSolver(),
        )
    identity = lx.IdentityLinearOperator(structure)
    damped = psd - (identity * 0.5) / 2.0 + identity
    x = lx.linear_solve(damped, jnp.ones(2), solver=LS.KroneckerEigenSolver()).value
    np.testing.assert_allclose(x, jnp.ones(2) / 1.75, rtol=1e-12)


# Pi-adjusted approximate inverse


@jax.jit
def _pi_adjusted_and_solve(op, v, damping):
    damped = op + damping * lx.IdentityLinearOperator(op.in_structure())
    via_lineax = lx.linear_solve(damped, v, solver=LS.KroneckerPiAdjustedSolver()).value
    return KR.pi_adjusted_inverse(op, damping).as_matrix(), via_lineax


# One compilation per shape of the grid (the damping is traced); 8 examples cover the grid.
@settings(max_examples=8)
@given(seed=seeds, n_a=st.sampled_from([2, 4]), n_g=st.sampled_from([3, 4]), damping=dampings)
def test_pi_adjusted_two_factors_equals_closed_form(seed, n_a, n_g, damping):
    rng = np.random.default_rng(seed)
    a, g = _psd(rng, n_a), _psd(rng, n_g)
    v = rng.normal(size=(n_a, n_g))
    pi = np.sqrt((np.trace(a) / n_a) / (np.trace(g) / n_g))
    closed = np.kron(np.linalg.inv(a + pi * np.sqrt(damping) * np.eye(n_a)),
                     np.linalg.inv(g + np.sqrt(damping) / pi * np.eye(n_g)))
    op = O.KroneckerOperator([jnp.asarray(a), jnp.asarray(g)], PSD)
    approx, via_lineax = _pi_adjusted_and_solve(op, jnp.asarray(v), damping)
    # Each damped factor has eigenvalues >= min(eig) + damping share >= ~1e-5, cond <= ~1e6:
    # inverses are accurate to ~1e-10 relative.
    assert _rel(approx, closed) <= 1e-8
    assert _rel(via_lineax, closed @ v.ravel()) <= 1e-8


@jax.jit
def _pi_adjusted_parts(factors, damping):
    """The damped factors, the inverse and the square root, in one program per shape."""
    return (
        KR.pi_adjusted_damped_factors(factors, damping),
        KR.pi_adjusted_inverse(factors, damping).as_matrix(),
        KR.pi_adjusted_inverse(factors, damping, power=0.5).as_matrix(),
    )


@settings(max_examples=10)
@given(seed=seeds, ns=st.sampled_from([(1,), (3,), (1, 1), (2, 1, 3), (2, 2, 1, 3)]), damping=dampings)
def test_pi_adjusted_k_factors_equals_closed_form(seed, ns, damping):
    rng = np.random.default_rng(seed)
    factors = [_psd(rng, n) for n in ns]
    means = np.array([np.trace(f) / f.shape[0] for f in factors])
    big = [i for i, n in enumerate(ns) if n > 1]
    scalar = np.prod([factors[i][0, 0] for i, n in enumerate(ns) if n == 1])
    if big:
        # Damping t_i (λ/s)^(1/m) / geomean(t) for the m larger factors; their product is λ/s.
        geo = np.exp(np.mean(np.log(means[big])))
        shares = {i: means[i] * (damping / scalar) ** (1 / len(big)) / geo for i in big}
        assert np.isclose(np.prod(list(shares.values())) * scalar, damping, rtol=1e-10)
        closed = scalar * _dense_kron([factors[i] + shares[i] * np.eye(ns[i]) if i in shares else np.ones((1, 1))
                                       for i in range(len(ns))])
    else:
        closed = np.array([[scalar + damping]])
    damped, inverse, powered = _pi_adjusted_parts([jnp.asarray(f) for f in factors], damping)
    assert _rel(_dense_kron(damped), closed) <= 1e-10
    assert _rel(inverse, np.linalg.inv(closed)) <= 1e-8
    vals, vecs = np.linalg.eigh(closed)
    assert _rel(powered, (vecs * np.sqrt(vals)) @ vecs.T) <= 1e-8


@jax.jit
def _inversions(factors, damping):
    """`_block_spd_inverse` of the first factor (no fallback) and the factors of the public
    `pi_adjusted_inverse`, in one program per shape (eagerly, the fallback's `cond` would compile
    at every call)."""
    return KR._block_spd_inverse(factors[0]), KR.pi_adjusted_inverse(factors, damping).factors


def test_pi_adjusted_zero_factor_and_single_large_factor_are_exact():
    rng = np.random.default_rng(2)
    g = _psd(rng, 3)
    # A zero factor makes the product zero: the approximation is λ I, exactly.
    _, inverse = _inversions([jnp.zeros((2, 2)), jnp.asarray(g)], 0.5)
    np.testing.assert_allclose(_dense_kron(inverse), np.eye(6) / 0.5, rtol=1e-12)
    assert np.all(np.isfinite(_dense_kron(inverse)))
    # A 1x1 factor only scales the other one, so the damped product is exact.
    _, inverse = _inversions([jnp.asarray([[3.0]]), jnp.asarray(g)], 0.5)
    expected = np.linalg.inv(3 * g + 0.5 * np.eye(3))
    np.testing.assert_allclose(_dense_kron(inverse), expected, rtol=1e-10)


# NaN safety


def test_singular_damped_factor_falls_back_to_finite_inverse():
    # λ = 0 with a rank-deficient factor: Cholesky breaks down; the eigh fallback floors the
    # zero eigenvalue instead, giving a finite generalised inverse (A X A = A).
    a = np.array([[1.0, 1.0], [1.0, 1.0]])
    (inverse,) = _inversions([jnp.asarray(a)], 0.0)[1]
    assert np.all(np.isfinite(inverse))
    np.testing.assert_allclose(a @ np.asarray(inverse) @ a, a, atol=1e-8)


@jax.jit
def _inversions_and_refresh(factors, damping, previous):
    # Both cases share this program (same shapes, traced damping).
    return *_inversions(factors, damping), KR.refreshed_inverse_factors(factors, damping, previous)


@pytest.mark.parametrize("singular", [False, True])
def test_refreshed_inverse_factors_equal_pi_adjusted_inverse_or_keep_the_previous(singular):
    # The cache refresh's path against the public one: the same inversion, so equal to rounding;
    # where an inversion fails (a singular undamped factor), the refresh keeps the block's
    # previous inverses (both: a pi-adjusted pair belongs together) instead of the public
    # function's eigendecomposition fallback.
    rng = np.random.default_rng(4)
    x = rng.standard_normal((40, 3 if singular else 60))
    factors = [jnp.asarray(x @ x.T), jnp.asarray(_psd(rng, 5))]
    damping = 0.0 if singular else 0.3
    previous = [jnp.full((40, 40), 7.0), jnp.full((5, 5), 8.0)]
    block_inverse, expected, got = _inversions_and_refresh(factors, damping, previous)
    if singular:
        assert not np.all(np.isfinite(np.asarray(block_inverse)))
    np.testing.assert_allclose(got[0], previous[0] if singular else expected[0], rtol=1e-8)
    if singular:
        np.testing.assert_array_equal(got[1], previous[1])
    else:
        np.testing.assert_allclose(got[1], expected[1], rtol=1e-8, atol=1e-10 * np.abs(expected[1]).max())


def test_non_finite_eigh_is_retried(monkeypatch):
    real_eigh = KR.eigh
    calls = []

    def flaky_eigh(matrix):
        calls.append(None)
        vals, vecs = real_eigh(matrix)
        if len(calls) == 1:  # the first decomposition breaks down, as cuSOLVER sometimes does
            return vals * jnp.nan, vecs
        return vals, vecs

    monkeypatch.setattr(KR, "eigh", flaky_eigh)
    rng = np.random.default_rng(3)
    f = _psd(rng, 3, low=-1.0)
    eigh = KR.kronecker_eigh([jnp.asarray(f)])
    # Without the retry the eigenvalues would be NaN. (The retry branch may come from JAX's
    # compilation cache, so the number of calls is not checked.)
    assert calls
    np.testing.assert_allclose(np.sort(eigh.eigenvalues[0]), np.linalg.eigvalsh(f), rtol=1e-9)
    vecs = np.asarray(eigh.eigenvectors[0])
    np.testing.assert_allclose((vecs * eigh.eigenvalues[0]) @ vecs.T, f, atol=1e-10)


# Spectral functions


@jax.jit
def _spectra(op, damping, other):
    """Trace, Frobenius norm, logdet and eigenvalues of a Kronecker operator, of it damped and of
    a block diagonal with it, in one program per shape (the damping is traced)."""
    damped = op + damping * lx.IdentityLinearOperator(op.in_structure())
    block = O.BlockDiagonalOperator([op, other])
    return {
        "op": (S.trace(op), S.frobenius_norm(op), S.logdet(op), S.eigenvalues(op)),
        "damped": (S.trace(damped), S.logdet(damped), S.eigenvalues(damped)),
        "block": (S.trace(block), S.frobenius_norm(block), S.logdet(block), S.eigenvalues(block)),
    }


@given(seed=seeds, ns=positive_dims, damping=dampings)
def test_spectral_functions_match_numpy(seed, ns, damping):
    rng = np.random.default_rng(seed)
    op, factors = _kron_op(rng, ns)
    dense = _dense_kron(factors)
    other = lx.MatrixLinearOperator(jnp.asarray(_psd(rng, 3)), PSD)
    spectra = _spectra(op, damping, other)
    # Eigenvalues in [1e-6, 1e3]: logdet is a sum of well-conditioned logs.
    trace, frobenius, logdet, kron_order = spectra["op"]
    np.testing.assert_allclose(trace, np.trace(dense), rtol=1e-10)
    np.testing.assert_allclose(frobenius, np.linalg.norm(dense), rtol=1e-10)
    np.testing.assert_allclose(logdet, np.linalg.slogdet(dense)[1], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(
        np.sort(kron_order), np.linalg.eigvalsh(dense), rtol=1e-9, atol=1e-12
    )
    factor_eigs = [np.linalg.eigvalsh(f) for f in factors]
    np.testing.assert_allclose(kron_order, _dense_kron_vectors(factor_eigs), rtol=1e-9, atol=1e-12)
    trace, logdet, eigenvalues = spectra["damped"]
    damped_dense = dense + damping * np.eye(dense.shape[0])
    np.testing.assert_allclose(trace, np.trace(damped_dense), rtol=1e-10)
    np.testing.assert_allclose(logdet, np.linalg.slogdet(damped_dense)[1], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.sort(eigenvalues), np.linalg.eigvalsh(damped_dense), rtol=1e-9)
    trace, frobenius, logdet, eigenvalues = spectra["block"]
    block_dense = _block_diag([dense, np.asarray(other.matrix)])
    np.testing.assert_allclose(trace, np.trace(block_dense), rtol=1e-10)
    np.testing.assert_allclose(frobenius, np.linalg.norm(block_dense), rtol=1e-10)
    np.testing.assert_allclose(logdet, np.linalg.slogdet(block_dense)[1], rtol=1e-10, atol=1e-10)
    expected = np.concatenate([kron_order, np.linalg.eigvalsh(other.matrix)])
    np.testing.assert_allclose(eigenvalues, expected, rtol=1e-9, atol=1e-12)


def _dense_kron_vectors(vectors):
    return ft.reduce(lambda a, b: np.outer(a, b).ravel(), vectors)


def test_spectral_functions_on_empty_and_untagged_operators():
    empty = O.KroneckerOperator([jnp.zeros((0, 0)), jnp.eye(2)], PSD)
    assert S.trace(empty) == 0 and S.logdet(empty) == 0 and S.frobenius_norm(empty) == 0
    assert S.eigenvalues(empty).shape == (0,)
    plain = lx.MatrixLinearOperator(jnp.eye(2))
    with pytest.raises(ValueError, match="positive_semidefinite_tag"):
        S.logdet(plain)
    with pytest.raises(ValueError, match="symmetric_tag"):
        S.eigenvalues(O.KroneckerOperator([jnp.eye(2)]))
    # Dense fallbacks for other lineax operators.
    m = jnp.asarray(_psd(np.random.default_rng(4), 3))
    assert np.isclose(S.trace(lx.MatrixLinearOperator(m) * 2.0), 2 * np.trace(m))
    np.testing.assert_allclose(S.logdet(lx.MatrixLinearOperator(m, PSD)), np.linalg.slogdet(m)[1], rtol=1e-10)
    np.testing.assert_allclose(S.frobenius_norm(lx.MatrixLinearOperator(m)), np.linalg.norm(m), rtol=1e-12)


@given(seed=st.integers(0, 2**16), n=st.sampled_from([1, 3, 31, 32, 63, 300, 513]))
@settings(max_examples=6, deadline=None)
def test_block_spd_inverse_matches_numpy(seed, n):
    # Sizes on both sides of the recursion's leaf size, odd and even splits.
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, n + 3))
    matrix = x @ x.T / n + 1e-2 * np.eye(n)
    (inverse,) = _inversions([jnp.asarray(matrix)], 0.0)[1]
    np.testing.assert_allclose(np.asarray(inverse) @ matrix, np.eye(n), atol=1e-9)
    np.testing.assert_allclose(inverse, np.linalg.inv(matrix), rtol=1e-8, atol=1e-10)


def test_inverse_of_large_singular_matrix_falls_back_to_floored_eigenvalues():
    # Rank deficient and above the leaf size: a leaf's Cholesky breaks down inside the block
    # recursion, and the floored eigendecomposition gives a generalised inverse (A X A = A).
    x = np.random.default_rng(0).standard_normal((300, 5))
    a = x @ x.T
    block_inverse, (inverse,) = _inversions([jnp.asarray(a)], 0.0)
    assert not np.all(np.isfinite(np.asarray(block_inverse)))
    inverse = np.asarray(inverse)
    assert np.all(np.isfinite(inverse))
    np.testing.assert_allclose(inverse, inverse.T, atol=1e-10 * np.abs(inverse).max())
    assert np.linalg.eigvalsh(inverse).min() > 0
    # The floored null-space eigenvalues (~1e-11) amplify rounding in the eigenvectors, so the
    # generalised-inverse identity holds to about 1e-3 here, not to 1e-8.
    np.testing.assert_allclose(a @ inverse @ a, a, atol=1e-2 * np.abs(a).max())
