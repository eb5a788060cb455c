"""The testing kit: every built-in block satisfies the laws of `check_block`, broken blocks do not
(and the error names the law), and the strategies draw what they promise."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eqx_kfac
from eqx_kfac import testing as kt

# The test-time type checks (beartype, through jaxtyping's import hook) sample container items with
# the `random` module, which hypothesis flags when that happens while the kit's strategies draw.
pytestmark = pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")


BUILTIN_BLOCKS = (
    eqx_kfac.ScaledIdentity,
    eqx_kfac.NaiveDiagonal,
    eqx_kfac.NaiveFull,
    eqx_kfac.DenseDiagonal,
    eqx_kfac.DenseFull,
    eqx_kfac.DenseTwoKroneckerFactored,
    eqx_kfac.DenseTwoKroneckerFactoredReduce,
    eqx_kfac.DenseEigenbasisKFAC,
    eqx_kfac.ScaleAndShiftDiagonal,
    eqx_kfac.ScaleAndShiftFull,
    eqx_kfac.EmbeddingKroneckerFactored,
    eqx_kfac.Conv2DDiagonal,
    eqx_kfac.Conv2DFull,
    eqx_kfac.Conv2DTwoKroneckerFactored,
    eqx_kfac.Conv2DEigenbasisKFAC,
)


def _concrete_blocks(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        if not getattr(sub, "__abstractmethods__", None):
            found.add(sub)
        found |= _concrete_blocks(sub)
    return found


def test_the_list_holds_every_builtin_block():
    # The physics-informed blocks (`eqx_kfac._pinn`) take `taylor_dense` layers, whose statistics
    # come from a Taylor-mode forward pass that the kit's layer specs do not describe; they are
    # checked against nested `jax.hessian` Gauss-Newton references in tests/test_pinn*.py. The
    # kfac-jax drop-in's adapter (`eqx_kfac.kfac_jax`) runs a user's kfac-jax-style block class,
    # checked against kfac-jax's formulas in tests/test_kfac_jax_blocks.py.
    builtin = {
        c
        for c in _concrete_blocks(eqx_kfac.CurvatureBlock)
        if c.__module__.startswith("eqx_kfac.")
        and not c.__module__.startswith(("eqx_kfac._pinn", "eqx_kfac.kfac_jax"))
    }
    assert builtin == set(BUILTIN_BLOCKS)


@pytest.mark.parametrize("block_cls", BUILTIN_BLOCKS, ids=lambda cls: cls.__name__)
def test_builtin_blocks_satisfy_the_laws(block_cls):
    # Two example layers of every tag the block supports, one of them scan-stacked.
    kt.check_block(block_cls)


def test_scaled_identity_with_a_scale_satisfies_the_laws():
    kt.check_block(
        lambda spec: eqx_kfac.ScaledIdentity(spec, scale=2.5), specs=kt.example_specs("dense")
    )


class _GradientDiagonal(eqx_kfac.Diagonal):
    """A diagonal block from the parameter gradients, with one deliberate bug (see below)."""

    spec: eqx_kfac.LayerSpec = eqx.field(static=True)
    bug: str = eqx.field(static=True)
    supported_tags: ClassVar[frozenset[str] | None] = None

    def _diagonal_statistics(self, data, batch_size):
        return tuple(jnp.sum(jnp.square(g), axis=0) / batch_size for g in data.params_tangent)

    def slice_multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached):
        if self.bug == "inverse damps twice" and power == -1:
            identity_weight = 2 * identity_weight
        return super().slice_multiply_matpower(
            state, vector, identity_weight, power, exact_power, use_cached
        )

    def slice_operator(self, state, identity_weight):
        if self.bug == "operator drops the damping":
            identity_weight = 0.0
        return super().slice_operator(state, identity_weight)


@pytest.mark.parametrize(
    "bug, law",
    [
        ("inverse damps twice", "'multiply_inverse undoes multiply'"),
        ("operator drops the damping", "'as_linear_operator is to_dense_matrix plus damping'"),
    ],
)
def test_broken_block_fails_naming_the_law(bug, law):
    block = _GradientDiagonal(kt.generic_spec((3,), (2,)), bug=bug)
    with pytest.raises(kt.BlockLawError, match="_GradientDiagonal for the generic layer") as info:
        kt.check_block(block)
    assert law in str(info.value)
    correct = _GradientDiagonal(kt.generic_spec((3,), (2,)), bug="none")
    kt.check_block(correct)


def test_check_block_argument_errors():
    with pytest.raises(TypeError, match="specs="):
        kt.check_block(lambda spec: eqx_kfac.NaiveDiagonal(spec))
    with pytest.raises(ValueError, match="constructor"):
        kt.check_block(eqx_kfac.NaiveDiagonal(kt.generic_spec((2,))), specs=[kt.generic_spec((2,))])
    with pytest.raises(ValueError, match="specs="):
        kt.example_specs("gain")


@settings(max_examples=3)
@given(
    spec=kt.layer_specs(tags=("dense",), stacked=False),
    key=kt.prng_keys(),
    damping=st.floats(0.01, 1.0),
)
def test_check_block_under_hypothesis(spec, key, damping):
    kt.check_block(eqx_kfac.DenseTwoKroneckerFactored(spec), key=key, damping=damping)


@settings(max_examples=10)
@given(
    matrix=kt.spd_matrices(st.integers(1, 6), max_condition=100.0),
    diagonal=kt.spd_matrices(4, max_condition=10.0, diagonal=True),
)
def test_spd_matrices_have_the_promised_conditioning(matrix, diagonal):
    matrix = np.asarray(matrix)
    np.testing.assert_allclose(matrix, matrix.T, atol=1e-12 * np.abs(matrix).max())
    values = np.linalg.eigvalsh(matrix)
    assert values.min() > 0 and values.max() / values.min() <= 100.0 * (1 + 1e-8)
    diagonal = np.asarray(diagonal)
    assert diagonal.shape == (4,) and diagonal.min() > 0
    assert diagonal.max() / diagonal.min() <= 10.0 * (1 + 1e-8)


@eqx.filter_jit
def _dense_matrix(block, state):
    """`to_dense_matrix` under jit: one program per block (shared by examples with the same
    spec) instead of dozens of eager ones."""
    return block.to_dense_matrix(state)


@settings(max_examples=10)
@given(spec=kt.layer_specs(), key=kt.prng_keys())
def test_layer_specs_fit_the_default_blocks_and_their_data(spec, key):
    block = eqx_kfac.get_default_tag_to_block_ctor(spec.tag)(spec)
    state = kt.block_state(block, key)
    dense = np.asarray(_dense_matrix(block, state))
    assert dense.shape == (block.dim, block.dim)
    assert np.all(np.isfinite(dense))
    np.testing.assert_allclose(dense, dense.T, atol=1e-10 * max(np.abs(dense).max(), 1))
    assert np.linalg.eigvalsh(dense).min() >= -1e-10 * max(np.abs(dense).max(), 1)


BLOCK = eqx_kfac.DenseTwoKroneckerFactored(kt.dense_spec(2, 2, layout="out_in"))


@settings(max_examples=5)
@given(state=kt.block_states(BLOCK))
def test_block_states_have_psd_factors_and_the_kronecker_dense_matrix(state):
    # K-FAC's dense matrix is `A ⊗ G` in the canonical `(in + 1, out)` order; the weight is
    # `(out, in)` as in `eqx.nn.Linear`: canonical `(i, o)` is entry `o * 2 + i`, bias `4 + o`.
    a, g = (np.asarray(f.value) for f in state.factors)
    assert np.all(np.linalg.eigvalsh(a) > -1e-12) and np.all(np.linalg.eigvalsh(g) > -1e-12)
    assert a[2, 2] == pytest.approx(1.0)  # the appended 1 of the bias
    order = np.argsort([o * 2 + i if i < 2 else 4 + o for i in range(3) for o in range(2)])
    expected = np.kron(a, g)[np.ix_(order, order)]
    np.testing.assert_allclose(_dense_matrix(BLOCK, state), expected, rtol=1e-12, atol=1e-14)


def test_estimation_data_shapes():
    spec = kt.embedding_spec(5, 3, extra=(2,), stack=2)
    data = kt.estimation_data(spec, jax.random.key(0), num_vectors=4)
    (ids,) = data.inputs
    assert ids.shape == (2, 3, 2) and jnp.issubdtype(ids.dtype, jnp.integer)
    assert 0 <= int(ids.min()) and int(ids.max()) < 5
    assert data.outputs_tangent[0].shape == (4, 2, 3, 2, 3)
    assert data.params_tangent[0].shape == (4, 2, 5, 3)
    again = kt.estimation_data(spec, jax.random.key(0), num_vectors=4)
    np.testing.assert_array_equal(again.outputs_tangent[0], data.outputs_tangent[0])
