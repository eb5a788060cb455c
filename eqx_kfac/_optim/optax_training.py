"""`OptaxTraining`: a ready training step for an optax transformation (`kfac_optax`'s above all)
that trains from its first call.

`kfac_optax` runs inside the user's own `jit`, so its step compiles, as one program with the
loss's gradient, before the first step can run: on 2 CPU cores 2-6 times the first call of the
optimizer a model's example tunes (`benchmarks/flax_examples.py`). `OptaxTraining` owns that
step instead. With a `WarmStart`, its first `steps` calls take a step of a first-order
transformation (a program as small as the baseline's own), while the transformation's step
compiles in a thread; the call after them takes the transformation's first step, waiting for its
compilation if it has not ended (or, with `switch_when_ready=True`, the first call after the
compilation has ended). Without one it is the usual training step, compiled once.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, PRNGKeyArray, PyTree

from .._core.tree import any_traced
from .compilation import jit_program
from .optimizer_step import applied
from .warm_start import WarmStart, WarmStartState
from .warm_start_step import warm_update


class OptaxTrainingState(eqx.Module):
    """The state of an `OptaxTraining` (final).

    **Fields:**

    - `opt_state`: the transformation's state (what its `init` made, updated by its steps).
    - `warm_start_state`: the warm start's state (`None` without a `WarmStart`).
    - `switched`: whether the transformation's steps have begun (kept as it was once they have,
      so reading it never waits for a step).
    """

    opt_state: PyTree[Any]
    warm_start_state: WarmStartState | None
    switched: Bool[Array, ""]


def _value_and_grad(loss_fn: Callable[..., Any], has_aux: bool, params: Any, loss_args: tuple) -> tuple[Any, Any, Any]:
    """`(loss_fn's output, its loss, the gradient)` at `params`, the loss's other arguments `loss_args`."""
    out, grads = eqx.filter_value_and_grad(loss_fn, has_aux=has_aux)(params, *loss_args)
    return out, out[0] if has_aux else out, grads


def _transformation_step(
    loss_fn: Callable[..., Any], has_aux: bool, transformation: optax.GradientTransformation,
    params: Any, opt_state: Any, loss_args: tuple, key: Any,
) -> tuple[Any, Any, Any]:
    """One step of `transformation` (given `loss_args=`, `value=` and, when there is one, `key=`,
    where it takes extra arguments, as `kfac_optax` does)."""
    out, loss, grads = _value_and_grad(loss_fn, has_aux, params, loss_args)
    extra = {}
    if isinstance(transformation, optax.GradientTransformationExtraArgs):
        extra = dict(loss_args=loss_args, value=loss) | ({} if key is None else dict(key=key))
    updates, opt_state = transformation.update(grads, opt_state, eqx.filter(params, eqx.is_inexact_array), **extra)
    return applied(params, updates), opt_state, out


def _warm_step(
    loss_fn: Callable[..., Any], has_aux: bool, warm_start: WarmStart, params: Any, state: WarmStartState,
    loss_args: tuple,
) -> tuple[Any, WarmStartState, Any]:
    """One step of the warm start's transformation (skipped, but for its count, where the loss,
    gradient or update is not finite)."""
    out, loss, grads = _value_and_grad(loss_fn, has_aux, params, loss_args)
    params, transformation_state, _ = warm_update(
        warm_start.transformation, params, grads, loss, state.transformation_state
    )
    return params, WarmStartState(transformation_state, state.steps_taken + 1, state.burnin_updates), out


_STEP = jit_program(_transformation_step, ())
_WARM_STEP = jit_program(_warm_step, ())


class OptaxTraining(eqx.Module):
    """A training step for an optax transformation, e.g. `kfac_optax`'s, that starts training at
    once: with a `warm_start`, first-order steps run while the transformation's step compiles in
    a thread (final). See the module's docs and "K-FAC in seconds" in the docs.

    ```python
    transform = eqx_kfac.kfac_optax(loss_fn, (model, batch), learning_rate=0.1)
    training = eqx_kfac.OptaxTraining(loss_fn, transform, warm_start=eqx_kfac.WarmStart(20))
    state = training.init(model)
    for i, batch in enumerate(batches):
        model, state, loss = training.step(model, state, batch, key=jax.random.key(i))
    ```

    The loss's other arguments (a batch, a PRNG key for dropout, a model state such as
    `eqx.nn.State`) are `step`'s after the state; a loss that returns a new model state returns
    `(loss, aux)` with `has_aux=True`, and the caller passes it to the next step.

    Each kind of step is one compiled program, shared by every `OptaxTraining` of the same
    functions; nothing is donated. Called inside a user's own `jit` (or `vmap`), a step is the
    transformation's step, and the warm start's state is kept as it was. The warm start's
    `burnin_updates` stays 0: `kfac_optax` makes its burn-in's updates in its first step.

    **Fields:**

    - `loss_fn`: `loss_fn(params, *loss_args)`, the loss (with `has_aux`, `(loss, aux)`), with
      its losses registered as `kfac_optax` needs.
    - `transformation`: the optax transformation (an `optax.GradientTransformationExtraArgs`,
      such as `kfac_optax`'s, is given `loss_args=`, `value=` (the loss) and `key=`).
    - `warm_start`: a `WarmStart`, or `None` (the transformation from the first call).
    - `has_aux`: whether `loss_fn` returns `(loss, aux)`.
    """

    loss_fn: Callable[..., Any] = eqx.field(static=True)
    transformation: optax.GradientTransformation = eqx.field(static=True)
    warm_start: WarmStart | None = None
    has_aux: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        if not callable(self.loss_fn):
            raise TypeError(f"OptaxTraining(loss_fn=...) must be callable, got {type(self.loss_fn).__name__}.")
        if not all(callable(getattr(self.transformation, name, None)) for name in ("init", "update")):
            raise TypeError(
                "OptaxTraining(transformation=...) must be an optax GradientTransformation (with "
                f"`init` and `update`), e.g. eqx_kfac.kfac_optax(...); got {type(self.transformation).__name__}."
            )
        if self.warm_start is not None and not isinstance(self.warm_start, WarmStart):
            raise TypeError(
                "OptaxTraining(warm_start=...) must be an eqx_kfac.WarmStart or None, got "
                f"{type(self.warm_start).__name__}."
            )

    def init(self, params: PyTree) -> OptaxTrainingState:
        """The state before the first step.

        **Arguments:**

        - `params`: the parameters (a PyTree or an `eqx.Module`; its inexact arrays are trained).

        **Returns:**

        An `OptaxTrainingState`.
        """
        opt_state = self.transformation.init(eqx.filter(params, eqx.is_inexact_array))
        warm = None if self.warm_start is None or self.warm_start.steps == 0 else self.warm_start.init(params)
        return OptaxTrainingState(opt_state, warm, jnp.asarray(warm is None))

    def step(
        self, params: PyTree, state: OptaxTrainingState, *loss_args: Any, key: PRNGKeyArray | None = None
    ) -> tuple[PyTree, OptaxTrainingState, Any]:
        """One training step: the warm start's while it lasts, then the transformation's.

        **Arguments:**

        - `params`: the parameters.
        - `state`: the state (`init`'s, then the previous step's).
        - `loss_args`: `loss_fn`'s arguments after the parameters (e.g. the batch).
        - `key`: a PRNG key for the transformation (`kfac_optax` needs one for a sampled
          estimation mode), or `None`.

        **Returns:**

        `(params, state, out)`: the new parameters and state, and `loss_fn`'s output at the
        parameters before the step.
        """
        args = (self.loss_fn, self.has_aux, self.transformation, params, state.opt_state, loss_args, key)
        warm = state.warm_start_state
        if warm is not None and not any_traced((params, state, loss_args, key)):
            taken, switched = (int(x) for x in jax.device_get((warm.steps_taken, state.switched)))
            if not switched and self.warm_start.takes_the_call(taken, lambda: _STEP.compile_in_background(*args)):
                params, warm, out = _WARM_STEP(self.loss_fn, self.has_aux, self.warm_start, params, warm, loss_args)
                if taken == 0:
                    _STEP.compile_in_background(*args)
                return params, OptaxTrainingState(state.opt_state, warm, state.switched), out
            if not switched:
                state = OptaxTrainingState(state.opt_state, warm, jnp.asarray(True))
        params, opt_state, out = _STEP(*args)
        return params, OptaxTrainingState(opt_state, state.warm_start_state, state.switched), out
