"""The seven examples as `Problem`s, each with the optimizer its `configs/default.py` tunes.

`EXAMPLES[name](steps, quick) -> Example`; `steps` sets the schedules' lengths (warm-up and decay
scaled to the budget), `quick` the tiny sizes of a smoke run. The configs' optimizers that are
not one optax call are in `benchmarks/harness/flax_configs.py`.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import eqx_kfac

from ..harness import Method, Problem, minibatches
from ..model_zoo.losses import cross_entropy
from . import data, models


@dataclasses.dataclass(frozen=True)
class Example:
    """One example: its problem, its config's optimizer (`baseline`, at the config's learning rate,
    scaled by the batch size where the config does) and a line saying what it is."""

    problem: Problem
    baseline: Method
    about: str


def mnist(steps: int, quick: bool) -> Example:
    """MNIST's NNX CNN (BatchNorm statistics as the function state), SGD with momentum 0.9."""
    size, width, hidden, batch = (8, 4, 16, 32) if quick else (16, 16, 128, 128)
    graphdef, params, stats = nnx.split(models.CNN(size, width, hidden, nnx.Rngs(0)), nnx.Param, nnx.BatchStat)

    def loss(params, batch_stats, batch):
        x, y = batch
        model = nnx.merge(graphdef, params, batch_stats, copy=True)
        return cross_entropy(model(x), y), nnx.state(model, nnx.BatchStat)

    images, labels = data.images(size)
    problem = Problem("mnist", params, loss, minibatches((images, labels), batch, seed=0), stats, batch_size=batch)
    about = f"NNX CNN, digits at {size}x{size}, conv {width}/{2 * width}, dense {hidden}, batch {batch}"
    return Example(problem, Method("sgd", 0.1, {"momentum": 0.9}), about)


def seq2seq(steps: int, quick: bool) -> Example:
    """seq2seq's Linen LSTM encoder-decoder on generated additions, Adam."""
    hidden, batch, pool = (8, 16, 256) if quick else (64, 128, 8192)
    table = data.Additions(max_digits=3)
    model = models.Seq2seq(teacher_force=False, hidden_size=hidden, vocab_size=table.vocab_size)
    examples = table.examples(pool)
    params = model.init({"params": jax.random.key(0), "lstm": jax.random.key(1)},
                        examples["query"][:1], examples["answer"][:1])["params"]

    def loss(params, key, batch):
        logits, _ = model.apply({"params": params}, batch["query"], batch["answer"], rngs={"lstm": key})
        labels = batch["answer"][:, 1:]
        ends = labels[:, :, data.EOS]
        first = jnp.argmax(ends, axis=-1)
        lengths = jnp.where(jnp.take_along_axis(ends, first[:, None], 1)[:, 0] > 0, first + 1, labels.shape[1])
        mask = jnp.arange(labels.shape[1])[None] < lengths[:, None]
        # The example averages over every position (masked ones count as zero): 1/T per token.
        eqx_kfac.register_softmax_cross_entropy_loss(
            logits, jnp.argmax(labels, -1), mask=mask, weight=1.0 / labels.shape[1]
        )
        return -jnp.mean(mask * jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))

    problem = Problem("seq2seq", params, loss, minibatches(examples, batch, seed=0), has_rng=True, batch_size=batch)
    about = f"Linen LSTM encoder-decoder (sampled decoder inputs), hidden {hidden}, batch {batch}"
    return Example(problem, Method("adam", 3e-3), about)


def lm1b(steps: int, quick: bool) -> Example:
    """lm1b's Linen transformer language model on characters of `pydoc_data.topics`, AdamW with
    warm-up and reverse square-root decay (the warm-up a tenth of the budget)."""
    emb, heads, mlp, layers, length, batch = (16, 2, 16, 1, 16, 8) if quick else (64, 4, 128, 2, 64, 32)
    windows, vocab = data.character_windows(4096, length)
    model = models.TransformerLM(vocab, emb, heads, mlp, layers)
    params = model.init(jax.random.key(0), windows[:1])["params"]

    def loss(params, batch):
        logits = model.apply({"params": params}, batch)
        weights = (batch > 0).astype(logits.dtype)
        eqx_kfac.register_softmax_cross_entropy_loss(logits, batch, mask=weights, mean_over="all")
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch)
        return jnp.sum(per_token * weights) / jnp.sum(weights)

    problem = Problem("lm1b", params, loss, minibatches(windows, batch, seed=0), batch_size=batch)
    about = (f"Linen transformer LM, {layers} layers, width {emb}, {heads} heads, MLP {mlp}, "
             f"{length} characters, batch {batch}")
    return Example(problem, Method("adamw_rsqrt", 1.6e-3, {"warmup_steps": max(steps // 10, 1)}), about)


def vae(steps: int, quick: bool) -> Example:
    """vae's Linen VAE on the digits (Bernoulli pixels, KL term), Adam."""
    size, hidden, latents, batch = (8, 16, 4, 32) if quick else (16, 256, 20, 128)
    images, _ = data.images(size)
    pixels = images.reshape(len(images), -1)
    model = models.VAE(latents, hidden, pixels.shape[1])
    params = model.init(jax.random.key(0), pixels[:1], jax.random.key(1))["params"]

    def loss(params, key, x):
        logits, mean, logvar = model.apply({"params": params}, x, key)
        eqx_kfac.register_sigmoid_cross_entropy_loss(logits, x)
        bce = -jnp.sum(x * jax.nn.log_sigmoid(logits) + (1 - x) * jax.nn.log_sigmoid(-logits), axis=-1)
        kld = -0.5 * jnp.sum(1 + logvar - mean**2 - jnp.exp(logvar), axis=-1)
        return jnp.mean(bce) + jnp.mean(kld)

    problem = Problem("vae", params, loss, minibatches(pixels, batch, seed=0), has_rng=True, batch_size=batch)
    about = f"Linen VAE, digits at {size}x{size}, hidden {hidden}, {latents} latents, batch {batch}"
    return Example(problem, Method("adam", 1e-3), about)


def sst2(steps: int, quick: bool) -> Example:
    """sst2's Linen BiLSTM classifier with attention on sentences of `pydoc_data.topics`, SGD with
    momentum and decayed weights."""
    vocab, emb, hidden, batch = (100, 8, 8, 16) if quick else (1000, 32, 32, 64)
    sentences = data.snippets(24, vocab)
    model = models.TextClassifier(vocab, emb, hidden)
    params = model.init(jax.random.key(0), sentences["ids"][:1], sentences["lengths"][:1])["params"]

    def loss(params, batch):
        logits = model.apply({"params": params}, batch["ids"], batch["lengths"])
        labels = batch["labels"]
        eqx_kfac.register_sigmoid_cross_entropy_loss(logits, labels)
        return -jnp.mean(labels * jax.nn.log_sigmoid(logits) + (1 - labels) * jax.nn.log_sigmoid(-logits))

    problem = Problem("sst2", params, loss, minibatches(sentences, batch, seed=0), batch_size=batch)
    about = (f"Linen BiLSTM + attention classifier, vocabulary {vocab}, embedding {emb}, hidden {hidden}, "
             f"batch {batch}")
    return Example(problem, Method("sgd_decayed", 0.1), about)


def imagenet(steps: int, quick: bool) -> Example:
    """imagenet's Linen ResNet-18 (BatchNorm statistics as the function state, weight decay 1e-4
    in the loss) on the digits at 32x32, three channels; SGD Nesterov with warm-up and cosine."""
    size, filters, stages, batch = (16, 2, (1, 1, 1, 1), 16) if quick else (32, 8, (2, 2, 2, 2), 64)
    images, labels = data.images(size, channels=3)
    model = models.ResNet(stages, 10, filters)
    variables = model.init(jax.random.key(0), images[:2])

    def loss(params, batch_stats, batch):
        x, y = batch
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"])
        decay = sum(jnp.sum(p**2) for p in jax.tree.leaves(params) if p.ndim > 1)
        return cross_entropy(logits, y) + 1e-4 * 0.5 * decay, updates["batch_stats"]

    problem = Problem("imagenet", variables["params"], loss, minibatches((images, labels), batch, seed=0),
                      variables["batch_stats"], batch_size=batch)
    about = f"Linen ResNet-18 (stages {list(stages)}, {filters} filters), digits at {size}x{size}x3, batch {batch}"
    # The config's rate is 0.1 for 256 images, scaled by the batch as its train.py does.
    method = Method("sgd_nesterov_cosine", 0.1 * batch / 256, {"warmup_steps": max(steps // 10, 1), "steps": steps})
    return Example(problem, method, about)


def ogbg(steps: int, quick: bool) -> Example:
    """ogbg_molpcba's jraph `GraphConvNet` on generated molecules, Adam (see `graph`)."""
    from . import graph

    latent, passes, tasks, batch, pool = (8, 1, 4, 8, 64) if quick else (32, 3, 16, 64, 4096)
    model = graph.GraphConvNet(latent, 2, passes, tasks)
    next_batch = graph.graph_batches(graph.molecules(pool, tasks), batch)
    params = model.init(jax.random.key(0), next_batch(None, 0, None))["params"]

    def loss(params, graphs):
        mask = graph.valid_mask(graphs)
        labels = jnp.where(mask, graphs.globals, 0.0)
        logits = model.apply({"params": params}, graphs._replace(globals=jnp.ones((mask.shape[0], 1)))).globals
        # The example averages over the valid labels: weight batch / count under the batch convention.
        eqx_kfac.register_sigmoid_cross_entropy_loss(logits, labels, mask.shape[0] / jnp.sum(mask), mask=mask)
        per_label = jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits)))
        return jnp.sum(jnp.where(mask, per_label, 0.0)) / jnp.sum(mask)

    problem = Problem("ogbg", params, loss, next_batch, batch_size=batch)
    about = (f"Linen + jraph GraphConvNet, {passes} message passes, latent {latent}, {tasks} tasks, "
             f"batch {batch} graphs")
    return Example(problem, Method("adam", 1e-3), about)


EXAMPLES: dict[str, Callable[[int, bool], Example]] = {
    "mnist": mnist, "seq2seq": seq2seq, "lm1b": lm1b, "vae": vae, "sst2": sst2, "ogbg": ogbg, "imagenet": imagenet,
}
