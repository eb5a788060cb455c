"""`compiled`: a function that runs as one compiled program when it is called eagerly.

The curvature operators' methods (`as_matrix`, `eigenvalues`, `mv`, an inverse, ...) are made of
many small array operations. Called eagerly, as users call them from a script or a notebook, JAX
compiles each operation on its own: a 3-4-2 MLP's `KFACLinearOperator.as_matrix()` compiled 64
programs (1.3 s) and its `eigenvalues()` 47 (1.4 s). Run through `eqx.filter_jit` each is one
program, compiled once per operator structure. Inside a trace (a user's `jit`, `vmap`, `grad`)
the function is traced inline, as any other.
"""

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx

from .tree import any_traced


_F = TypeVar("_F", bound=Callable[..., Any])


@eqx.filter_jit
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
