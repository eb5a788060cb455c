"""`FlatJit`: a function of PyTrees compiled over their array leaves, as `eqx.filter_jit`
compiles it, whose later calls go straight to `jax.jit`'s dispatch.

`eqx.filter_jit` partitions its arguments into arrays and the rest, and hashes the rest, at every
call; its outputs are combined likewise. For `Optimizer.step` called directly on a small model
that Python work was most of the step: on FermiNet's He atom (64 walkers, the machine loaded),
3.6 ms of the step's 13.9 ms, and the multi-device placement's walk through the state 3.2 ms
more (5.8 ms once both were gone and the drop-in's copies flattened once). Here the arguments
are flattened once per call; the structure, the non-array leaves and the arrays' shapes key a
cache of what the first call worked out (which leaves are arrays and which are donated, and the
outputs' structure), and the arrays go to a `jax.jit` of the flat list.

What is an array, and what is static, is as for `eqx.filter_jit`: arrays (`jax.Array`, NumPy
arrays and scalars) are traced, every other leaf is static (compared by equality, so hashable).
"""

import threading
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from .tree import filled

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def _split(leaves: list[Any]) -> tuple[list[Any], list[int]]:
    """The leaves with their arrays left out (`None`), and the arrays' positions."""
    template = [None if isinstance(x, _ARRAY_TYPES) else x for x in leaves]
    return template, [i for i, x in enumerate(leaves) if isinstance(x, _ARRAY_TYPES)]


class _Program:
    """What the calls of one argument structure share: the positions of the array leaves, the
    static leaves, the jitted function of the arrays, the outputs' structure (known once traced)
    and, where the caller places the arguments, their shardings."""

    def __init__(
        self, fn: Callable[..., Any], treedef: Any, leaves: list[Any], donate_args: frozenset[int],
        compiler_options: dict[str, Any] | None,
    ):
        self.treedef = treedef
        self.template, self.positions = _split(leaves)
        owner, ends = 0, np.cumsum([child.num_leaves for child in treedef.children()])
        donated = []
        for k, position in enumerate(self.positions):
            while position >= ends[owner]:
                owner += 1
            if owner in donate_args:
                donated.append(k)
        self.out: tuple[Any, list[Any], list[int]] | None = None
        self.shardings: list[Any] | None = None
        self.background: Background | None = None
        self.jitted = jax.jit(self._flat(fn), donate_argnums=tuple(donated), compiler_options=compiler_options)

    def _flat(self, fn: Callable[..., Any]) -> Callable[..., list[Any]]:
        def flat(*arrays: Any) -> list[Any]:
            out_leaves, out_def = jax.tree.flatten(fn(*self.arguments(arrays)))
            out_template, out_positions = _split(out_leaves)
            self.out = (out_def, out_template, out_positions)
            return [out_leaves[i] for i in out_positions]

        # (Named as `fn`, as the compilation's log and `jax.monitoring` events name it; not
        # `functools.wraps`, whose `__wrapped__` would give `jit` `fn`'s signature.)
        flat.__name__, flat.__qualname__ = fn.__name__, fn.__qualname__
        return flat

    def arguments(self, arrays: Any) -> tuple[Any, ...]:
        return jax.tree.unflatten(self.treedef, filled(self.template, self.positions, arrays))

    def outputs(self, arrays: list[Any]) -> Any:
        assert self.out is not None  # (set when `jitted` traced `flat`)
        out_def, template, positions = self.out
        return jax.tree.unflatten(out_def, filled(template, positions, arrays))

    def placed(self, arrays: list[Any]) -> list[Any]:
        """`arrays`, each where the first call placed its counterpart (`jax.device_put` of those
        that are not, in one call)."""
        moved = [k for k, (x, s) in enumerate(zip(arrays, self.shardings)) if getattr(x, "sharding", None) != s]
        if not moved:
            return arrays
        put = jax.device_put([arrays[k] for k in moved], [self.shardings[k] for k in moved])
        return filled(arrays, moved, put)


class FlatJit:
    """`fn` compiled over the array leaves of its positional arguments (`eqx.filter_jit`'s
    partition), with `compiler_options` outside a trace (JAX takes them on an outermost `jit`
    only) and the arrays of the arguments at `donate_args` donated.

    `place`, given to a call, is applied to the arguments outside a trace before the first call
    of their structure; later calls put each array that does not lie where that call's
    counterpart was placed there (the batch, and the caller's new arrays), and leave the others
    (the previous step's outputs) as they are. JAX keys its compiled programs by the arguments'
    shardings too: the multi-device step's first call (the caller's arrays on one device) and
    the next (the first one's outputs, on the mesh) would otherwise compile it twice.

    **Arguments:**

    - `fn`: the function.
    - `donate_args`: the positions of the arguments whose arrays are donated.
    - `compiler_options`: XLA's options (`jax.jit`'s), or `None`.
    """

    def __init__(
        self, fn: Callable[..., Any], donate_args: frozenset[int] = frozenset(),
        compiler_options: dict[str, Any] | None = None,
    ):
        self.fn = fn
        self.donate_args = donate_args
        self.compiler_options = compiler_options
        self._programs: dict[Hashable, _Program] = {}

    def _prepared(
        self, args: tuple[Any, ...], place: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None
    ) -> tuple[_Program, list[Any]]:
        leaves, treedef = jax.tree.flatten(args)
        arrays = [x for x in leaves if isinstance(x, _ARRAY_TYPES)]
        traced = any(isinstance(x, jax.core.Tracer) for x in arrays)
        key = (
            traced, treedef, tuple(x for x in leaves if not isinstance(x, _ARRAY_TYPES)),
            tuple(x.shape for x in arrays),
        )
        program = self._programs.get(key)
        if program is None:
            options = None if traced else self.compiler_options
            program = self._programs[key] = _Program(self.fn, treedef, leaves, self.donate_args, options)
        if place is None or traced:
            return program, arrays
        if program.shardings is not None:
            return program, program.placed(arrays)
        placed = place(args)
        arrays = [x for x in jax.tree.leaves(placed) if isinstance(x, _ARRAY_TYPES)]
        program.shardings = [getattr(x, "sharding", None) for x in arrays]
        return program, arrays

    def __call__(self, *args: Any, place: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None) -> Any:
        """`fn(*args)`, compiled.

        **Arguments:**

        - `args`: `fn`'s arguments.
        - `place`: a function of the arguments' tuple that returns them placed (see above), or
          `None`.

        **Returns:**

        `fn`'s outputs.
        """
        program, arrays = self._prepared(args, place)
        if program.background is not None:  # compiling in a thread: wait for it, not compile again
            program.background.wait()
            program.background = None
        return program.outputs(program.jitted(*arrays))

    def lower(self, *args: Any, place: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None) -> Any:
        """The program of `self(*args, place=place)`, lowered (`jax.stages.Lowered`): its
        `compile()` compiles the program a later call runs.

        **Arguments:**

        - `args`, `place`: as for a call.

        **Returns:**

        The lowered program.
        """
        program, arrays = self._prepared(args, place)
        return program.jitted.lower(*arrays)

    def compile_in_background(
        self, *args: Any, place: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None
    ) -> "Background":
        """Starts compiling the program of `self(*args, place=place)` in a thread of its own (XLA
        compiles without Python's lock, so the caller goes on meanwhile), once per structure: a
        call of that program waits for the thread instead of compiling it again.

        **Arguments:**

        - `args`, `place`: as for a call (outside a trace).

        **Returns:**

        The compilation's `Background` handle: the same one until the program is called (after
        that, a new thread, which finds the program in JAX's caches).
        """
        program, arrays = self._prepared(args, place)
        if program.background is None:
            program.background = Background(lambda: program.jitted.lower(*arrays).compile())
        return program.background


class Background:
    """A function run in a thread of its own. An error in it is dropped: the program's own call
    traces and compiles it again, and raises the error in the caller's thread.

    The thread is not a daemon: a script that ends while a compilation runs (a warm start whose
    K-FAC step was never needed) waits for it at exit. A daemon thread inside XLA's compiler when
    the interpreter shuts down aborted the process ("FATAL: exception not rethrown", exit code
    134) after the script's own work was done.

    **Arguments:**

    - `fn`: the function.
    """

    def __init__(self, fn: Callable[[], Any]):
        def run() -> None:
            try:
                fn()
            except Exception:  # noqa: BLE001 -- raised again by the call, in the caller's thread
                pass

        self._thread = threading.Thread(target=run, name="eqx_kfac-compile", daemon=False)
        self._thread.start()

    def done(self) -> bool:
        """Whether the function has returned."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Returns once the function has returned."""
        self._thread.join()
