"""The examples' data, all shipped with a package or generated (nothing is downloaded):

- images: scikit-learn's digits resized to the model's side (NHWC, pixels in [0, 1]; three equal
  channels for the ResNet);
- seq2seq: its own generated additions (`"12+345" -> "=357"`), one-hot characters;
- characters: the text of Python's `pydoc_data.topics` (the help system's topics), in windows;
- snippets: its sentences as word ids, labelled by whether they name one of Python's kinds of
  things (`KINDS`), a binary property of the text standing in for SST-2's sentiment.
"""

import re
from collections import Counter

import numpy as np

from ..harness import digits, topics_text, upsampled_digits

# A sentence of `snippets` is labelled 1 when it has one of these words (40% of them do).
KINDS = frozenset({"object", "objects", "class", "classes", "function", "functions", "method", "methods",
                   "value", "values", "type", "types", "attribute", "attributes"})
PAD, EOS, UNK = 0, 1, 1


def images(size: int, channels: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The digits as `(1797, size, size, channels)` float32 images, and their labels."""
    pixels = np.asarray(upsampled_digits(size), np.float32).transpose(0, 2, 3, 1)
    return np.repeat(pixels, channels, axis=-1), np.asarray(digits()[1])


class Additions:
    """seq2seq's `CharacterTable`: characters `0-9+=` with ids from 2 (0 pads, 1 ends)."""

    def __init__(self, max_digits: int):
        self.chars = sorted(set("0123456789+="))
        self.max_digits = max_digits
        self.vocab_size = len(self.chars) + 2

    def one_hot(self, text: str, length: int) -> np.ndarray:
        ids = [self.chars.index(c) + 2 for c in text] + [EOS]
        return np.eye(self.vocab_size, dtype=np.float32)[np.pad(ids, (0, length - len(ids)))]

    def examples(self, count: int, seed: int = 0) -> dict[str, np.ndarray]:
        """`count` additions of a number below 100 and one of `max_digits` digits: `query`
        `(count, 2 * max_digits + 2, vocab)` and `answer` `(count, max_digits + 3, vocab)`."""
        rng = np.random.default_rng(seed)
        top = 10**self.max_digits - 1
        pairs = [sorted((int(rng.integers(0, 100)), int(rng.integers(0, top + 1)))) for _ in range(count)]
        return {
            "query": np.stack([self.one_hot(f"{a}+{b}", 2 * self.max_digits + 2) for a, b in pairs]),
            "answer": np.stack([self.one_hot(f"={a + b}", self.max_digits + 3) for a, b in pairs]),
        }


def character_windows(count: int, length: int, seed: int = 0) -> tuple[np.ndarray, int]:
    """`count` windows of `length` characters at random offsets, as ids from 1 (0 pads), and the
    vocabulary's size."""
    text = topics_text()
    chars = sorted(set(text))
    ids = np.asarray([chars.index(c) + 1 for c in text], np.int32)
    starts = np.random.default_rng(seed).integers(0, len(ids) - length, count)
    return np.stack([ids[s : s + length] for s in starts]), len(chars) + 1


def snippets(length: int, vocab: int) -> dict[str, np.ndarray]:
    """The sentences of 5 to `length` words, their words' ids (the `vocab - 2` commonest words from
    2, 1 for the others, 0 padding), lengths and labels (see `KINDS`)."""
    sentences = [re.findall(r"[a-z]+", s.lower()) for s in re.split(r"[.!?]\s", topics_text())]
    sentences = [s for s in sentences if 5 <= len(s) <= length]
    common = [w for w, _ in Counter(w for s in sentences for w in s).most_common(vocab - 2)]
    index = {w: i + 2 for i, w in enumerate(common)}
    ids = np.zeros((len(sentences), length), np.int32)
    for row, sentence in enumerate(sentences):
        ids[row, : len(sentence)] = [index.get(w, UNK) for w in sentence]
    return {
        "ids": ids,
        "lengths": np.asarray([len(s) for s in sentences], np.int32),
        "labels": np.asarray([[float(bool(KINDS & set(s)))] for s in sentences], np.float32),
    }
