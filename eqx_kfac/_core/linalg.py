"""Dense factorisations, chosen per platform when the program is lowered.

**CPU: one matrix per LAPACK call.** jaxlib's CPU kernels for batched LAPACK calls (`eigh`,
Cholesky, triangular solves, ...) split the batch into chunks, schedule them on XLA's intra-op
thread pool and block until they are done (`jax::ParallelBatchMap`). XLA runs independent
operations of one program on the same pool, so when as many batched calls run at once as the pool
has threads, every thread waits for chunks that no thread is left to run: the program hangs with
no CPU use (measured on 2 cores: the first step of a scan-over-layers model, whose stacked factors
make every refresh a batched `eigh`, hung in 2 runs out of 5). A call on a single matrix runs
inline and never waits. On CPU the functions here therefore factorise one matrix at a time:
leading batch axes are looped over with `lax.map`, and under `jax.vmap` the matrices are visited
sequentially (`jax.custom_batching.sequential_vmap`) instead of becoming one batched call.

**GPU and TPU: batched calls.** The deadlock is a fact of jaxlib's CPU kernels only. On a GPU a
batched `syevd`/`potrf` over a stack of factors is the fast path (one cuSOLVER call for all the
layers of a scanned model, where a loop would serialise them), and TPUs factorise batches in XLA
itself. The choice is made by `jax.lax.platform_dependent`, when the program is lowered: a program
lowered for one platform contains only that platform's branch (`tests/test_platform_lowering.py`
exports the optimizer's step for `cuda` and `tpu` and checks that no solver call sits in a loop;
`tests/test_no_deadlock.py` checks that the CPU program makes unbatched calls only).

Derivatives are written out (`custom_jvp`) so that both forms stay differentiable in both modes;
the tangent computations use matrix products only.

**Process settings (CPU only).** The first time a factorisation is traced in a process whose
default backend is the CPU, SciPy's BLAS is set to one thread and glibc's `malloc` to keep large
blocks mapped (`_core/cpu_host.py`, which says why and how to turn each off).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jaxtyping import Array, Float

from .cpu_host import prepare_cpu_host


def per_platform(cpu: Callable[..., Any], default: Callable[..., Any]) -> Callable[..., Any]:
    """`cpu(*args)` in a program lowered for a CPU, `default(*args)` for any other platform.

    The choice is made at lowering time (`jax.lax.platform_dependent`): a program lowered for one
    platform holds that platform's branch only. Both must return the same shapes and dtypes.

    **Arguments:**

    - `cpu`: the CPU form.
    - `default`: the form for GPUs, TPUs and any other platform.

    **Returns:**

    A function of the same arguments.
    """

    def choose(*args: Any) -> Any:
        return jax.lax.platform_dependent(*args, cpu=cpu, default=default)

    return choose


def map_slices(fn: Callable[..., Any], *args: Any) -> Any:
    """`jax.vmap(fn)(*args)`, but one slice at a time (`lax.map`) on CPU.

    For a per-slice function that factorises through LAPACK without going through `eigh` and
    `spd_inverse` here (a lineax solver's factorisations), so that a stack of matrices never becomes
    a batched CPU LAPACK call (see the module notes), while GPUs and TPUs get the batched one.

    **Arguments:**

    - `fn`: the function of one slice.
    - `args`: PyTrees of arrays with a common leading (stack) axis.

    **Returns:**

    The stacked outputs of `fn`.
    """
    prepare_cpu_host()
    return per_platform(lambda *a: jax.lax.map(lambda x: fn(*x), a), jax.vmap(fn))(*args)


def _transpose(x: Array) -> Array:
    return jnp.swapaxes(x, -1, -2)


def _one_matrix_at_a_time(fn: Callable[[Array], tuple[Array, ...]]) -> Callable[[Array], tuple[Array, ...]]:
    """`fn` of one `(n, n)` matrix applied to `(..., n, n)`, one matrix per LAPACK call."""
    sequential = jax.custom_batching.sequential_vmap(fn)

    def apply(matrix: Array) -> tuple[Array, ...]:
        prepare_cpu_host()
        if matrix.ndim == 2:
            return sequential(matrix)
        batch, n = matrix.shape[:-2], matrix.shape[-1]
        outs = jax.lax.map(sequential, jnp.reshape(matrix, (-1, n, n)))
        return tuple(jnp.reshape(o, batch + o.shape[1:]) for o in outs)

    return apply


# LAPACK reads and writes column-major matrices, and XLA gives a solver's operand that layout.
# Handing it the transpose of a (symmetric) row-major matrix makes that a free reinterpretation of
# the matrix as it lies; handing it the matrix makes XLA transpose it. When the solver sits in the
# cache refresh's loop (`eqx_kfac._core.control_flow.apply_if`), whose carried values take the
# layout the loop's body asks for, XLA did that outside the loop, at every step, refresh or not
# (a 1729² factor of an MNIST CNN: 4.3 ms per step; the autoencoder's step held 45 MiB more).
# So the solvers read the upper triangle (the transpose's lower one), and the inverse, symmetric,
# is returned transposed: its row-major form is the kernel's column-major output as it lies.


def _raw_eigh(matrix: Array) -> tuple[Array, Array]:
    values, vectors = jnp.linalg.eigh(_transpose(matrix), symmetrize_input=False)
    return values, vectors


def _raw_spd_inverse(matrix: Array) -> tuple[Array]:
    chol = jax.lax.linalg.cholesky(_transpose(matrix), symmetrize_input=False)
    eye = jnp.broadcast_to(jnp.eye(matrix.shape[-1], dtype=matrix.dtype), matrix.shape)
    return (_transpose(jsl.cho_solve((chol, True), eye)),)


# On CPU one matrix per LAPACK call; elsewhere the same functions on the whole batch, one call.
_eigh = per_platform(_one_matrix_at_a_time(_raw_eigh), _raw_eigh)
_spd_inverse = per_platform(_one_matrix_at_a_time(_raw_spd_inverse), _raw_spd_inverse)


def _upper_symmetric(x: Array) -> Array:
    """The symmetric matrix whose upper triangle is `x`'s."""
    return jnp.triu(x) + _transpose(jnp.triu(x, 1))


@jax.custom_jvp
def eigh(matrix: Float[Array, "*batch n n"]) -> tuple[Float[Array, "*batch n"], Float[Array, "*batch n n"]]:
    """The eigendecomposition of symmetric matrices: one LAPACK call per matrix on CPU, batched
    elsewhere.

    The same values as `jnp.linalg.eigh(matrix, UPLO="U", symmetrize_input=False)` (the upper
    triangle is read): ascending eigenvalues and orthonormal eigenvectors as columns. On CPU, leading batch
    axes and `jax.vmap` loop over the matrices instead of making one batched LAPACK call; on GPU
    and TPU they make one batched call (see the module notes). The derivative is the usual one
    for distinct eigenvalues; the eigenvector tangents of equal eigenvalues, where the
    eigenvectors are not unique, are taken as zero.

    **Arguments:**

    - `matrix`: symmetric matrices with any leading batch axes.

    **Returns:**

    `(eigenvalues, eigenvectors)`.
    """
    return _eigh(matrix)


@eigh.defjvp
def _eigh_jvp(primals, tangents):
    (matrix,), (tangent,) = primals, tangents
    values, vectors = eigh(matrix)
    # Only the upper triangle is read: the tangent of the symmetric matrix it stands for.
    symmetric = _upper_symmetric(tangent)
    rotated = _transpose(vectors) @ symmetric @ vectors
    gaps = values[..., None, :] - values[..., :, None]
    inverse_gaps = jnp.where(gaps == 0, 0.0, 1.0 / jnp.where(gaps == 0, 1.0, gaps))
    values_dot = jnp.diagonal(rotated, axis1=-2, axis2=-1)
    vectors_dot = vectors @ (inverse_gaps * rotated)
    return (values, vectors), (values_dot, vectors_dot)


@jax.custom_jvp
def spd_inverse(matrix: Float[Array, "*batch n n"]) -> Float[Array, "*batch n n"]:
    """The inverse of symmetric positive definite matrices by Cholesky: one LAPACK call per matrix
    on CPU, batched elsewhere.

    Only the upper triangle is read. A matrix that is not positive definite (up to rounding) gives
    non-finite entries, which callers check. On CPU, leading batch axes and `jax.vmap` loop over
    the matrices; on GPU and TPU they make one batched call (see the module notes).

    **Arguments:**

    - `matrix`: symmetric positive definite matrices with any leading batch axes.

    **Returns:**

    Their inverses.
    """
    (inverse,) = _spd_inverse(matrix)
    return inverse


@spd_inverse.defjvp
def _spd_inverse_jvp(primals, tangents):
    (matrix,), (tangent,) = primals, tangents
    inverse = spd_inverse(matrix)
    symmetric = _upper_symmetric(tangent)
    return inverse, -(inverse @ symmetric @ inverse)
