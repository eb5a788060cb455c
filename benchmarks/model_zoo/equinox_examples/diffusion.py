"""The score model and loss of Equinox's "Score-based diffusion" example
(`docs/examples/score_based_diffusion.ipynb`): an MLP-Mixer trained with AdaBelief.

As published: the denoising score-matching loss of the variance-preserving SDE with
`int_beta(t) = t`, weight `1 - exp(-t)`, `t1 = 10` and low-discrepancy times; the `Mixer2d` score
model (the time as an extra input channel, a 4x4 patch `Conv2d` to 64 channels, 4 mixer blocks
with MLPs of width 512 over patches and over channels, `LayerNorm`, a `ConvTranspose2d` back to the
image); `optax.adabelief(3e-4)`. The data: scikit-learn's digits upsampled to 28x28, normalised by
their mean and standard deviation as the notebook normalises MNIST. Scaled to two CPU cores:
batches of 64 instead of 256 (at 256 a K-FAC step took 41 s on the loaded machine). `unet.py` holds
the U-Net the notebook says can be substituted, with the same loss.

The loss registers each example's prediction as a squared error against its target
`-noise / std`, with the per-example weight `weight(t) / 784` (the notebook averages over the 784
pixels), so the registered loss is the notebook's.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

import eqx_kfac

from ...harness import Method, Problem, minibatches, upsampled_digits

NOTEBOOK_OPTIMIZER = Method("adabelief", 3e-4)
T1 = 10.0


def int_beta(t: Float[Array, ""]) -> Float[Array, ""]:
    """The integral of the noise schedule: `beta(t) = 1`."""
    return t


def weight(t: Float[Array, ""]) -> Float[Array, ""]:
    """The loss weight, larger near `t = 0`."""
    return 1 - jnp.exp(-int_beta(t))


class MixerBlock(eqx.Module):
    """An MLP over the patches and one over the channels, each after a `LayerNorm`, with residuals."""

    patch_mixer: eqx.nn.MLP
    hidden_mixer: eqx.nn.MLP
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm

    def __init__(self, patches: int, hidden: int, mix_patch: int, mix_hidden: int, key: PRNGKeyArray):
        key1, key2 = jax.random.split(key)
        self.patch_mixer = eqx.nn.MLP(patches, patches, mix_patch, depth=1, key=key1)
        self.hidden_mixer = eqx.nn.MLP(hidden, hidden, mix_hidden, depth=1, key=key2)
        self.norm1 = eqx.nn.LayerNorm((hidden, patches))
        self.norm2 = eqx.nn.LayerNorm((patches, hidden))

    def __call__(self, y: Float[Array, "hidden patches"]) -> Float[Array, "hidden patches"]:
        y = y + jax.vmap(self.patch_mixer)(self.norm1(y))
        y = y.T
        y = y + jax.vmap(self.hidden_mixer)(self.norm2(y))
        return y.T


class Mixer2d(eqx.Module):
    """The notebook's score model `s(t, y)` for one `(1, 28, 28)` image."""

    conv_in: eqx.nn.Conv2d
    conv_out: eqx.nn.ConvTranspose2d
    blocks: list[MixerBlock]
    norm: eqx.nn.LayerNorm

    def __init__(
        self, key: PRNGKeyArray, image: tuple[int, int, int] = (1, 28, 28), patch: int = 4,
        hidden: int = 64, mix_patch: int = 512, mix_hidden: int = 512, num_blocks: int = 4,
    ):
        channels, height, width = image
        patches = (height // patch) * (width // patch)
        key_in, key_out, *block_keys = jax.random.split(key, 2 + num_blocks)
        self.conv_in = eqx.nn.Conv2d(channels + 1, hidden, patch, stride=patch, key=key_in)
        self.conv_out = eqx.nn.ConvTranspose2d(hidden, channels, patch, stride=patch, key=key_out)
        self.blocks = [MixerBlock(patches, hidden, mix_patch, mix_hidden, k) for k in block_keys]
        self.norm = eqx.nn.LayerNorm((hidden, patches))

    def __call__(self, t: Float[Array, ""], y: Float[Array, "c h w"]) -> Float[Array, "c h w"]:
        _, height, width = y.shape
        time = jnp.broadcast_to(t / T1, (1, height, width))
        y = self.conv_in(jnp.concatenate([y, time]))
        hidden, patch_height, patch_width = y.shape
        y = y.reshape(hidden, patch_height * patch_width)
        for block in self.blocks:
            y = block(y)
        y = self.norm(y).reshape(hidden, patch_height, patch_width)
        return self.conv_out(y)


def score_matching_loss(
    model: Callable[[Array, Array], Array], key: PRNGKeyArray, data: Float[Array, "n c h w"]
) -> Float[Array, ""]:
    """The notebook's batch loss: noise each image to a time `t`, weight the squared error of the
    predicted score; registered with eqx_kfac as a per-example weighted squared error."""
    batch_size = data.shape[0]
    time_key, noise_key = jax.random.split(key)
    # Low-discrepancy sampling over t, to reduce the variance.
    t = jax.random.uniform(time_key, (batch_size,), minval=0, maxval=T1 / batch_size)
    t = t + (T1 / batch_size) * jnp.arange(batch_size)
    mean = data * jnp.exp(-0.5 * int_beta(t))[:, None, None, None]
    std = jnp.sqrt(jnp.maximum(1 - jnp.exp(-int_beta(t)), 1e-5))[:, None, None, None]
    noise = jax.random.normal(noise_key, data.shape, data.dtype)
    prediction = jax.vmap(model)(t, mean + std * noise)
    pixels = prediction[0].size
    flat, target = prediction.reshape(batch_size, pixels), (-noise / std).reshape(batch_size, pixels)
    eqx_kfac.register_squared_error_loss(flat, target, weight=weight(t) / pixels)
    return jnp.mean(weight(t) * jnp.mean((flat - target) ** 2, axis=1))


def images(size: int = 28) -> Float[Array, "1797 1 size size"]:
    """The digits upsampled to `size` x `size`, normalised by their mean and standard deviation."""
    data = upsampled_digits(size)
    return (data - data.mean()) / data.std()


def score_problem(name: str, model: Callable[[Array, Array], Array], batch_size: int = 64) -> Problem:
    """Score matching of `model` on the upsampled digits (the Mixer's, and the U-Net's).

    **Arguments:**

    - `name`: the problem's name.
    - `model`: the score model `model(t, y)`.
    - `batch_size`: images per batch.

    **Returns:**

    The `Problem`.
    """
    return Problem(
        name=name,
        model=model,
        loss=score_matching_loss,
        next_batch=minibatches(images(), batch_size, seed=0),
        has_rng=True,
        batch_size=batch_size,
    )


def problem(key: PRNGKeyArray, batch_size: int = 64) -> Problem:
    """The Mixer's score matching on the upsampled digits."""
    return score_problem("diffusion_mixer", Mixer2d(key), batch_size)
