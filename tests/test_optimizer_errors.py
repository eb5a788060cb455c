"""Bad arguments raise clear Python errors before anything is compiled."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from models import mlp_classification

import eqx_kfac
from eqx_kfac import Optimizer


PROBLEM = mlp_classification(jax.random.key(0))
BATCH = PROBLEM.batch
VG = eqx.filter_value_and_grad(PROBLEM.loss_fn)
FIXED = dict(learning_rate=0.1, momentum=0.9, damping=0.1)
# Learning rate, momentum and damping passed to `step`, no burn-in.
GIVEN = dict(
    step_rule=eqx_kfac.MomentumStep(), damping_rule=eqx_kfac.GivenDamping(),
    refresh=eqx_kfac.RefreshSchedule(num_burnin_steps=0),
)


@pytest.fixture(scope="module")
def opt_and_state():
    opt = Optimizer(VG, **GIVEN)
    return opt, opt.init(PROBLEM.params, jax.random.key(0), BATCH)


@pytest.mark.parametrize(
    "parts, match",
    [
        (lambda: dict(curvature=eqx_kfac.CurvatureOptions(estimation_mode="fisher_magic")),
         "Unknown estimation_mode 'fisher_magic'"),
        (lambda: dict(refresh=eqx_kfac.RefreshSchedule(inverse_update_period=0)),
         "inverse_update_period must be an integer >= 1"),
        (lambda: dict(refresh=eqx_kfac.RefreshSchedule(curvature_update_period=3, inverse_update_period=2)),
         r"curvature_update_period \(3\) is larger than inverse_update_period \(2\)"),
        (lambda: dict(damping_rule=eqx_kfac.LevenbergMarquardtDamping(1e-2, decay=1.5)),
         r"LevenbergMarquardtDamping: decay must be in \(0, 1\]"),
        (lambda: dict(damping_rule=eqx_kfac.LevenbergMarquardtDamping(1e-2, lower=0.9)),
         r"lower \(0.9\) is above upper"),
        (lambda: dict(step_rule=eqx_kfac.MomentumStep(momentum=eqx_kfac.AdaptiveHyperparameter(0.5, 0.1))),
         "lower .* must not exceed upper"),
        (lambda: dict(guard=eqx_kfac.StepGuard(max_consecutive_faults=0)),
         "max_consecutive_faults must be None or an integer"),
    ],
)
def test_bad_parts(parts, match):
    # The parts check their fields when built (`parts` builds them inside `pytest.raises`).
    with pytest.raises(ValueError, match=match):
        Optimizer(VG, **parts())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(use_adaptive_learning_rate=True, learning_rate_schedule=lambda s: 0.1),
         "use_adaptive_learning_rate=True and a learning_rate_schedule"),
        (dict(use_adaptive_momentum=True, momentum_schedule=lambda s: 0.1),
         "use_adaptive_momentum=True and a momentum_schedule"),
        (dict(use_adaptive_damping=True, initial_damping=1.0, damping_schedule=lambda s: 0.1),
         "use_adaptive_damping=True and a damping_schedule"),
        (dict(use_adaptive_learning_rate=True, norm_constraint=1.0), "norm_constraint cannot"),
        (dict(use_adaptive_damping=True), "use_adaptive_damping=True needs initial_damping="),
        # The parts' errors name the keyword that set the field.
        (dict(use_adaptive_damping=True, initial_damping=1e-2, damping_adaptation_decay=1.5),
         r"decay must be in \(0, 1\].*damping_adaptation_decay"),
        (dict(use_adaptive_damping=True, initial_damping=1e-2, damping_lower_threshold=0.9),
         r"lower \(0.9\) is above upper.*damping_lower_threshold"),
        (dict(use_adaptive_momentum=True, adaptive_momentum_bounds=(0.5, 0.1)),
         "lower .* must not exceed upper"),
        (dict(max_consecutive_faults=0), "max_consecutive_faults must be None or an integer"),
    ],
)
def test_bad_kfac_jax_keywords(kwargs, match):
    with pytest.raises(ValueError, match=match):
        eqx_kfac.kfac_jax.Optimizer(VG, l2_reg=0.0, **kwargs)


def test_a_value_and_grad_without_wrapped_needs_value_func():
    def opaque(params, batch):
        return VG(params, batch)

    with pytest.raises(ValueError, match="pass value_func=loss"):
        Optimizer(opaque)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(momentum=0.9, damping=0.1), "Missing learning_rate"),
        (dict(learning_rate=0.1, damping=0.1), "Missing momentum"),
        (dict(learning_rate=0.1, momentum=0.9), "Missing damping"),
    ],
)
def test_missing_hyperparameters(opt_and_state, kwargs, match):
    opt, state = opt_and_state
    with pytest.raises(ValueError, match=match):
        opt.step(PROBLEM.params, state, jax.random.key(0), batch=BATCH, **kwargs)


def test_values_for_adapted_or_scheduled_quantities(opt_and_state):
    _, state = opt_and_state  # (step checks its keywords before it reads the state)
    adaptive = Optimizer(
        VG, **{**GIVEN, "step_rule": eqx_kfac.MomentumStep(eqx_kfac.AdaptiveHyperparameter())}
    )
    adapted = r"learning_rate is adapted \(AdaptiveHyperparameter; kfac_jax: use_adaptive_learning_rate=True\)"
    with pytest.raises(ValueError, match=adapted + ", so do not pass learning_rate= to step"):
        adaptive.step(PROBLEM.params, state, jax.random.key(0), batch=BATCH, **FIXED)
    scheduled = Optimizer(VG, **{**GIVEN, "damping_rule": eqx_kfac.ScheduledDamping(lambda s: 0.1)})
    with pytest.raises(ValueError, match="so do not pass damping= to step as well"):
        scheduled.step(PROBLEM.params, state, jax.random.key(0), batch=BATCH, **FIXED)


def test_batch_arguments(opt_and_state):
    opt, state = opt_and_state
    with pytest.raises(ValueError, match="exactly one of data_iterator= and batch="):
        opt.step(PROBLEM.params, state, jax.random.key(0), **FIXED)
    with pytest.raises(ValueError, match="exactly one of data_iterator= and batch="):
        opt.step(PROBLEM.params, state, jax.random.key(0), batch=BATCH,
                 data_iterator=iter([BATCH]), **FIXED)
    smaller = (BATCH[0][:3], BATCH[1][:3])
    with pytest.raises(ValueError, match=r"got \(float64\[3, 3\], int64\[3\]\), expected "
                                         r"\(float64\[5, 3\], int64\[5\]\)"):
        opt.step(PROBLEM.params, state, jax.random.key(0), batch=smaller, **FIXED)
    with pytest.raises(ValueError, match="batch from data_iterator does not have"):
        opt.step(PROBLEM.params, state, jax.random.key(0), data_iterator=iter([smaller]),
                 **FIXED)
    # The batch passed positionally lands in `data_iterator`.
    with pytest.raises(TypeError, match=r"fourth positional argument is `data_iterator`.*got a tuple.*batch=batch"):
        opt.step(PROBLEM.params, state, jax.random.key(0), BATCH, **FIXED)


def test_a_loss_summed_over_the_batch_is_refused_at_init():
    def summed(params, batch):
        return PROBLEM.loss_fn(params, batch) * batch[0].shape[0]

    opt = Optimizer(eqx.filter_value_and_grad(summed))
    with pytest.raises(ValueError, match=r"5 \(the batch size\) times the mean of its registered losses"):
        opt.init(PROBLEM.params, jax.random.key(0), BATCH)
    # An averaged loss with a regulariser passes.
    def regularised(params, batch):
        leaves = jax.tree.leaves(eqx.filter(params, eqx.is_inexact_array))
        return PROBLEM.loss_fn(params, batch) + 1e-3 * sum(jnp.sum(x**2) for x in leaves)

    Optimizer(eqx.filter_value_and_grad(regularised), l2_reg=2e-3).init(PROBLEM.params, jax.random.key(0), BATCH)


def test_batch_size_comes_from_the_registered_losses():
    # Equinox's FAQ freezes part of a model by passing it in the batch: its first array is a weight.
    trainable, frozen = eqx.partition(PROBLEM.params, lambda x: x is PROBLEM.params.layers[1].weight)
    frozen_first = (frozen, *BATCH)

    def loss(trainable, batch):
        return PROBLEM.loss_fn(eqx.combine(trainable, batch[0]), batch[1:])

    opt = Optimizer(eqx.filter_value_and_grad(loss), **GIVEN)
    state = opt.init(trainable, jax.random.key(0), frozen_first)
    *_, stats = opt.step(trainable, state, jax.random.key(1), batch=frozen_first, **FIXED)
    assert jax.tree.leaves(frozen)[0].shape[0] != 5 and int(stats["batch_size"]) == 5


def test_func_state_arguments(opt_and_state):
    opt, state = opt_and_state
    with pytest.raises(ValueError, match="func_state was given but value_func_has_state=False"):
        opt.step(PROBLEM.params, state, jax.random.key(0), batch=BATCH, func_state={"a": 1},
                 **FIXED)
    stateful = Optimizer(VG, value_func_has_state=True)
    with pytest.raises(ValueError, match="value_func_has_state=True but func_state is None"):
        stateful.init(PROBLEM.params, jax.random.key(0), BATCH)


def test_data_iterator_inside_jit(opt_and_state):
    opt, state = opt_and_state

    @jax.jit
    def inside(state):
        return opt.step(PROBLEM.params, state, jax.random.key(0), data_iterator=iter([BATCH]),
                        **FIXED)

    with pytest.raises(ValueError, match="data_iterator cannot be used inside jit"):
        inside(state)


def test_state_must_come_from_init(opt_and_state):
    opt, _ = opt_and_state
    # The message is ours, or the run-time type checker's when it is on (as in this suite).
    with pytest.raises(TypeError, match="state"):
        opt.step(PROBLEM.params, {"step": jnp.zeros(())}, jax.random.key(0), batch=BATCH,
                 **FIXED)
