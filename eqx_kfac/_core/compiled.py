"""`compiled`: a function that runs as one compiled program when it is called eagerly.

The curvature operators' methods (`as_matrix`, `eigenvalues`, `mv`, an inverse, ...) are made of
many small array operations. Called eagerly, as users call them from a script or a notebook, JAX
compiles each operation on its own: a 3-4-2 MLP's `KFACLinearOperator.as_matrix()` compiled 64
programs (1.3 s) and its `eigenvalues()` 47 (1.4 s). Run through `eqx.filter_jit` each is one
program, compiled once per operator structure. Inside a trace (a user's `jit`, `vmap`, `grad`)
the function is traced inline, as any other.

The library's own compiled programs (these, and `Optimizer.step` called directly) are compiled
with `COMPILER_OPTIONS`; a program it runs once, to check a loss before training, with
`ONE_OFF_COMPILER_OPTIONS`.
"""

import functools
import types
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx

from .tree import any_traced


_F = TypeVar("_F", bound=Callable[..., Any])

COMPILER_OPTIONS = types.MappingProxyType({"xla_gpu_enable_triton_gemm": False})
"""The XLA compiler options of the programs the library compiles itself (read-only):
`Optimizer.step`'s (its default `compiler_options`) and the eager calls compiled by `compiled`.

XLA's Triton GEMM kernels are off: on an NVIDIA GPU their autotuning was most of a K-FAC step's
compilation (an H100, the MNIST CNN example: `kfac_optax`'s compile 19.0 s with them, 1.9 s
without), and other backends ignore the option. `kfac_optax` and `kfac_preconditioner` run inside
your own `jit`, whose compiler options apply: pass these there,
`eqx.filter_jit(train_step, compiler_options=dict(eqx_kfac.COMPILER_OPTIONS))` (or `jax.jit`'s
same keyword).
"""


_FOR_COMPILE_TIME = {"xla_backend_optimization_level": 0, "xla_gpu_autotune_level": 0}


def for_compile_time(options: Any) -> tuple[tuple[str, Any], ...]:
    """`options` (a mapping or `(name, value)` pairs) with LLVM's optimisation of the kernels and
    a GPU's GEMM autotuning off, as sorted pairs: the options of a program run so few times that
    its compilation is most of its cost."""
    return tuple(sorted({**dict(options), **_FOR_COMPILE_TIME}.items()))


ONE_OFF_COMPILER_OPTIONS = types.MappingProxyType(dict(for_compile_time(COMPILER_OPTIONS)))
"""The XLA options of a program the library runs once (the loss checks' one evaluation of the
loss, `_curvature/estimators/loss_checks.py`; `init`'s program building the optimizer state): its
compilation is the whole cost, so LLVM does not optimise its kernels and a GPU's GEMMs are not
autotuned. On the 2-core CPU, the ViT of
`benchmarks/examples.py`: the checks took 2.2-2.4 s with `COMPILER_OPTIONS`, 1.8-1.9 s with these;
FermiNet's He `init` (through `eqx_kfac.kfac_jax`) 1.21 CPU s with the state's program compiled
with `COMPILER_OPTIONS`, 1.17-1.19 s with these (three alternated runs each)."""


@eqx.filter_jit(compiler_options=dict(COMPILER_OPTIONS))
def _call(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return function(*args, **kwargs)


def compiled(function: _F) -> _F:
    """`function`, compiled as a whole (`eqx.filter_jit`) when none of its arguments is traced.

    Arrays are traced arguments; everything else (Python numbers included) is static, so pass a
    number that changes between calls as an array.

    **Arguments:**

    - `function`: a function.

    **Returns:**

    The wrapped function.
    """

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if any_traced((args, kwargs)):
            return function(*args, **kwargs)
        return _call(function, args, kwargs)

    return wrapper  # type: ignore[return-value]
