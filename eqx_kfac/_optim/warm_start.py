"""`WarmStart`: first-order steps while the K-FAC programs compile in threads of their own.

A directly called `Optimizer.step` compiles its K-FAC step (and the burn-in's update) before its
first step can run: on 2 CPU cores 5-11 times the first call of the optimizer a model's example
tunes (`benchmarks/flax_examples.py`). With a `WarmStart`, the first `steps` calls take a step of
an optax transformation instead (a program as small as the baseline's own), while both K-FAC
programs compile in threads; the last `num_burnin_steps` of those calls also make the burn-in's
curvature updates, on their own batches, at the parameters of that moment. The call after them
takes the first K-FAC step, waiting for its compilation if it has not ended.

The switch is deterministic by default (the same steps whatever the machine's speed);
`switch_when_ready=True` switches at the first call after the step's compilation has ended
instead (and makes the burn-in's updates as soon as their program is ready), which is faster and
depends on timing. Inside a user's own `jit`, a warm start does nothing (the step is K-FAC's from
the first call): the user's trace compiles everything at once anyway.
"""

from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int, PyTree

from .._core.flat_jit import Background


class WarmStartState(eqx.Module):
    """The state of a `WarmStart` (inside `Optimizer.State`; final).

    **Fields:**

    - `transformation_state`: the optax transformation's state.
    - `steps_taken`: the warm start's steps taken so far.
    - `burnin_updates`: the burn-in's curvature updates made so far (on the warm start's batches).
    """

    transformation_state: PyTree[Array]
    steps_taken: Int[Array, ""]
    burnin_updates: Int[Array, ""]


class WarmStart(eqx.Module):
    """First-order steps taken by a directly called `Optimizer.step` while its K-FAC programs
    compile in the background (final). See the module's docs and "K-FAC in seconds" in the docs.

    **Fields:**

    - `steps`: the number of warm-start steps (the first K-FAC step is the call after them). Pick
      about the K-FAC step's compilation time divided by a first-order step's time.
    - `transformation`: the optax transformation of those steps (default `optax.adam(1e-3)`; your
      example's own optimizer is the natural choice). Its updates are added to the parameters.
    - `switch_when_ready`: switch to K-FAC at the first call after the step's compilation has
      ended (at most after `steps` calls), not after exactly `steps` calls: faster, and
      dependent on timing.
    """

    steps: int = eqx.field(static=True)
    transformation: optax.GradientTransformation = eqx.field(static=True, default=optax.adam(1e-3))
    switch_when_ready: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        if not isinstance(self.steps, int) or isinstance(self.steps, bool):
            raise TypeError(f"WarmStart(steps=...) must be an int, got {self.steps!r}.")
        if self.steps < 0:
            raise ValueError(f"WarmStart(steps=...) must be non-negative, got {self.steps}.")
        if not all(callable(getattr(self.transformation, name, None)) for name in ("init", "update")):
            raise TypeError(
                "WarmStart(transformation=...) must be an optax GradientTransformation (with "
                f"`init` and `update`), e.g. optax.adam(1e-3); got {type(self.transformation).__name__}."
            )

    def init(self, params: PyTree) -> WarmStartState:
        """The state before the first step.

        **Arguments:**

        - `params`: the parameters (their inexact arrays are trained).

        **Returns:**

        A `WarmStartState` with no step taken.
        """
        filtered = eqx.filter(params, eqx.is_inexact_array)
        zero = jnp.zeros((), jnp.int32)
        return WarmStartState(self.transformation.init(filtered), zero, zero)

    def takes_the_call(self, taken: int, compile_main_step: Callable[[], Background]) -> bool:
        """Whether the next call is one of this warm start's steps, after `taken` of them: not
        once `steps` were taken, nor, with `switch_when_ready`, once the main step has compiled.
        From the second call on, `compile_main_step()` makes sure the main step is compiling
        (in a thread, once); the first call's own program compiles first (tracing in a thread
        holds Python's lock), and the caller starts the main step's after it.

        **Arguments:**

        - `taken`: the warm steps taken (read from the state).
        - `compile_main_step`: starts the main step's compilation if it has not started, and
          returns its future.

        **Returns:**

        `True` for a warm step, `False` for the main step.
        """
        if taken >= self.steps:
            return False
        return taken == 0 or not (compile_main_step().done() and self.switch_when_ready)
