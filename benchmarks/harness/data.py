"""The data every benchmark shares: scikit-learn's bundled 8x8 digits (nothing is downloaded).

`digits()` gives the 1,797 images with pixels scaled from 0..16 to [0, 1] and their labels;
`upsampled_digits()` resizes them for models written for larger images (MNIST's 28x28).
`minibatches()` turns any data set in memory into a stream of minibatches for a `Problem`,
`digit_batches()` the digits. `topics_text()` is the text of Python's own help topics and
`stdlib_text()` the sources of its standard library (the language models' corpora).
"""

import functools
import pathlib
import sysconfig
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


@functools.cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    # Imported here so that importing the harness (e.g. for its models) does not need scikit-learn.
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.data / 16.0).astype(np.float32), data.target.astype(np.int32)


@functools.cache
def topics_text() -> str:
    """The text of `pydoc_data.topics`, topics in name order
    (465 thousand characters, 103 distinct)."""
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics))


# Folders of the standard library left out of `stdlib_text`: its tests and installed packages.
_NOT_STDLIB_SOURCES = {"test", "tests", "idle_test", "site-packages", "dist-packages"}


@functools.cache
def stdlib_text() -> str:
    """The Python sources of this interpreter's standard library, files in path order, without
    its tests or installed packages, characters outside ASCII as `?` (CPython 3.11: 868 files,
    12.1 million characters, 96 distinct). Larger than `topics_text` by 26x, for runs that would pass over the
    help topics many times."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not _NOT_STDLIB_SOURCES & set(p.relative_to(root).parts))
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    return text.encode("ascii", errors="replace").decode("ascii")


def digits(dtype: Any = None) -> tuple[Float[Array, "1797 64"], Int[Array, " 1797"]]:
    """scikit-learn's digits: pixels scaled to [0, 1], and labels.

    **Arguments:**

    - `dtype`: the pixels' dtype (default: JAX's default float, as the models' parameters).

    **Returns:**

    `(images, labels)` of shapes `(1797, 64)` and `(1797,)`.
    """
    images, labels = _digits()
    return jnp.asarray(images, dtype or jnp.result_type(float)), jnp.asarray(labels)


def upsampled_digits(size: int, dtype: Any = None) -> Float[Array, "1797 1 size size"]:
    """The digits as one-channel `size` x `size` images (bilinear), pixels in [0, 1].

    **Arguments:**

    - `size`: the side of the images (e.g. 28, MNIST's).
    - `dtype`: as for `digits`.

    **Returns:**

    The images, `(1797, 1, size, size)`.
    """
    images, _ = digits(dtype)
    squares = images.reshape(-1, 1, 8, 8)
    return jnp.clip(jax.image.resize(squares, (len(squares), 1, size, size), "linear"), 0.0, 1.0)


def minibatches(data: Any, batch_size: int, seed: int | None = None) -> Callable[..., Any]:
    """`next_batch` for a data set held in memory: minibatches without replacement.

    **Arguments:**

    - `data`: a PyTree of arrays with the examples along their first axis.
    - `batch_size`: examples per batch (the last incomplete batch of an epoch is dropped).
    - `seed`: `None` (default): one fixed permutation, cycled; an integer: a new permutation in
      every epoch, drawn from `(seed, epoch)`.

    **Returns:**

    `next_batch(model, step, key, previous) -> batch` (`data`'s structure), the same batch for
    the same step.
    """
    size = len(jax.tree.leaves(data)[0])
    per_epoch = size // batch_size
    fixed = np.random.default_rng(0).permutation(size)

    def next_batch(model: Any, step: int, key: Any, previous: Any = None) -> Any:
        del model, key, previous
        epoch, index = divmod(step, per_epoch)
        order = fixed if seed is None else np.random.default_rng((seed, epoch)).permutation(size)
        rows = order[index * batch_size : (index + 1) * batch_size]
        return jax.tree.map(lambda leaf: leaf[rows], data)

    return next_batch


def digit_batches(
    batch_size: int,
    transform: Callable[[Array], Array] = lambda x: x,
    dtype: Any = None,
    seed: int | None = None,
) -> Callable[..., tuple[Array, Array]]:
    """`next_batch` for a digits classifier: `minibatches` of `(transform(images), labels)`.

    **Arguments:**

    - `batch_size`, `seed`: as for `minibatches`.
    - `transform`: maps the `(1797, 64)` images to the model's inputs (e.g. reshaped to 1x8x8).
    - `dtype`: the pixels' dtype (default: JAX's default float).

    **Returns:**

    `next_batch(model, step, key, previous) -> (inputs, labels)`.
    """
    images, labels = digits(dtype)
    return minibatches((transform(images), labels), batch_size, seed)
