"""Layers applied at every step of `jax.lax.scan` with the same parameters (recurrent cells).

References: full blocks equal the slices of the brute-force GGN `(1/B) Jᵀ H J` (the steps are summed
into each example's gradient), and the Kronecker factors of a layer repeated over the steps equal
those of the same layer applied to all steps at once as sequence positions (the "expand"
convention).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_kfac
from models import Problem, block_slices, brute_force_ggn


class Recurrent(eqx.Module):
    cell: eqx.nn.GRUCell | eqx.nn.LSTMCell
    head: eqx.nn.Linear

    def __init__(self, cell, key, n_in=3, hidden=4, n_out=3):
        k1, k2 = jax.random.split(key)
        self.cell = cell(n_in, hidden, key=k1)
        self.head = eqx.nn.Linear(hidden, n_out, key=k2)

    def __call__(self, xs):
        zero = jnp.zeros(self.cell.hidden_size, xs.dtype)
        init = (zero, zero) if isinstance(self.cell, eqx.nn.LSTMCell) else zero
        final, _ = jax.lax.scan(lambda h, x: (self.cell(x, h), None), init, xs)
        return self.head(final[0] if isinstance(final, tuple) else final)


def _squared_error(outputs, batch):
    return 0.5 * jnp.sum((outputs[0] - batch[1]) ** 2)


def recurrent_problem(cell, key, batch=4, steps=3) -> Problem:
    kp, kx, ky = jax.random.split(key, 3)
    model = Recurrent(cell, kp)
    x = jax.random.normal(kx, (batch, steps, 3))
    y = jax.random.normal(ky, (batch, 3))

    def outputs_fn(params, x):
        return (jax.vmap(params)(x),)

    def loss_fn(params, data):
        (out,) = outputs_fn(params, data[0])
        eqx_kfac.register_normal_predictive_distribution(out, data[1], variance=1.0)
        return _squared_error((out,), data) / data[0].shape[0]

    return Problem(model, (x, y), loss_fn, outputs_fn, _squared_error)


_FULL = {"dense": eqx_kfac.DenseFull, "scale_and_shift": eqx_kfac.ScaleAndShiftFull}


def _curvature(estimator, problem, key=jax.random.key(0)):
    @eqx.filter_jit
    def update(estimator, args):
        state = estimator.init(key)
        return estimator.update_curvature_matrix_estimate(
            state, 0.0, 1.0, problem.batch_size, key, args
        )

    return update(estimator, problem.func_args)


@pytest.mark.parametrize("cell", [eqx.nn.GRUCell, eqx.nn.LSTMCell], ids=["gru", "lstm"])
def test_cell_weights_get_structured_blocks_equal_to_the_exact_ggn(cell, getkey):
    problem = recurrent_problem(cell, getkey())
    estimator = eqx_kfac.BlockDiagonalCurvature(
        problem.loss_fn, problem.func_args, default_estimation_mode="ggn_exact",
        layer_tag_to_block_ctor=_FULL,
    )
    registrations = estimator.registrations()
    cell_paths = [p for p in registrations if p.startswith("cell.")]
    assert cell_paths and all(registrations[p].tag != "generic" for p in cell_paths)
    assert {s.repeat_size for s in (b.spec for b in estimator.blocks) if s.param_paths[0].startswith("cell.")} == {3}
    state = _curvature(estimator, problem)
    exact = brute_force_ggn(problem)
    for block, block_state, rows in zip(estimator.blocks, state.block_states, block_slices(estimator)):
        np.testing.assert_allclose(
            block.to_dense_matrix(block_state), exact[np.ix_(rows, rows)], rtol=1e-8, atol=1e-12
        )


class StepSum(eqx.Module):
    """`head(Σ_t tanh(layer(x_t)))`, with the steps in a scan or as positions of one batched layer."""

    layer: eqx.nn.Linear
    head: eqx.nn.Linear
    scanned: bool = eqx.field(static=True)

    def __call__(self, xs):
        if self.scanned:
            zero = jnp.zeros(self.layer.out_features, xs.dtype)
            total, _ = jax.lax.scan(lambda c, x: (c + jnp.tanh(self.layer(x)), None), zero, xs)
        else:
            total = jnp.sum(jnp.tanh(jax.vmap(self.layer)(xs)), axis=0)
        return self.head(total)


def test_kronecker_factors_of_a_repeated_layer_are_those_of_positions(getkey):
    k1, k2 = getkey(), getkey()
    layer, head = eqx.nn.Linear(3, 4, key=k1), eqx.nn.Linear(4, 2, key=k2)
    x = jax.random.normal(getkey(), (5, 6, 3))
    y = jax.random.normal(getkey(), (5, 2))
    factors = {}
    for scanned in (True, False):
        model = StepSum(layer, head, scanned)

        def loss(model, batch):
            out = jax.vmap(model)(batch[0])
            eqx_kfac.register_squared_error_loss(out, batch[1])
            return jnp.mean(jnp.sum((out - batch[1]) ** 2, axis=-1))

        problem = Problem(model, (x, y), loss, None, None)
        estimator = eqx_kfac.BlockDiagonalCurvature(loss, (model, (x, y)), default_estimation_mode="ggn_exact")
        spec = estimator.blocks[0].spec
        assert spec.param_paths == ("layer.weight", "layer.bias")
        assert spec.input_shapes == ((5, 6, 3),) and spec.repeat_size == (6 if scanned else None)
        state = _curvature(estimator, problem)
        factors[scanned] = [f.value for f in state.block_states[0].factors]
    for scanned, positions in zip(factors[True], factors[False]):
        np.testing.assert_allclose(scanned, positions, rtol=1e-10)
