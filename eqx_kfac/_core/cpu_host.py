"""Process settings for K-FAC on a CPU: LAPACK's threads and glibc's large blocks.

Both are made once, the first time a factorisation is traced in a process whose default backend
is the CPU (`prepare_cpu_host`, called by `_core/linalg.py` and the blocks' solver cache), and
each can be turned off with an environment variable. A process whose default backend is a GPU or
TPU is left alone.

**LAPACK's own threads.** jaxlib's CPU kernels call the LAPACK that SciPy loads (OpenBLAS in
SciPy's wheels). Inside a compiled program they run on XLA's thread pool, which already keeps
every core busy; a multi-threaded OpenBLAS then starts threads of its own for matrices from 32
rows on, which spin after each call and take cores from XLA (measured on 2 cores: inverting the
16 factors of a 784-1000-500-250-30 autoencoder by block elimination with 127-row leaves took
113 ms with one OpenBLAS thread and ~2.5 s with two, the machine being busy). The BLAS library
behind SciPy's LAPACK is therefore set to one thread (through `threadpoolctl`); set the
environment variable `EQX_KFAC_LAPACK_THREADS` to another number of threads, or to `keep` to
leave the library as it is.

**glibc's large blocks.** XLA:CPU allocates one scratch buffer per step for all the step's
temporaries (70-90 MiB for that autoencoder's K-FAC step). glibc's `malloc` serves every block
above 32 MiB with a fresh `mmap` and unmaps it when it is freed, so every step faulted its
scratch buffer in again, 4 KiB at a time: about 20,000 page faults per adaptive step. With glibc
(Linux), the library therefore asks `malloc` (`mallopt`) to serve large blocks from its heap
(`M_MMAP_MAX = 0`) and to keep up to `_KEPT_BYTES` of freed memory at the top of the heap
instead of returning it to the system (`M_TRIM_THRESHOLD`), so the next step reuses the pages
already mapped, as the `MALLOC_MMAP_MAX_=0` environment variable would. The autoencoder's adaptive
step inside the caller's `jit`: 182-192 -> 166-169 ms, 20,000 -> 0 page faults per step
(`tests/test_cpu_host.py` checks the faults; `docs/optimizer.md`, "Speed on CPU", has the
measurements). The process keeps memory it has freed for reuse: glibc returns the top of its
heap to the system only once more than `_KEPT_BYTES` is free there, and a freed block below the
top not at all. A block over 64 MiB that XLA allocates on one of its worker threads is mapped
afresh anyway (glibc's per-thread heaps are at most 64 MiB); JAX runs a CPU program on a worker
thread unless its dispatch is synchronous (`jax_cpu_enable_async_dispatch`), the program is tiny,
or it holds a host callback. Set `EQX_KFAC_MALLOC=keep` to leave `malloc` as it is.
"""

import ctypes
import functools
import os
import platform

import jax

_M_TRIM_THRESHOLD = -1  # glibc's `mallopt` parameters (malloc.h)
_M_MMAP_MAX = -4
_KEPT_BYTES = 1 << 30


@functools.cache
def prepare_cpu_host() -> None:
    """Makes the process settings of the module notes (LAPACK's threads, glibc's large blocks),
    once, in a process whose default backend is the CPU."""
    if jax.default_backend() != "cpu":
        return
    limit_lapack_threads()
    keep_large_blocks()


def limit_lapack_threads() -> None:
    """Sets the BLAS library behind jaxlib's CPU LAPACK kernels (SciPy's) to
    `EQX_KFAC_LAPACK_THREADS` threads (default 1; `keep` leaves it alone)."""
    setting = os.environ.get("EQX_KFAC_LAPACK_THREADS", "1")
    if setting == "keep":
        return
    import numpy
    import scipy.linalg  # noqa: F401  (loads the library)
    import threadpoolctl

    controller = threadpoolctl.ThreadpoolController().select(user_api="blas")
    numpy_libs = os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "numpy.libs")
    # NumPy's own BLAS (a separate library in the wheels) is not the one LAPACK calls go to.
    scipy_blas = [c for c in controller.lib_controllers if not c.filepath.startswith(numpy_libs)]
    for library in scipy_blas or controller.lib_controllers:
        library.set_num_threads(int(setting))


def keep_large_blocks() -> bool:
    """With glibc, serves large blocks from `malloc`'s heap and keeps freed memory mapped (see
    the module notes), unless `EQX_KFAC_MALLOC=keep`.

    **Returns:**

    Whether `malloc` was set (`False` without glibc, or with `keep`).

    **Raises:**

    `ValueError` when `EQX_KFAC_MALLOC` is set to anything but `keep`.
    """
    setting = os.environ.get("EQX_KFAC_MALLOC", "")
    if setting not in ("", "keep"):
        raise ValueError(
            f"EQX_KFAC_MALLOC={setting!r}: set it to 'keep' to leave glibc's malloc as it is, or "
            "unset it to let eqx_kfac keep large blocks mapped (see eqx_kfac/_core/cpu_host.py)."
        )
    if setting == "keep" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    # Both are set, or neither would help: without the trim threshold a freed block at the top of
    # the heap is returned to the system at once, and faulted in again at the next step.
    return bool(mallopt(_M_TRIM_THRESHOLD, _KEPT_BYTES)) and bool(mallopt(_M_MMAP_MAX, 0))
