"""How a run trains: `Method`, and the step it compiles to.

Every method trains the problem's loss (whose registrations are identities for the optax ones) and
gives a step `step(model, state, key, batch) -> (model, state, record)`, where `record` holds the
batch's `loss` (and K-FAC's step statistics):

- `"kfac"`: `eqx_kfac.Optimizer` in its recommended configuration (`make_optimizer`: its default
  parts, with the learning rate, momentum and damping adapted); no learning rate.
- `"warm"`: `"kfac"` with `options={"warm_start": eqx_kfac.WarmStart(...)}`: first-order steps
  while its K-FAC programs compile in threads. Train it in a round of its own: those threads
  would slow the steps of the runs it alternates with.
- `"recipe"`: `eqx_kfac.kfac_optax(loss, example_args, learning_rate)` (K-FAC preconditioning, a
  norm constraint, momentum); `learning_rate=None` takes its default.
- `"recipe_warm"`: `"recipe"` trained by `eqx_kfac.OptaxTraining` with
  `options={"warm_start": eqx_kfac.WarmStart(...)}` (the other options `kfac_optax`'s): first-order
  steps while `kfac_optax`'s step compiles in a thread. Train it in a round of its own, as `"warm"`.
- `"kfac_muon"`: `eqx_kfac.kfac_optax(loss, example_args, learning_rate,
  direction=eqx_kfac.KroneckerMuon(), momentum=None, curvature_update_period=10,
  inverse_update_period=50)`: Muon's polar step in the geometry of the K-FAC factors, its
  statistics every 10th step and its eigendecompositions every 50th (`options` may give others).
- an optax transform of `OPTAX` (`adam`, `adamw`, `adabelief`, `sgd`, `muon`, `sophia`, `psgd`,
  `soap` (`soap.py`), `shampoo` (Shampoo with Adam grafting, `shampoo.py`)), built as
  `OPTAX[name](learning_rate, **options)`. Sophia's update takes the objective (`obj_fn`, the
  batch's loss).

`Method.options` are keywords of `Optimizer` for `"kfac"` (its parts, e.g. `damping_rule=`), of
`kfac_optax` for `"recipe"` and `"kfac_muon"`, of the optax transform otherwise.
"""

import contextlib
import dataclasses
import io
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import optax

import eqx_kfac

from .flax_configs import adamw_rsqrt, sgd_decayed, sgd_nesterov_cosine
from .problem import Problem
from .shampoo import shampoo
from .soap import soap

# K-FAC's forms (`Optimizer`, with a warm start, `kfac_optax`, `kfac_optax` with `KroneckerMuon`).
KFAC_METHODS = ("kfac", "warm", "recipe", "recipe_warm", "kfac_muon")
# The `kfac_optax` keywords of each of its forms.
# `kfac_muon`'s periods: on alternatives.py's transformer (seed 0, 150 steps, rate 0.01) every
# 10th and 50th step made the step 110 ms against 170 ms with kfac_optax's 1 and 5 (Muon: 105 ms)
# for a final loss 0.025 against 0.036.
KFAC_OPTAX = {
    "recipe": {},
    "kfac_muon": dict(direction=eqx_kfac.KroneckerMuon(), momentum=None, curvature_update_period=10,
                      inverse_update_period=50),
}
# The methods whose step compiles itself (`Optimizer.step`, which its docs say to call directly):
# the loop calls it as it is, where it jits the others' steps.
SELF_COMPILING = ("kfac", "warm", "recipe_warm")
# The XLA compiler options of the jit around each other method's step, as each library's docs
# advise: `kfac_optax`'s jit takes `eqx_kfac.COMPILER_OPTIONS` (Triton's GEMM autotuning off on a
# GPU, ignored elsewhere), the optax baselines XLA's defaults.
JIT_COMPILER_OPTIONS = {name: dict(eqx_kfac.COMPILER_OPTIONS) for name in KFAC_OPTAX}
# The step statistics of `Optimizer` a run keeps.
KFAC_STATS = ("learning_rate", "momentum", "damping", "skipped", "rejected")


def psgd_kron(learning_rate: float, **options: Any) -> optax.GradientTransformationExtraArgs:
    """psgd-jax's `kron` (the `bench` extra; its init prints the preconditioner's size, silenced).

    psgd-jax 0.2.9 imports `optax._src.clipping`, which optax 0.2.8 moved to
    `optax.transforms._clipping`; `kron` uses nothing from it, so the old name is aliased first.
    """
    import optax.transforms._clipping

    sys.modules.setdefault("optax._src.clipping", optax.transforms._clipping)
    from psgd_jax.kron import kron

    transform = kron(learning_rate, **options)
    quiet_init = lambda params: quiet(transform.init, params)  # noqa: E731
    return optax.GradientTransformationExtraArgs(quiet_init, transform.update)


def psgd_error() -> str | None:
    """Why psgd-jax's `kron` cannot be used here (the exception), or `None` if it can."""
    try:
        psgd_kron(1e-3)
    except Exception as error:  # noqa: BLE001 -- any import failure is reported, not raised
        return f"{type(error).__name__}: {error}"
    return None


def usable(names: Sequence[str]) -> list[str]:
    """`names` without `"psgd"` when psgd-jax's `kron` cannot be used here (saying why)."""
    names = list(names)
    if "psgd" in names and (error := psgd_error()) is not None:
        print(f"psgd-jax's kron left out: {error}")
        names.remove("psgd")
    return names


def quiet(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` with its prints silenced."""
    with contextlib.redirect_stdout(io.StringIO()):
        return function(*args, **kwargs)


OPTAX: dict[str, Callable[..., optax.GradientTransformation]] = {
    "adam": optax.adam,
    "adamw": optax.adamw,
    "adabelief": optax.adabelief,
    "sgd": optax.sgd,
    "muon": optax.contrib.muon,
    "sophia": optax.contrib.sophia,
    "psgd": psgd_kron,
    "soap": soap,
    "shampoo": shampoo,
    # The optimizers of Flax's example configs (benchmarks/flax_suite).
    "adamw_rsqrt": adamw_rsqrt,
    "sgd_nesterov_cosine": sgd_nesterov_cosine,
    "sgd_decayed": sgd_decayed,
}
# Transforms whose `update` takes the objective as `obj_fn`.
_NEEDS_OBJECTIVE = ("sophia",)


@dataclasses.dataclass(frozen=True)
class Method:
    """One way of training.

    **Fields:**

    - `name`: one of `KFAC_METHODS` or a key of `OPTAX`.
    - `learning_rate`: the learning rate (`None` for `"kfac"`, and for `"recipe"` at its default).
    - `options`: keywords for the optimizer (see the module docstring).
    - `schedule`: `schedule(learning_rate) -> optax schedule`, given to the optimizer in place of
      the constant rate (e.g. a warmup and a cosine decay peaking at `learning_rate`); `None`:
      the constant rate. Not for `"kfac"` and `"warm"`, whose rate is adapted, nor for
      `"recipe_warm"`.
    """

    name: str
    learning_rate: float | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    schedule: Callable[[float], optax.Schedule] | None = None

    def __post_init__(self):
        if self.name not in (*KFAC_METHODS, *OPTAX):
            raise ValueError(f"method must be one of {(*KFAC_METHODS, *OPTAX)}, got {self.name!r}.")
        if self.schedule is not None and (self.name in SELF_COMPILING or self.learning_rate is None):
            raise ValueError(f"Method {self.name!r}: a schedule needs a learning rate to shape (the "
                             "adapted rate of 'kfac' and 'warm' takes none).")

    @property
    def rate(self) -> float | optax.Schedule | None:
        """What the optimizer is given: the schedule at `learning_rate`, or the rate itself."""
        return self.learning_rate if self.schedule is None else self.schedule(self.learning_rate)

    @property
    def label(self) -> str:
        """The method and its learning rate, e.g. `adam lr=0.001`."""
        return label(self.name, self.learning_rate)


def label(name: str, learning_rate: float | None) -> str:
    """`name`, with ` lr=<learning_rate>` when there is one."""
    return name if learning_rate is None else f"{name} lr={learning_rate:g}"


# `eqx_kfac.Optimizer`'s recommended configuration (its default parts) in the keywords of
# `eqx_kfac.kfac_jax.Optimizer`, for the benchmarks that compare with kfac-jax's twin scripts and
# need a keyword the core does not take (`value_func_for_estimator`).
RECOMMENDED_KFAC_JAX_KEYWORDS: Mapping[str, Any] = dict(
    use_adaptive_learning_rate=True, use_adaptive_momentum=True, use_adaptive_damping=True,
    initial_damping=1e-2, min_damping=1e-6, reject_damping_increase_factor=2.0,
    adaptive_learning_rate_bounds=(0.0, 10.0), adaptive_momentum_bounds=(-0.95, 0.95),
    max_predicted_decrease=0.5, use_step_rejection=True, max_statistics_growth=1e3,
    max_consecutive_faults=20, max_consecutive_stalls=50, estimation_mode="fisher_gradients",
)


def make_optimizer(problem: Problem, **overrides: Any) -> eqx_kfac.Optimizer:
    """`eqx_kfac.Optimizer` in its recommended configuration for a problem (its default parts: the
    learning rate, momentum and damping adapted).

    **Arguments:**

    - `problem`: the problem.
    - `**overrides`: `Optimizer` keywords (`l2_reg` and parts such as `damping_rule=`) replacing
      the defaults.

    **Returns:**

    The optimizer.
    """
    options = dict(l2_reg=0.0, value_func_has_state=problem.has_state, value_func_has_rng=problem.has_rng)
    options.update(overrides)
    return eqx_kfac.Optimizer(problem.value_and_grad(), **options)


def _kfac(problem: Problem, batch: Any, options: Mapping[str, Any]) -> tuple[Callable, Any]:
    optimizer = make_optimizer(problem, **options)

    def step(model, state, key, batch):
        kfac_state, func_state = state
        out = optimizer.step(model, kfac_state, key, batch=batch, func_state=func_state)
        if problem.has_state:
            model, kfac_state, func_state, stats = out
        else:
            model, kfac_state, stats = out
        # (A warm start's steps have no K-FAC statistics: NaN.)
        return model, (kfac_state, func_state), {k: stats.get(k, float("nan")) for k in ("loss", *KFAC_STATS)}

    init = optimizer.init(problem.model, jax.random.key(0), batch, func_state=problem.func_state)
    return step, (init, problem.func_state)


def _optax(
    problem: Problem, transform: optax.GradientTransformationExtraArgs, objective: bool, kfac: bool
) -> tuple[Callable, Any]:
    """A step of an optax transform: `obj_fn` passed if `objective`; the batch's loss arguments and
    key passed if `kfac` (`kfac_optax`'s update takes them)."""
    value_and_grad = problem.value_and_grad()

    def step(model, state, key, batch):
        opt_state, func_state = state
        args = problem.args(model, func_state, key, batch)
        out, grads = value_and_grad(*args)
        loss, new_func_state = problem.split(out, func_state)
        params, static = eqx.partition(model, eqx.is_inexact_array)
        extra = {}
        if objective:
            extra["obj_fn"] = lambda p: problem.split(problem.loss(eqx.combine(p, static), *args[1:]), None)[0]
        if kfac:
            extra.update(loss_args=args[1:], key=key)
        updates, opt_state = transform.update(grads, opt_state, params, **extra)
        return eqx.apply_updates(model, updates), (opt_state, new_func_state), {"loss": loss}

    params = eqx.filter(problem.model, eqx.is_inexact_array)
    return step, (transform.init(params), problem.func_state)


def _optax_training(problem: Problem, training: eqx_kfac.OptaxTraining) -> tuple[Callable, Any]:
    """A step of `training` (which compiles itself)."""

    def step(model, state, key, batch):
        training_state, func_state = state
        loss_args = problem.args(model, func_state, key, batch)[1:]
        model, training_state, out = training.step(model, training_state, *loss_args, key=key)
        loss, func_state = problem.split(out, func_state)
        return model, (training_state, func_state), {"loss": loss}

    return step, (training.init(problem.model), problem.func_state)


def make_step(problem: Problem, method: Method, batch: Any) -> tuple[Callable, Any]:
    """`(step, state)` of one method on a problem.

    **Arguments:**

    - `problem`: the problem (its model is the initial point).
    - `method`: the method.
    - `batch`: the first batch (K-FAC's burn-in and structure).

    **Returns:**

    `step(model, state, key, batch) -> (model, state, record)` (not jitted, but for the methods of
    `SELF_COMPILING`, whose step compiles itself) and the initial state.
    """
    if method.name in ("kfac", "warm"):
        return _kfac(problem, batch, method.options)
    if method.name in (*KFAC_OPTAX, "recipe_warm"):
        example = problem.args(problem.model, problem.func_state, jax.random.key(0), batch)
        rate = {} if method.learning_rate is None else {"learning_rate": method.rate}
        options = KFAC_OPTAX.get(method.name, {}) | dict(method.options)
        warm_start = options.pop("warm_start", None)
        transform = eqx_kfac.kfac_optax(problem.loss, example, **rate, **options)
        if method.name == "recipe_warm":
            training = eqx_kfac.OptaxTraining(problem.loss, transform, warm_start, problem.has_state)
            return _optax_training(problem, training)
        return _optax(problem, transform, objective=False, kfac=True)
    transform = OPTAX[method.name](method.rate, **method.options)
    return _optax(problem, transform, objective=method.name in _NEEDS_OBJECTIVE, kfac=False)
