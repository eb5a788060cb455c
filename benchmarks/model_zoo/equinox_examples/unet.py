"""The U-Net of Equinox's "U-Net" example (`docs/examples/unet.ipynb`), the score model the
diffusion example says can replace its Mixer; trained on the same loss and data (`diffusion.py`).

As published: sinusoidal time embedding and an MLP; a first 3x3 convolution; down and up paths of
residual blocks (`GroupNorm`, SiLU, 3x3 convolutions, the time added per channel, a 1x1
convolution on the skip path), downsampling by a stride-2 `Conv2d` and upsampling by a stride-2
`ConvTranspose2d` (the notebook's `is_biggan=False`), linear-time self-attention at the listed
resolutions, skip connections concatenated on the way up; `GroupNorm`, SiLU and a 1x1 convolution
at the end. The notebook gives no configuration; this one is small: width 16, multipliers (1, 2),
2 residual blocks per level, attention at 14x14 (4 heads of 32), 28x28 images, and no dropout
(rate 0: the blocks' `Dropout` layers are left out).
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ...harness import Problem
from .diffusion import score_problem


class SinusoidalEmbedding(eqx.Module):
    """The time as `dim` sines and cosines of geometrically spaced frequencies."""

    frequencies: Array

    def __init__(self, dim: int):
        half = dim // 2
        self.frequencies = jnp.exp(jnp.arange(half) * -(math.log(10000) / (half - 1)))

    def __call__(self, t: Float[Array, ""]) -> Float[Array, " dim"]:
        angles = t * self.frequencies
        return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)])


class LinearAttention(eqx.Module):
    """Linear-time self-attention over the pixels, added to its input."""

    norm: eqx.nn.GroupNorm
    to_qkv: eqx.nn.Conv2d
    to_out: eqx.nn.Conv2d
    heads: int = eqx.field(static=True)

    def __init__(self, dim: int, key: PRNGKeyArray, heads: int = 4, dim_head: int = 32):
        key1, key2 = jax.random.split(key)
        self.norm = eqx.nn.GroupNorm(min(dim // 4, 32), dim)
        self.heads = heads
        self.to_qkv = eqx.nn.Conv2d(dim, 3 * heads * dim_head, 1, key=key1)
        self.to_out = eqx.nn.Conv2d(heads * dim_head, dim, 1, key=key2)

    def __call__(self, x: Float[Array, "c h w"]) -> Float[Array, "c h w"]:
        c, h, w = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(3, self.heads, -1, h * w)
        q, k, v = qkv[0], jax.nn.softmax(qkv[1], axis=-1), qkv[2]
        context = jnp.einsum("hdn,hen->hde", k, v)
        out = jnp.einsum("hde,hdn->hen", context, q).reshape(-1, h, w)
        return self.to_out(out) + x


class ResnetBlock(eqx.Module):
    """`GroupNorm`, SiLU, (re)sampling, 3x3 conv, + time, `GroupNorm`, SiLU, 3x3 conv, with a
    1x1-conv skip path, then optional attention."""

    time_linear: eqx.nn.Linear
    norm1: eqx.nn.GroupNorm
    conv1: eqx.nn.Conv2d
    norm2: eqx.nn.GroupNorm
    conv2: eqx.nn.Conv2d
    scaling: eqx.nn.Conv2d | eqx.nn.ConvTranspose2d | None
    skip: eqx.nn.Conv2d | None
    attention: LinearAttention | None

    def __init__(
        self, dim_in: int, dim_out: int, time_dim: int, key: PRNGKeyArray, sampling: str | None = None,
        attention: bool = False,
    ):
        keys = jax.random.split(key, 6)
        self.time_linear = eqx.nn.Linear(time_dim, dim_out, key=keys[0])
        self.norm1 = eqx.nn.GroupNorm(min(dim_in // 4, 32), dim_in)
        self.conv1 = eqx.nn.Conv2d(dim_in, dim_out, 3, padding=1, key=keys[1])
        self.norm2 = eqx.nn.GroupNorm(min(dim_out // 4, 32), dim_out)
        self.conv2 = eqx.nn.Conv2d(dim_out, dim_out, 3, padding=1, key=keys[2])
        self.scaling = {
            None: None,
            "up": eqx.nn.ConvTranspose2d(dim_in, dim_in, 4, stride=2, padding=1, key=keys[3]),
            "down": eqx.nn.Conv2d(dim_in, dim_in, 3, stride=2, padding=1, key=keys[3]),
        }[sampling]
        needs_skip = dim_in != dim_out or sampling is not None
        self.skip = eqx.nn.Conv2d(dim_in, dim_out, 1, key=keys[4]) if needs_skip else None
        self.attention = LinearAttention(dim_out, keys[5]) if attention else None

    def __call__(self, x: Float[Array, "c h w"], t: Float[Array, " t"]) -> Float[Array, "d h2 w2"]:
        h = jax.nn.silu(self.norm1(x))
        if self.scaling is not None:
            h, x = self.scaling(h), self.scaling(x)
        h = self.conv1(h) + self.time_linear(jax.nn.silu(t))[:, None, None]
        h = self.conv2(jax.nn.silu(self.norm2(h)))
        out = (h + (x if self.skip is None else self.skip(x))) / jnp.sqrt(2.0)
        return out if self.attention is None else self.attention(out)


class UNet(eqx.Module):
    """The score model `s(t, y)` for one `(channels, height, width)` image."""

    time_embedding: SinusoidalEmbedding
    time_mlp: eqx.nn.MLP
    first_conv: eqx.nn.Conv2d
    down: list[ResnetBlock]
    middle: list[ResnetBlock]
    up: list[ResnetBlock]
    final_norm: eqx.nn.GroupNorm
    final_conv: eqx.nn.Conv2d

    def __init__(
        self, key: PRNGKeyArray, image: tuple[int, int, int] = (1, 28, 28), hidden: int = 16,
        multipliers: tuple[int, ...] = (1, 2), blocks: int = 2, attention_at: tuple[int, ...] = (14,),
    ):
        channels, size, _ = image
        keys = iter(jax.random.split(key, 64))
        dims = [hidden] + [hidden * m for m in multipliers]
        levels = list(zip(dims[:-1], dims[1:]))
        self.time_embedding = SinusoidalEmbedding(hidden)
        self.time_mlp = eqx.nn.MLP(hidden, hidden, 4 * hidden, 1, activation=jax.nn.silu, key=next(keys))
        self.first_conv = eqx.nn.Conv2d(channels, hidden, 3, padding=1, key=next(keys))
        self.down, self.up = [], []
        for index, (dim_in, dim_out) in enumerate(levels):
            attend = size in attention_at
            self.down.append(ResnetBlock(dim_in, dim_out, hidden, next(keys), attention=attend))
            for _ in range(blocks - 2):
                self.down.append(ResnetBlock(dim_out, dim_out, hidden, next(keys), attention=attend))
            if index < len(levels) - 1:
                self.down.append(ResnetBlock(dim_out, dim_out, hidden, next(keys), "down", attend))
                size //= 2
        self.middle = [
            ResnetBlock(dims[-1], dims[-1], hidden, next(keys), attention=True),
            ResnetBlock(dims[-1], dims[-1], hidden, next(keys)),
        ]
        for index, (dim_in, dim_out) in enumerate(reversed(levels)):
            attend = size in attention_at
            for _ in range(blocks - 1):
                self.up.append(ResnetBlock(2 * dim_out, dim_out, hidden, next(keys), attention=attend))
            self.up.append(ResnetBlock(dim_out + dim_in, dim_in, hidden, next(keys), attention=attend))
            if index < len(levels) - 1:
                self.up.append(ResnetBlock(dim_in, dim_in, hidden, next(keys), "up", attend))
                size *= 2
        self.final_norm = eqx.nn.GroupNorm(min(hidden // 4, 32), hidden)
        self.final_conv = eqx.nn.Conv2d(hidden, channels, 1, key=next(keys))

    def __call__(self, t: Float[Array, ""], y: Float[Array, "c h w"]) -> Float[Array, "c h w"]:
        t = self.time_mlp(self.time_embedding(t))
        h = self.first_conv(y)
        skips = [h]
        for block in self.down:
            h = block(h, t)
            skips.append(h)
        for block in self.middle:
            h = block(h, t)
        for block in self.up:
            h = block(h if block.scaling is not None else jnp.concatenate([h, skips.pop()]), t)
        return self.final_conv(jax.nn.silu(self.final_norm(h)))


def problem(key: PRNGKeyArray, batch_size: int = 64) -> Problem:
    """The U-Net's score matching on the upsampled digits (the diffusion example's loss and data)."""
    return score_problem("diffusion_unet", UNet(key), batch_size)
