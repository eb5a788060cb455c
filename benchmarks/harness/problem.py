"""What a benchmark trains: `Problem`, a model, its loss and a stream of batches.

A problem's model is written the way Equinox's documentation writes models (per-example
`__call__`, `jax.vmap` over the batch); its loss registers itself with eqx_kfac (an identity at run
time, so every optimizer trains the same function). The loss has the form `Optimizer` calls:
`loss(model, [func_state], [key], batch)`, returning the loss, or `(loss, func_state)` for a
stateful model (BatchNorm). `next_batch(model, step, key, previous)` returns the batch of a step:
a minibatch of digits, the same full batch every step, or Monte Carlo samples of the current
wavefunction moved on from the previous step's (`None` at the first step).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax


@dataclasses.dataclass(frozen=True)
class Problem:
    """One model and everything needed to train it.

    **Fields:**

    - `name`: the problem's name in tables and test ids.
    - `model`: the initial model (an `eqx.Module`; its inexact arrays are the parameters).
    - `loss`: `loss(model, [func_state], [key], batch)`; registers its losses with eqx_kfac.
    - `next_batch`: `next_batch(model, step, key, previous) -> batch` (`previous` is the last
      step's batch, `None` at the first).
    - `func_state`: the initial `eqx.nn.State` when the model is stateful, else `None`.
    - `has_rng`: whether `loss` takes a PRNG key (dropout, noise).
    - `batch_size`: the number of examples per batch.
    - `exact_loss`: the loss at the optimum when it is known (the ground-state energy of the
      variational Monte Carlo problem), else `None`.
    """

    name: str
    model: Any
    loss: Callable[..., Any]
    next_batch: Callable[[Any, int, Any, Any], Any]
    func_state: Any = None
    has_rng: bool = False
    batch_size: int = 128
    exact_loss: float | None = None

    @property
    def has_state(self) -> bool:
        """Whether the model carries an `eqx.nn.State` (its loss returns `(loss, state)`)."""
        return self.func_state is not None

    def args(self, model: Any, func_state: Any, key: Any, batch: Any) -> tuple:
        """The loss's arguments: `(model, [func_state], [key], batch)`."""
        args = (model,)
        if self.has_state:
            args += (func_state,)
        if self.has_rng:
            args += (key,)
        return args + (batch,)

    def split(self, out: Any, func_state: Any) -> tuple[Any, Any]:
        """`(loss, func_state)` of the loss's output (`func_state` unchanged for a stateless model)."""
        return out if self.has_state else (out, func_state)

    def value_and_grad(self) -> Callable[..., Any]:
        """`eqx.filter_value_and_grad` of the loss (with the state as its auxiliary output)."""
        return eqx.filter_value_and_grad(self.loss, has_aux=self.has_state)

    def first_args(self, seed: int = 0) -> tuple:
        """The loss's arguments at the initial model and the first batch (for tracing)."""
        key = jax.random.key(seed)
        return self.args(self.model, self.func_state, key, self.next_batch(self.model, 0, key, None))


def full_batch(name: str, model: Any, loss: Callable[..., Any], batch: Any, **fields: Any) -> Problem:
    """A problem whose every step sees the same (whole) batch.

    **Arguments:**

    - `name`, `model`, `loss`: as for `Problem`.
    - `batch`: the data set, as the loss takes it.
    - `**fields`: other fields of `Problem` (`func_state`, `has_rng`, `exact_loss`).

    **Returns:**

    The `Problem`.
    """
    return Problem(
        name=name,
        model=model,
        loss=loss,
        next_batch=lambda model, step, key, previous: batch,
        batch_size=len(jax.tree.leaves(batch)[0]),
        **fields,
    )
