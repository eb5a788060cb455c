"""Equinox twins of the Haiku models of the kfac-jax fixtures, and fixture loading helpers.

Used by `test_reference_fixtures.py` and by the parity tests of the estimators and the optimizer
(from a test file in `tests/`: `from reference.twins import load, mlp_twin, ...`). Imports only
numpy, jax and equinox: never kfac-jax. The layouts are documented in `fixtures.md`.
"""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name):
    """Loads `kfac_jax_<name>.npz` from this folder as a dict of numpy arrays."""
    with np.load(os.path.join(HERE, f"kfac_jax_{name}.npz")) as data:
        return {k: data[k] for k in data.files}


def block_diag(blocks):
    """Dense block-diagonal matrix from square blocks (numpy only)."""
    dim = sum(b.shape[0] for b in blocks)
    out = np.zeros((dim, dim))
    lo = 0
    for b in blocks:
        out[lo:lo + b.shape[0], lo:lo + b.shape[0]] = b
        lo += b.shape[0]
    return out


def stored_matrix(fx, key):
    """The full dense matrix (kfac layout) of `kfac_<mode>`, `full_<mode>`, `diag_<mode>` or
    `exact_ggn`, assembled from the per-block arrays of a curvature fixture."""
    if key in fx:
        return fx[key]
    num_blocks = len(fx["block_offsets"]) - 1
    blocks = [fx[f"{key}_block{i}"] for i in range(num_blocks)]
    if key.startswith("diag_"):
        blocks = [np.diag(b) for b in blocks]
    return block_diag(blocks)


def to_eqx_layout(fx, matrix_or_vector):
    """Reorders a kfac-layout matrix (both axes) or vector (last axis) to the twin's layout."""
    perm = fx["eqx_perm"]
    if matrix_or_vector.ndim == 2 and matrix_or_vector.shape[0] == perm.size:
        return matrix_or_vector[np.ix_(perm, perm)]
    return matrix_or_vector[..., perm]


def _eqx_params(fx):
    return [jnp.asarray(fx[f"eqx_param_{j}"]) for j in range(len(fx["eqx_param_names"]))]


def _set_linear(layer, weight, bias):
    return eqx.tree_at(lambda l: (l.weight, l.bias), layer, (weight, bias))


class MLP(eqx.Module):
    """Per-example MLP: tanh on every hidden layer, linear logits."""

    layers: tuple[eqx.nn.Linear, ...]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jnp.tanh(layer(x))
        return self.layers[-1](x)


class CNN(eqx.Module):
    """Per-example CNN on a channels-first image: conv 3x3 SAME, tanh, flatten (C, H, W), dense."""

    conv: eqx.nn.Conv2d
    linear: eqx.nn.Linear

    def __call__(self, x):
        return self.linear(jnp.tanh(self.conv(x)).reshape(-1))


def mlp_twin(fx):
    """The Equinox twin of a fixture's Haiku MLP, with the fixture's weights."""
    arrays = _eqx_params(fx)
    layers = []
    for weight, bias in zip(arrays[::2], arrays[1::2]):
        out_size, in_size = weight.shape
        layer = eqx.nn.Linear(in_size, out_size, key=jax.random.key(0), dtype=jnp.float64)
        layers.append(_set_linear(layer, weight, bias))
    return MLP(tuple(layers))


def cnn_twin(fx):
    """The Equinox twin of the curvature fixture's Haiku CNN, with the fixture's weights."""
    conv_w, conv_b, lin_w, lin_b = _eqx_params(fx)
    out_ch, in_ch, kh, _ = conv_w.shape
    conv = eqx.nn.Conv2d(in_ch, out_ch, kh, padding="SAME", key=jax.random.key(0),
                         dtype=jnp.float64)
    linear = eqx.nn.Linear(lin_w.shape[1], lin_w.shape[0], key=jax.random.key(0),
                           dtype=jnp.float64)
    return CNN(_set_linear(conv, conv_w, conv_b), _set_linear(linear, lin_w, lin_b))


def cnn_inputs(fx):
    """The CNN fixture's NHWC batch as the twin's NCHW batch."""
    return jnp.asarray(fx["x"]).transpose(0, 3, 1, 2)


def softmax_cross_entropy(logits, labels):
    """Mean over the batch of the softmax cross-entropy with integer labels."""
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))
