"""The blocks' structured operators against dense NumPy built from their parts (float64, 1e-8)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eqx_kfac
import models
from eqx_kfac import testing as kt
from eqx_kfac import KroneckerLayout
from eqx_kfac import (
    DiagonalCurvatureOperator,
    EigenbasisCurvatureOperator,
    KroneckerCurvatureOperator,
    ReshapeLayout,
    ScaledIdentityCurvatureOperator,
    StackedCurvatureOperator,
)

# The test-time type checks (beartype, through jaxtyping's import hook) sample container items with
# the `random` module, which hypothesis flags when that happens while the kit's strategies draw.
pytestmark = pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")


RTOL = 1e-8
dampings = st.floats(0.01, 1.0)


def close(actual, expected, rtol=RTOL):
    expected = np.asarray(expected)
    scale = max(np.max(np.abs(expected), initial=0.0), 1.0)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=0, atol=rtol * scale)


def flat(vector):
    return np.concatenate([np.ravel(v) for v in vector])


def numpy_power(matrix, power):
    values, vectors = np.linalg.eigh(matrix)
    return (vectors * values**power) @ vectors.T


# An `eqx.nn.Linear`-like layer `(out=2, in=2)` weight and bias: the canonical array is
# `(in + 1, out) = (3, 2)`; canonical `(i, o)` is weight entry `o * 2 + i`, or bias `4 + o`.
OUT_IN = KroneckerLayout(eqx_kfac.DenseTwoKroneckerFactored(kt.dense_spec(2, 2, layout="out_in")))
PARAM_OF_CANONICAL = np.array([o * 2 + i if i < 2 else 4 + o for i in range(3) for o in range(2)])


def in_parameter_order(canonical):
    """`P M Pᵀ` for the permutation `P` from canonical to parameter order."""
    order = np.argsort(PARAM_OF_CANONICAL)
    return canonical[np.ix_(order, order)]


@eqx.filter_jit
def _views(operator, vector):
    """Every structured function of `operator`, in one compiled program."""
    out = dict(
        matrix=operator.as_matrix(),
        mv=jnp.concatenate([jnp.ravel(x) for x in operator.mv(vector)]),
        transpose=jnp.concatenate([jnp.ravel(x) for x in operator.transpose().mv(vector)]),
        diagonal=lx.diagonal(operator),
        trace=eqx_kfac.trace(operator),
        frobenius=eqx_kfac.frobenius_norm(operator),
        logdet=eqx_kfac.logdet(operator),
        eigenvalues=eqx_kfac.eigenvalues(operator),
        cg=lx.linear_solve(operator, vector, lx.CG(rtol=1e-13, atol=1e-13)).value,
    )
    for p in (-1.0, -0.5, 2.0):
        powered = eqx_kfac.matpower(operator, p)
        out[f"power {p}"] = jnp.concatenate([jnp.ravel(x) for x in powered.mv(vector)])
        out[f"logdet {p}"] = eqx_kfac.logdet(powered)
    return out


def check_against(operator, dense, vector, damping, rtol=RTOL):
    """Every structured function of `operator` against the dense `C`, with `C + λI` its matrix."""
    n = dense.shape[0]
    damped = dense + damping * np.eye(n)
    v = flat(vector)
    out = _views(operator, tuple(vector))
    close(out["matrix"], damped, rtol)
    close(out["mv"], damped @ v, rtol)
    close(out["transpose"], damped @ v, rtol)
    close(out["diagonal"], np.diagonal(damped), rtol)
    close(out["trace"], np.trace(damped), rtol)
    close(out["frobenius"], np.linalg.norm(damped), rtol)
    close(out["logdet"], np.linalg.slogdet(damped)[1], rtol)
    close(np.sort(out["eigenvalues"]), np.linalg.eigvalsh(damped), rtol)
    for p in (-1.0, -0.5, 2.0):
        close(out[f"power {p}"], numpy_power(damped, p) @ v, rtol)
        close(out[f"logdet {p}"], p * np.linalg.slogdet(damped)[1], rtol)
    close(flat(out["cg"]), np.linalg.solve(damped, v), rtol)
    assert lx.is_symmetric(operator) and lx.is_positive_semidefinite(operator)
    assert not lx.is_negative_semidefinite(operator)


def random_vector(shapes, seed):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s)) for s in shapes)


@settings(max_examples=8)
@given(a=kt.spd_matrices(3), g=kt.spd_matrices(2), damping=dampings, seed=st.integers(0, 99))
def test_kronecker_operator_is_the_permuted_kron(a, g, damping, seed):
    operator = KroneckerCurvatureOperator((a, g), damping, OUT_IN)
    a, g = np.asarray(a), np.asarray(g)
    vector = random_vector(OUT_IN.param_shapes, seed)
    check_against(operator, in_parameter_order(np.kron(a, g)), vector, damping)
    # Pi-adjusted damping (Martens & Grosse 2015), and the scale folded into the last factor.
    pi = np.sqrt((np.trace(a) / 3) / (np.trace(g) / 2))
    approximate = np.kron(
        a + pi * np.sqrt(damping) * np.eye(3), g + np.sqrt(damping) / pi * np.eye(2)
    )
    inverse = eqx_kfac.matpower(operator, -1, exact=False)
    assert isinstance(inverse, KroneckerCurvatureOperator)
    close(inverse.as_matrix(), in_parameter_order(np.linalg.inv(approximate)))
    close(
        operator.scaled(3.0).as_matrix(),
        3.0 * in_parameter_order(np.kron(a, g) + damping * np.eye(6)),
    )
    assert operator.scaled(3.0).factors[0] is operator.factors[0]


@settings(max_examples=8)
@given(
    a=kt.spd_matrices(4, diagonal=True),
    g=kt.spd_matrices(3),
    damping=dampings,
    seed=st.integers(0, 99),
)
def test_kronecker_operator_with_a_diagonal_factor(a, g, damping, seed):
    # An embedding table (vocab 4, features 3) with the token frequencies as a diagonal factor.
    layout = ReshapeLayout(((4, 3),), (4, 3))
    operator = KroneckerCurvatureOperator((a, g), damping, layout)
    dense = np.kron(np.diag(np.asarray(a)), np.asarray(g))
    check_against(operator, dense, random_vector(layout.param_shapes, seed), damping)
    approximate = eqx_kfac.matpower(operator, -1, exact=False)
    assert approximate.factors[0].shape == (4,)  # still diagonal
    pi = np.sqrt(np.mean(a) / (np.trace(g) / 3))
    expected = np.kron(
        np.diag(np.asarray(a) + pi * np.sqrt(damping)),
        np.asarray(g) + np.sqrt(damping) / pi * np.eye(3),
    )
    close(approximate.as_matrix(), np.linalg.inv(expected))


@settings(max_examples=8)
@given(
    a=kt.spd_matrices(3),
    g=kt.spd_matrices(2),
    spectrum=kt.spd_matrices(6, diagonal=True),
    damping=dampings,
    seed=st.integers(0, 99),
)
def test_eigenbasis_operator(a, g, spectrum, damping, seed):
    q_a, q_g = (np.linalg.eigh(np.asarray(f))[1] for f in (a, g))
    spectrum = np.reshape(np.asarray(spectrum), (3, 2))
    operator = EigenbasisCurvatureOperator((q_a, q_g), spectrum, damping, OUT_IN)
    basis = np.kron(q_a, q_g)
    dense = in_parameter_order(basis @ np.diag(spectrum.ravel()) @ basis.T)
    check_against(operator, dense, random_vector(OUT_IN.param_shapes, seed), damping)
    # `None` stands for the identity.
    partial = EigenbasisCurvatureOperator((None, q_g), spectrum, damping, OUT_IN)
    basis = np.kron(np.eye(3), q_g)
    close(
        partial.as_matrix(),
        in_parameter_order(basis @ np.diag(spectrum.ravel()) @ basis.T) + damping * np.eye(6),
    )


@settings(max_examples=8)
@given(
    diagonal=kt.spd_matrices(6, diagonal=True),
    scale=st.floats(0.0, 3.0),
    damping=dampings,
    seed=st.integers(0, 99),
)
def test_diagonal_and_scaled_identity_operators(diagonal, scale, damping, seed):
    shapes = ((2, 2), (2,))
    diagonals = (jnp.reshape(diagonal[:4], (2, 2)), diagonal[4:])
    vector = random_vector(shapes, seed)
    check_against(
        DiagonalCurvatureOperator(diagonals, damping),
        np.diag(np.asarray(diagonal)),
        vector,
        damping,
    )
    identity = ScaledIdentityCurvatureOperator(scale, damping, shapes)
    check_against(identity, scale * np.eye(6), vector, damping)
    assert lx.is_diagonal(identity) and not lx.is_diagonal(
        KroneckerCurvatureOperator((np.eye(3), np.eye(2)), 0.0, OUT_IN)
    )


@settings(max_examples=6)
@given(
    factors=st.lists(st.tuples(kt.spd_matrices(3), kt.spd_matrices(2)), min_size=2, max_size=2),
    damping=dampings,
    seed=st.integers(0, 99),
)
def test_stacked_operator_is_block_diagonal_over_slices(factors, damping, seed):
    stacked_factors = tuple(jnp.stack(f) for f in zip(*factors))
    slices = jax.vmap(lambda a, g: KroneckerCurvatureOperator((a, g), damping, OUT_IN))(
        *stacked_factors
    )
    operator = StackedCurvatureOperator(slices)
    # Stacked leaves `(2, out, in)` and `(2, out)`: slice s of parameter k sits at
    # `2 * offset_k + s * size_k`, with sizes (4, 2) and offsets (0, 4).
    dense = np.zeros((12, 12))
    for s, (a, g) in enumerate(factors):
        index = np.concatenate([s * 4 + np.arange(4), 8 + s * 2 + np.arange(2)])
        dense[np.ix_(index, index)] = in_parameter_order(np.kron(np.asarray(a), np.asarray(g)))
    vector = random_vector(((2, 2, 2), (2, 2)), seed)
    check_against(operator, dense, vector, damping)
    with pytest.raises(ValueError, match="leading stack axis"):
        StackedCurvatureOperator(KroneckerCurvatureOperator(factors[0], damping, OUT_IN))


def test_construction_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"\(3, 2\)"):
        KroneckerCurvatureOperator((np.eye(2), np.eye(2)), 0.0, OUT_IN)
    with pytest.raises(ValueError, match="fill"):
        ReshapeLayout(((2, 2),), (5,))
    operator = KroneckerCurvatureOperator((np.eye(3), np.eye(2)), 0.0, OUT_IN)
    with pytest.raises(ValueError, match=r"\(\(2, 2\), \(2,\)\)"):
        operator.mv((jnp.ones((2, 2)),))


def _largest_intermediate(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)

    def sizes(jaxpr):
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                yield int(np.prod(var.aval.shape))
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from sizes(inner)

    return max(sizes(jaxpr.jaxpr))


@eqx.filter_jit
def _estimate(estimator, key, args):
    return estimator.update_curvature_matrix_estimate(estimator.init(), 0.0, 1.0, 8, key, args)


@eqx.filter_jit
def _structured(estimator, state, damping, vector):
    operator = estimator.as_linear_operator(state, damping)
    inverse = eqx_kfac.matpower(operator, -1)
    return dict(
        dense=estimator.to_dense_matrix(state),
        trace=eqx_kfac.trace(operator),
        logdet=eqx_kfac.logdet(operator),
        frobenius=eqx_kfac.frobenius_norm(operator),
        eigenvalues=eqx_kfac.eigenvalues(operator),
        inverse=models.flat_params(inverse.mv(vector))[0],
    )


def test_estimator_operator_is_structured_and_never_dense(getkey):
    problem = models.mlp_classification(getkey(), sizes=(40, 30, 3), batch=8)
    args = (problem.params, problem.batch)
    estimator = eqx_kfac.BlockDiagonalCurvature(
        problem.loss_fn, args, default_estimation_mode="ggn_exact"
    )
    state = _estimate(estimator, getkey(), args)
    damping = 0.05
    operator = estimator.as_linear_operator(state, damping)
    assert all(isinstance(b, KroneckerCurvatureOperator) for b in operator.inner.blocks)
    vector = eqx.filter(problem.params, eqx.is_inexact_array)
    out = _structured(estimator, state, damping, vector)
    dense = np.asarray(out["dense"]) + damping * np.eye(estimator.dim)
    close(out["trace"], np.trace(dense))
    close(out["logdet"], np.linalg.slogdet(dense)[1])
    close(out["frobenius"], np.linalg.norm(dense))
    close(np.sort(out["eigenvalues"]), np.linalg.eigvalsh(dense))
    close(out["inverse"], np.linalg.solve(dense, models.flat_params(vector)[0]))
    # Nothing of the size of the dense matrix (dim² = 1.75M entries) is ever formed.
    for fn in (
        eqx_kfac.trace,
        eqx_kfac.logdet,
        eqx_kfac.eigenvalues,
        eqx_kfac.frobenius_norm,
        lambda op: eqx_kfac.matpower(op, -1, exact=False).mv(vector),
        lx.diagonal,
    ):
        largest = _largest_intermediate(
            lambda s, fn=fn: fn(estimator.as_linear_operator(s, damping)), state
        )
        assert largest < estimator.dim**2 / 100, largest
