"""The optimizers of Flax's example configs that are not one optax call (`configs/default.py` of
lm1b, imagenet and sst2), as builders `f(learning_rate, ...) -> optax.GradientTransformation`;
`methods.OPTAX` holds them under these names."""

import optax


def adamw_rsqrt(learning_rate: float, warmup_steps: int) -> optax.GradientTransformation:
    """lm1b's optimizer: AdamW (b2 0.98, eps 1e-9, weight decay 0.1), linear warm-up then
    `rate * sqrt(warmup / (step + warmup))`."""
    rsqrt = lambda count: learning_rate * (count + warmup_steps) ** -0.5 * warmup_steps**0.5  # noqa: E731
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    schedule = optax.join_schedules([warmup, rsqrt], [warmup_steps])
    return optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)


def sgd_nesterov_cosine(learning_rate: float, warmup_steps: int, steps: int) -> optax.GradientTransformation:
    """imagenet's optimizer: SGD with Nesterov momentum 0.9, linear warm-up then cosine decay."""
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    cosine = optax.cosine_decay_schedule(learning_rate, max(steps - warmup_steps, 1))
    return optax.sgd(optax.join_schedules([warmup, cosine], [warmup_steps]), momentum=0.9, nesterov=True)


def sgd_decayed(learning_rate: float) -> optax.GradientTransformation:
    """sst2's optimizer: SGD with momentum 0.9, then `add_decayed_weights(3e-6)` (as chained there)."""
    return optax.chain(optax.sgd(learning_rate, momentum=0.9), optax.add_decayed_weights(3e-6))
