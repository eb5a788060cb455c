"""The models of Flax's examples (`examples/*/models.py`, MNIST's in `train.py`), written again
with the same layer types and structure at the sizes `benchmarks/flax_examples.py` trains on two CPU
cores. Dropout is left out (the benchmark compares training losses); everything else is as the
examples write it. The graph network is in `graph.py` (it needs jraph).
"""

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int


class CNN(nnx.Module):
    """MNIST's NNX CNN: two 3x3 convolutions, each with BatchNorm, ReLU and 2x2 average pooling,
    then two linear layers (`width` channels, then `2 * width`; `hidden` units)."""

    def __init__(self, size: int, width: int, hidden: int, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, width, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(width, rngs=rngs)
        self.conv2 = nnx.Conv(width, 2 * width, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(2 * width, rngs=rngs)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(2 * width * (size // 4) ** 2, hidden, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x: Float[Array, "b h w 1"]) -> Float[Array, "b 10"]:
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.conv1(x))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = nnx.relu(self.linear1(x.reshape(x.shape[0], -1)))
        return self.linear2(x)


class DecoderLSTMCell(nn.RNNCellBase):
    """seq2seq's decoder cell: an `LSTMCell` and a `Dense` to the vocabulary; without teacher
    forcing its next input is a token sampled from its logits (the `lstm` random stream)."""

    features: int
    teacher_force: bool
    vocab_size: int

    @nn.compact
    def __call__(self, carry, x):
        lstm_state, last_prediction = carry
        if not self.teacher_force:
            x = last_prediction
        lstm_state, y = nn.LSTMCell(self.features)(lstm_state, x)
        logits = nn.Dense(features=self.vocab_size)(y)
        token = jax.random.categorical(self.make_rng("lstm"), logits)
        prediction = jax.nn.one_hot(token, self.vocab_size, dtype=jnp.float32)
        return (lstm_state, prediction), (logits, prediction)

    @property
    def num_feature_axes(self) -> int:
        return 1


class Seq2seq(nn.Module):
    """seq2seq's LSTM encoder and decoder on one-hot characters: the encoder's carry at each
    query's end starts the decoder, which reads the answer's first token (`=`) and then its own
    samples (`teacher_force=False`, as the example trains)."""

    teacher_force: bool
    hidden_size: int
    vocab_size: int
    eos_id: int = 1

    @nn.compact
    def __call__(self, encoder_inputs, decoder_inputs):
        encoder = nn.RNN(nn.LSTMCell(self.hidden_size), return_carry=True, name="encoder")
        decoder = nn.RNN(
            DecoderLSTMCell(self.hidden_size, self.teacher_force, self.vocab_size),
            split_rngs={"params": False, "lstm": True}, name="decoder",
        )
        lengths = jnp.argmax(jnp.argmax(encoder_inputs, axis=-1) == self.eos_id, axis=-1)
        encoder_state, _ = encoder(encoder_inputs, seq_lengths=lengths)
        return decoder(decoder_inputs[:, :-1], initial_carry=(encoder_state, decoder_inputs[:, 0]))


def sinusoidal_positions(length: int, features: int) -> Float[Array, "1 length features"]:
    """lm1b's fixed sinusoidal position embedding."""
    position = np.arange(length)[:, None]
    scale = np.exp(-np.log(10_000.0) * np.arange(features // 2) / max(features // 2 - 1, 1))
    angles = position * scale[None]
    return jnp.asarray(np.concatenate([np.sin(angles), np.cos(angles)], axis=1)[None], jnp.float32)


class DecoderBlock(nn.Module):
    """lm1b's pre-norm block: LayerNorm, causal self-attention (no biases), residual; LayerNorm,
    a ReLU MLP, residual."""

    heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x, mask):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads, use_bias=False, deterministic=True)(y, mask=mask)
        x = x + y
        y = nn.LayerNorm()(x)
        y = nn.Dense(x.shape[-1])(nn.relu(nn.Dense(self.mlp_dim)(y)))
        return x + y


class TransformerLM(nn.Module):
    """lm1b's decoder-only transformer: inputs shifted right, an `Embed`, sinusoidal positions,
    `layers` blocks, a final LayerNorm and a `Dense` to the vocabulary (`logits_via_embedding`
    false, the config's default)."""

    vocab_size: int
    emb_dim: int
    heads: int
    mlp_dim: int
    layers: int

    @nn.compact
    def __call__(self, inputs: Int[Array, "b t"]) -> Float[Array, "b t v"]:
        mask = nn.combine_masks(nn.make_attention_mask(inputs > 0, inputs > 0), nn.make_causal_mask(inputs))
        shifted = jnp.pad(inputs, ((0, 0), (1, 0)))[:, :-1]
        x = nn.Embed(self.vocab_size, self.emb_dim, embedding_init=nn.initializers.normal(1.0))(shifted)
        x = x + sinusoidal_positions(inputs.shape[1], self.emb_dim)
        for _ in range(self.layers):
            x = DecoderBlock(self.heads, self.mlp_dim)(x, mask)
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


class VAE(nn.Module):
    """vae's encoder (`Dense`, ReLU, two `Dense` heads: mean and log-variance) and decoder (`Dense`,
    ReLU, `Dense` to the pixels' logits), with the reparameterized sample between them."""

    latents: int
    hidden: int
    pixels: int

    @nn.compact
    def __call__(self, x, z_rng):
        h = nn.relu(nn.Dense(self.hidden, name="enc_fc1")(x))
        mean, logvar = nn.Dense(self.latents, name="fc2_mean")(h), nn.Dense(self.latents, name="fc2_logvar")(h)
        z = mean + jax.random.normal(z_rng, logvar.shape) * jnp.exp(0.5 * logvar)
        recon = nn.Dense(self.pixels, name="dec_fc2")(nn.relu(nn.Dense(self.hidden, name="dec_fc1")(z)))
        return recon, mean, logvar


@jax.vmap
def flip_sequences(inputs: Array, lengths: Array) -> Array:
    """sst2's reversal of each sequence's first `length` positions (padding stays at the end)."""
    return jnp.flip(jnp.roll(inputs, inputs.shape[0] - lengths, axis=0), axis=0)


class SimpleLSTM(nn.Module):
    """sst2's LSTM: an `OptimizedLSTMCell` scanned over the positions."""

    hidden_size: int

    @functools.partial(nn.transforms.scan, variable_broadcast="params", in_axes=1, out_axes=1,
                       split_rngs={"params": False})
    @nn.compact
    def __call__(self, carry, x):
        return nn.OptimizedLSTMCell(self.hidden_size)(carry, x)


class TextClassifier(nn.Module):
    """sst2's model: an embedding table looked up by index, a bidirectional LSTM, keys-only MLP
    attention over the valid positions, and an MLP classifier (tanh hidden layer, output without
    bias) giving one logit."""

    vocab_size: int
    embedding_size: int
    hidden_size: int

    @nn.compact
    def __call__(self, token_ids: Int[Array, "b t"], lengths: Int[Array, " b"]) -> Float[Array, "b 1"]:
        table = self.param("embedding", nn.initializers.normal(0.1), (self.vocab_size, self.embedding_size))
        x = table[token_ids]
        zeros = jnp.zeros((x.shape[0], self.hidden_size), x.dtype)
        _, forward = SimpleLSTM(self.hidden_size, name="forward_lstm")((zeros, zeros), x)
        _, backward = SimpleLSTM(self.hidden_size, name="backward_lstm")((zeros, zeros), flip_sequences(x, lengths))
        encoded = jnp.concatenate([forward, flip_sequences(backward, lengths)], -1)
        mask = jnp.arange(token_ids.shape[1])[None] < lengths[:, None]
        scores = nn.Dense(1, name="energy", use_bias=False)(
            nn.tanh(nn.Dense(self.hidden_size, name="keys", use_bias=False)(encoded))
        ).squeeze(-1)
        attention = nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        summary = jnp.einsum("bt,btd->bd", attention, encoded)
        hidden = nn.tanh(nn.Dense(self.hidden_size, name="intermediate")(summary))
        return nn.Dense(1, use_bias=False, name="output")(hidden)


class ResNetBlock(nn.Module):
    """imagenet's basic block: two 3x3 convolutions with BatchNorm (the second's scale starting at
    zero), a 1x1 projection of the residual where the shape changes, ReLU."""

    filters: int
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        conv = functools.partial(nn.Conv, use_bias=False)
        norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9, epsilon=1e-5)
        y = nn.relu(norm()(conv(self.filters, (3, 3), self.strides)(x)))
        y = norm(scale_init=nn.initializers.zeros_init())(conv(self.filters, (3, 3))(y))
        residual = x
        if residual.shape != y.shape:
            residual = norm(name="norm_proj")(conv(self.filters, (1, 1), self.strides, name="conv_proj")(x))
        return nn.relu(residual + y)


class ResNet(nn.Module):
    """imagenet's ResNet v1.5 (`ResNet18`: two basic blocks per stage): a 7x7 stride-2 convolution,
    BatchNorm, ReLU, 3x3 max pooling, the stages (the filters doubling, stride 2 from the second),
    global average pooling and a `Dense`."""

    stage_sizes: Sequence[int]
    num_classes: int
    num_filters: int

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False, name="conv_init")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5, name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                x = ResNetBlock(self.num_filters * 2**i, (2, 2) if i > 0 and j == 0 else (1, 1))(x)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))
