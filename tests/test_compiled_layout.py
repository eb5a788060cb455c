"""The compiled step moves no curvature matrix between memory layouts outside its refresh.

LAPACK works on column-major matrices; the library's are row-major. A solver inside the cache
refresh's loop (`eqx_kfac._core.control_flow.apply_if`) whose operand is a row-major factor makes
XLA carry the factor into the loop column-major, i.e. transpose it before the loop at every step,
refresh or not (see `eqx_kfac._core.linalg`). The reference is the optimised program itself: no
square matrix in its entry computation (which runs at every step) has a column-major layout.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_kfac
from eqx_kfac._core.control_flow import apply_if
from eqx_kfac._core.linalg import eigh


def column_major_matrices(compiled_text: str) -> list[str]:
    """The square matrices with a column-major layout (`{0,1}`) in the entry computation."""
    entry = compiled_text.split("\nENTRY ", 1)[1]
    found = re.findall(r"f(?:32|64)\[(\d+),(\d+)\]\{0,1\}", entry)
    return [f"{a}x{b}" for a, b in found if a == b and int(a) > 1]


def _refresh_step(solver):
    """A factor's moving average, then `solver` of it in a refresh loop (as the optimizer's step)."""

    def step(factor, cache, x, count):
        factor = 0.9 * factor + x.T @ x
        refresh = lambda fc: (fc[0], solver(fc[0] + jnp.eye(fc[0].shape[0])))  # noqa: E731
        return apply_if(count % 5 == 0, refresh, (factor, cache))

    n = 24
    args = (jnp.eye(n), jnp.eye(n), jnp.ones((4, n)), jnp.int32(0))
    return jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile().as_text()


def test_the_check_sees_a_transposed_factor():
    # The property can fail: jax's own eigh of the row-major factor inside the loop.
    assert column_major_matrices(_refresh_step(lambda m: jnp.linalg.eigh(m, symmetrize_input=False)[1]))


def test_eigh_takes_the_factor_as_it_lies():
    # The refresh of the eigendecompositions (exact inverses, EK-FAC, cached eigenvalues).
    assert column_major_matrices(_refresh_step(lambda m: eigh(m)[1])) == []


def _loss(model, batch):
    x, y = batch
    prediction = jax.vmap(model)(x)
    eqx_kfac.register_squared_error_loss(prediction, y)
    return jnp.mean(jnp.sum((prediction - y) ** 2, axis=-1)) / 2


def test_the_step_keeps_its_factors_row_major():
    # The adaptive step: pi-adjusted inverses by block elimination (Cholesky at the leaves; a
    # width of 16 makes factors of 3 to 17 rows, each inverted by one Cholesky factorisation).
    model = eqx.nn.MLP(6, 3, 16, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (32, 6))
    batch = (x, jnp.sin(x[:, :3]))
    optimizer = eqx_kfac.Optimizer(eqx.filter_value_and_grad(_loss))  # adaptive: the defaults
    state = optimizer.init(model, jax.random.key(2), batch)
    step = eqx.filter_jit(lambda p, s: optimizer.step(p, s, jax.random.key(3), batch=batch))
    assert column_major_matrices(step.lower(model, state).lowered.compile().as_text()) == []
