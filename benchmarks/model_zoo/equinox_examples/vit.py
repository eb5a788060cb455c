"""The vision transformer of Equinox's "Vision Transformer" example
(`docs/examples/vision_transformer.ipynb`), trained with AdamW.

As published: the image cut into 4x4 patches, each embedded by a `Linear`; a learned class token
and positional embedding (plain arrays); 6 pre-norm attention blocks (`LayerNorm`,
`MultiheadAttention` with 8 heads, an MLP with GELU and hidden width 256, dropout 0.1); the class
token's `LayerNorm` + `Linear` head; softmax cross-entropy; batches of 64; `optax.adamw(1e-4,
b1=0.9, b2=0.999)`. Scaled to two CPU cores: 16x16 one-channel images (scikit-learn's digits,
upsampled and normalised) instead of CIFAR-10's 32x32x3, so 16 patches, and an embedding width of
128 instead of 512. Each block gets its own initialisation key (the notebook gives all six the
same one).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ...harness import Method, Problem, digits, minibatches, upsampled_digits
from ..losses import cross_entropy

NOTEBOOK_OPTIMIZER = Method("adamw", 1e-4, {"b1": 0.9, "b2": 0.999})
IMAGE_SIZE = 16
PATCH_SIZE = 4


class PatchEmbedding(eqx.Module):
    """Cuts a `(channels, height, width)` image into patches and embeds each with a `Linear`."""

    linear: eqx.nn.Linear
    patch_size: int = eqx.field(static=True)

    def __init__(self, channels: int, width: int, patch_size: int, key: PRNGKeyArray):
        self.patch_size = patch_size
        self.linear = eqx.nn.Linear(patch_size**2 * channels, width, key=key)

    def __call__(self, x: Float[Array, "c h w"]) -> Float[Array, "patches width"]:
        c, h, w = x.shape
        p = self.patch_size
        patches = x.reshape(c, h // p, p, w // p, p).transpose(1, 3, 0, 2, 4)
        return jax.vmap(self.linear)(patches.reshape((h // p) * (w // p), c * p * p))


class AttentionBlock(eqx.Module):
    """Pre-norm self-attention and MLP, each added to its input."""

    layer_norm1: eqx.nn.LayerNorm
    layer_norm2: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear
    dropout1: eqx.nn.Dropout
    dropout2: eqx.nn.Dropout

    def __init__(self, width: int, hidden: int, heads: int, dropout: float, key: PRNGKeyArray):
        key1, key2, key3 = jax.random.split(key, 3)
        self.layer_norm1 = eqx.nn.LayerNorm(width)
        self.layer_norm2 = eqx.nn.LayerNorm(width)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=key1)
        self.linear1 = eqx.nn.Linear(width, hidden, key=key2)
        self.linear2 = eqx.nn.Linear(hidden, width, key=key3)
        self.dropout1 = eqx.nn.Dropout(dropout)
        self.dropout2 = eqx.nn.Dropout(dropout)

    def __call__(self, x: Float[Array, "n width"], key: PRNGKeyArray) -> Float[Array, "n width"]:
        normed = jax.vmap(self.layer_norm1)(x)
        x = x + self.attention(normed, normed, normed)
        key1, key2 = jax.random.split(key)
        hidden = jax.nn.gelu(jax.vmap(self.linear1)(jax.vmap(self.layer_norm2)(x)))
        hidden = self.dropout1(hidden, key=key1)
        return x + self.dropout2(jax.vmap(self.linear2)(hidden), key=key2)


class VisionTransformer(eqx.Module):
    """Patch embedding, class token, positional embedding, attention blocks, class-token head."""

    patch_embedding: PatchEmbedding
    positional_embedding: Array
    cls_token: Array
    blocks: list[AttentionBlock]
    dropout: eqx.nn.Dropout
    head: eqx.nn.Sequential

    def __init__(
        self, key: PRNGKeyArray, channels: int = 1, width: int = 128, hidden: int = 256,
        heads: int = 8, layers: int = 6, dropout: float = 0.1, classes: int = 10,
    ):
        keys = jax.random.split(key, 4 + layers)
        patches = (IMAGE_SIZE // PATCH_SIZE) ** 2
        self.patch_embedding = PatchEmbedding(channels, width, PATCH_SIZE, keys[0])
        self.positional_embedding = jax.random.normal(keys[1], (patches + 1, width))
        self.cls_token = jax.random.normal(keys[2], (1, width))
        self.blocks = [AttentionBlock(width, hidden, heads, dropout, k) for k in keys[4:]]
        self.dropout = eqx.nn.Dropout(dropout)
        self.head = eqx.nn.Sequential([eqx.nn.LayerNorm(width), eqx.nn.Linear(width, classes, key=keys[3])])

    def __call__(self, x: Float[Array, "c h w"], key: PRNGKeyArray) -> Float[Array, " classes"]:
        x = jnp.concatenate([self.cls_token, self.patch_embedding(x)])
        x = x + self.positional_embedding[: x.shape[0]]
        key, *block_keys = jax.random.split(key, len(self.blocks) + 1)
        x = self.dropout(x, key=key)
        for block, block_key in zip(self.blocks, block_keys):
            x = block(x, block_key)
        return self.head(x[0])


def loss(
    model: VisionTransformer, key: PRNGKeyArray, batch: tuple[Float[Array, "n c h w"], Int[Array, " n"]]
) -> Float[Array, ""]:
    """Mean softmax cross-entropy, with dropout drawn from `key` (a key per image)."""
    images, labels = batch
    logits = jax.vmap(model)(images, jax.random.split(key, images.shape[0]))
    return cross_entropy(logits, labels)


def problem(key: PRNGKeyArray, batch_size: int = 64) -> Problem:
    """The ViT on the upsampled digits, normalised to mean 0 and standard deviation 1."""
    images = upsampled_digits(IMAGE_SIZE)
    images = (images - images.mean()) / images.std()
    return Problem(
        name="vit",
        model=VisionTransformer(key),
        loss=loss,
        next_batch=minibatches((images, digits()[1]), batch_size, seed=0),
        has_rng=True,
        batch_size=batch_size,
    )
