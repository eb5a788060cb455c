"""Flax's examples trained with K-FAC: steps and seconds to the optimizer each example's config tunes.

    python benchmarks/flax_examples.py                      # the seven examples, full budgets
    python benchmarks/flax_examples.py --quick --examples mnist vae   # a smoke run
    python benchmarks/flax_examples.py --plots docs/img     # also loss vs steps and vs seconds

The models (`models.py`, `graph.py`) are those of Flax's `examples/*/models.py` (MNIST's in its
`train.py`), with the same layer types and structure at sizes two CPU cores train in minutes:
MNIST's NNX CNN, seq2seq's LSTM encoder-decoder, lm1b's transformer language model, vae's VAE,
sst2's BiLSTM classifier, imagenet's ResNet-18 and ogbg_molpcba's jraph graph network (jraph is
the optional extra `flax-examples`: `pip install -e ".[flax-examples]"`; without it the ogbg
example is skipped with a message). The data ships with a package or is generated (`data.py`,
`graph.py`): scikit-learn's digits, seq2seq's own additions, the text of Python's
`pydoc_data.topics`, generated molecules.

Each example (`examples.py`) is trained from the same initial parameters on the same batches by

- `Optimizer`: `eqx_kfac.Optimizer(value_and_grad)`, the recommended configuration (adaptive
  learning rate, momentum and damping; per-token losses registered with `mean_over="all"` or the
  weight their mean implies);
- `kfac_optax`: `eqx_kfac.kfac_optax(loss, example_args)` with its defaults;
- the optimizer of the example's `configs/default.py` (SGD with momentum, Adam, AdamW with its
  warm-up and reverse square-root schedule, SGD with decayed weights, SGD Nesterov with warm-up
  and cosine decay) at the config's learning rate and its two neighbours on a 3x ladder, the
  ladder extended by up to two more rungs while its best rate is at an end (each extra rung in a
  round of its own); the one with the lowest final loss is the baseline.

All five runs of an example advance one step each in turn in one process (`benchmarks.harness`'s
`run_round`), so load from other processes falls on all of them alike: the step ratios are what to
read on a shared machine. The target is the baseline's final loss (the mean training loss of its
last 10 steps); a method reaches it at the first step whose 10-step mean is at or below it.
Seconds *from the first call* count building the optimizer, tracing and compiling the first step
and every step and batch after it; *compiled* seconds count the steps only. The table gives those
for `Optimizer` / `kfac_optax` / the baseline, and the K-FAC forms' median compiled step and first
call over the baseline's. The JSON record (`--save`) keeps every run's losses, its median step and
first call by stage, and the learning-rate, momentum and damping trajectories of `Optimizer`.
"""
