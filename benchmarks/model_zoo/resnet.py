"""A small ResNet with `eqx.nn.BatchNorm`, whose running statistics live in an `eqx.nn.State`."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..harness import Problem, digit_batches
from .losses import cross_entropy

_AXIS = "batch"


class ResidualBlock(eqx.Module):
    """`x + BN(conv(relu(BN(conv(x)))))`, then ReLU."""

    conv1: eqx.nn.Conv2d
    norm1: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    norm2: eqx.nn.BatchNorm

    def __init__(self, channels: int, mode: str, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.conv1 = eqx.nn.Conv2d(channels, channels, 3, padding=1, use_bias=False, key=k1)
        self.norm1 = eqx.nn.BatchNorm(channels, _AXIS, mode=mode)
        self.conv2 = eqx.nn.Conv2d(channels, channels, 3, padding=1, use_bias=False, key=k2)
        self.norm2 = eqx.nn.BatchNorm(channels, _AXIS, mode=mode)

    def __call__(self, x: Array, state: eqx.nn.State) -> tuple[Array, eqx.nn.State]:
        y, state = self.norm1(self.conv1(x), state)
        y, state = self.norm2(self.conv2(jax.nn.relu(y)), state)
        return jax.nn.relu(x + y), state


class ResNet(eqx.Module):
    """A convolutional stem with BatchNorm, two residual blocks, global average pooling, a head."""

    stem: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    blocks: tuple[ResidualBlock, ...]
    head: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray, channels: int = 16, mode: str = "batch"):
        keys = jax.random.split(key, 4)
        self.stem = eqx.nn.Conv2d(1, channels, 3, padding=1, use_bias=False, key=keys[0])
        self.norm = eqx.nn.BatchNorm(channels, _AXIS, mode=mode)
        self.blocks = tuple(ResidualBlock(channels, mode, k) for k in keys[1:3])
        self.head = eqx.nn.Linear(channels, 10, key=keys[3])

    def __call__(self, x: Float[Array, "1 8 8"], state: eqx.nn.State) -> tuple[Array, eqx.nn.State]:
        x, state = self.norm(self.stem(x), state)
        x = jax.nn.relu(x)
        for block in self.blocks:
            x, state = block(x, state)
        return self.head(jnp.mean(x, axis=(1, 2))), state


def loss(
    model: ResNet, state: eqx.nn.State, batch: tuple[Float[Array, "n 1 8 8"], Int[Array, " n"]]
) -> tuple[Float[Array, ""], eqx.nn.State]:
    """Mean softmax cross-entropy, and the updated BatchNorm state."""
    images, labels = batch
    forward = jax.vmap(model, axis_name=_AXIS, in_axes=(0, None), out_axes=(0, None))
    logits, state = forward(images, state)
    return cross_entropy(logits, labels), state


def problem(key: PRNGKeyArray, batch_size: int = 128, mode: str = "batch") -> Problem:
    """The ResNet on the digits (`mode` is BatchNorm's: `"batch"` or `"ema"`)."""
    model, state = eqx.nn.make_with_state(ResNet)(key, mode=mode)
    return Problem(
        name="resnet",
        model=model,
        loss=loss,
        next_batch=digit_batches(batch_size, lambda x: x.reshape(-1, 1, 8, 8)),
        func_state=state,
        batch_size=batch_size,
    )
