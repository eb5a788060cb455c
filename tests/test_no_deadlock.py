"""No batched LAPACK call anywhere in the library's compiled code (they can deadlock XLA on CPU).

jaxlib's batched LAPACK kernels wait on XLA's CPU thread pool for their chunks; when as many of them
run at once as the pool has threads, the program hangs (see `eqx_kfac._core.linalg`). The library
therefore makes one LAPACK call per matrix. The reference here is the lowered program itself:
every LAPACK custom call in it must have `num_batch_dims = "0"`, whatever vmaps and scans surround
it. The last test runs the scan-over-layers model that hung, in a fresh process with a time limit,
so that a regression fails instead of hanging the suite.
"""

import pathlib
import re
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import pytest

import eqx_kfac
from eqx_kfac._core.linalg import eigh, spd_inverse


_LAPACK = re.compile(r'custom_call @(lapack_\w+|blas_\w+)\(.*?num_batch_dims = "(\d+)"')


def lapack_calls(fn, *args) -> list[tuple[str, int]]:
    """`(kernel, number of batch dims)` of every LAPACK/BLAS custom call in `fn`'s program."""
    text = eqx.filter_jit(fn).lower(*args).as_text()
    calls = [(name, int(dims)) for name, dims in _LAPACK.findall(text)]
    assert text.count("custom_call @lapack_") + text.count("custom_call @blas_") == len(calls)
    return calls


def assert_unbatched(calls: list[tuple[str, int]], expected: set[str]) -> None:
    assert {name.split("_")[1] for name, _ in calls} >= expected, calls
    assert all(dims == 0 for _, dims in calls), calls


def _spd(key, shape):
    a = jax.random.normal(key, shape)
    return a @ jnp.swapaxes(a, -1, -2) + shape[-1] * jnp.eye(shape[-1])


def test_the_check_sees_batched_calls():
    # The property can fail: jax's own functions on a stack of matrices are batched calls.
    calls = lapack_calls(jnp.linalg.eigh, jnp.ones((3, 4, 4)))
    assert calls == [("lapack_dsyevd_ffi", 1)]


@pytest.mark.parametrize("wrap", ["batch_axes", "vmap", "vmap_of_scan"])
def test_factorisations_are_one_matrix_per_call(getkey, wrap):
    matrices = _spd(getkey(), (2, 3, 5, 5))
    fn = {
        "batch_axes": lambda m: (eigh(m), spd_inverse(m)),
        "vmap": jax.vmap(jax.vmap(lambda m: (eigh(m), spd_inverse(m)))),
        "vmap_of_scan": jax.vmap(lambda m: (eigh(m), spd_inverse(m))),
    }[wrap]
    assert_unbatched(lapack_calls(fn, matrices), {"dsyevd", "dpotrf"})
    (values, vectors), inverse = jax.jit(fn)(matrices)  # (one program, not one per operation)
    np.testing.assert_allclose(values, np.linalg.eigvalsh(np.asarray(matrices)), rtol=1e-10)
    np.testing.assert_allclose(inverse, np.linalg.inv(np.asarray(matrices)), rtol=1e-8)
    np.testing.assert_allclose(
        vectors @ (values[..., None] * np.swapaxes(vectors, -1, -2)), matrices, rtol=1e-8
    )


def test_derivatives_match_jax(getkey):
    matrix = _spd(getkey(), (5, 5))
    tangent = jax.random.normal(getkey(), (5, 5))
    tangent = tangent + tangent.T
    weights = jnp.arange(5.0)

    def ours(m):
        values, vectors = eigh(m)
        return jnp.sum(jnp.log(values)) + jnp.sum(weights * vectors[:, -1] ** 2) + jnp.sum(
            spd_inverse(m) * weights
        )

    def reference(m):
        values, vectors = jnp.linalg.eigh(m, symmetrize_input=False)
        return jnp.sum(jnp.log(values)) + jnp.sum(weights * vectors[:, -1] ** 2) + jnp.sum(
            jnp.linalg.inv(m) * weights
        )

    symmetric = lambda f: (lambda m: f(jnp.tril(m) + jnp.tril(m, -1).T))  # noqa: E731
    # Compiled: one program per derivative instead of one per operation.
    grad = lambda f: jax.jit(jax.grad(symmetric(f)))  # noqa: E731
    jvp = lambda f: jax.jit(lambda m, t: jax.jvp(f, (m,), (t,))[1])  # noqa: E731
    np.testing.assert_allclose(grad(ours)(matrix), grad(reference)(matrix), rtol=1e-8)
    np.testing.assert_allclose(jvp(ours)(matrix, tangent), jvp(reference)(matrix, tangent), rtol=1e-8)


# The model that hung: Equinox's scan-over-layers pattern.


def _scan_model(width=64, depth=4, n_out=10):
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(width, width, key=k))(
        jax.random.split(jax.random.key(0), depth)
    )
    return stack, eqx.nn.Linear(width, n_out, key=jax.random.key(1))


def _scan_loss(model, batch):
    stack, head = model
    dynamic, static = eqx.partition(stack, eqx.is_array)

    def forward(x):
        body = lambda h, layer: (jnp.tanh(eqx.combine(layer, static)(h)), None)  # noqa: E731
        h, _ = jax.lax.scan(body, x, dynamic)
        return head(h)

    x, y = batch
    logits = jax.vmap(forward)(x)
    eqx_kfac.register_softmax_cross_entropy_loss(logits, y)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def _scan_batch(width=64, n_out=10, batch=32):
    x = jax.random.normal(jax.random.key(2), (batch, width))
    return x, jax.random.randint(jax.random.key(3), (batch,), 0, n_out)


# The recommended rules, the damping from 1.
ADAPTIVE = dict(damping_rule=eqx_kfac.LevenbergMarquardtDamping(1.0, minimum=1e-6, fault_increase=2.0))
SCHEDULED = dict(
    step_rule=eqx_kfac.MomentumStep(
        eqx_kfac.ScheduledHyperparameter(lambda s: 0.1), eqx_kfac.ScheduledHyperparameter(lambda s: 0.0)
    ),
    damping_rule=eqx_kfac.ScheduledDamping(lambda s: 1e-2),
)


@pytest.mark.parametrize(
    "parts, expected",
    [
        (ADAPTIVE, {"dpotrf"}),
        (dict(SCHEDULED, direction=eqx_kfac.PreconditionedGradient(exact_inverses=True)), {"dsyevd"}),
        (dict(SCHEDULED, curvature=eqx_kfac.CurvatureOptions(inverse_solver=lx.Cholesky())), {"dpotrf"}),
    ],
    ids=["adaptive", "exact_inverses", "lineax_cholesky"],
)
def test_optimizer_step_of_a_scan_stack_has_no_batched_lapack(parts, expected):
    model, batch = _scan_model(width=8), _scan_batch(width=8)
    optimizer = eqx_kfac.Optimizer(eqx.filter_value_and_grad(_scan_loss), **parts)
    state = optimizer.init(model, jax.random.key(4), batch)
    calls = lapack_calls(
        lambda p, s: optimizer.step(p, s, jax.random.key(5), batch=batch), model, state
    )
    assert_unbatched(calls, expected)


def test_preconditioner_update_of_a_scan_stack_has_no_batched_lapack():
    model, batch = _scan_model(width=8), _scan_batch(width=8)
    params = eqx.filter(model, eqx.is_inexact_array)
    transform = eqx_kfac.kfac_preconditioner(
        _scan_loss, (model, batch), damping=1e-2, use_exact_inverses=True
    )
    state = transform.init(params)

    def update(params, state):
        return transform.update(params, state, params, batch=batch, key=jax.random.key(6))

    assert_unbatched(lapack_calls(update, params, state), {"dsyevd"})


_HUNG = textwrap.dedent(
    """
    import jax, equinox as eqx
    import eqx_kfac, test_no_deadlock as t

    model, batch = t._scan_model(), t._scan_batch(batch=128)
    optimizer = eqx_kfac.Optimizer(eqx.filter_value_and_grad(t._scan_loss), **t.ADAPTIVE)
    state = optimizer.init(model, jax.random.key(0), batch)
    losses = []
    for i in range(3):
        model, state, stats = optimizer.step(model, state, jax.random.key(i), batch=batch)
        losses.append(float(stats["loss"]))
    print(losses)
    """
)


@pytest.mark.integration  # run by `pytest -m integration` (pyproject.toml)
def test_the_scan_stack_that_hung_takes_its_first_steps():
    # In a fresh process with a time limit: a deadlock fails the test instead of hanging the suite.
    # (The optax preconditioner's update of the same stack is held to one matrix per LAPACK call
    # by `test_preconditioner_update_of_a_scan_stack_has_no_batched_lapack`.)
    here = str(pathlib.Path(__file__).parent)
    result = subprocess.run(
        [sys.executable, "-c", _HUNG], cwd=here, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = eval(result.stdout.strip().splitlines()[-1])
    assert losses[-1] < losses[0]
