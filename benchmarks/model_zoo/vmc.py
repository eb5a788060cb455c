"""Variational Monte Carlo for the 3-D harmonic oscillator, written the way FermiNet writes it.

The wavefunction's log-amplitude is an MLP with a Gaussian envelope; walkers are sampled from
`|ψ|²` by Metropolis-Hastings. The loss is the mean local energy
`E_L = -½(∇²log ψ + |∇log ψ|²) + ½|x|²`, wrapped in a custom JVP whose tangent is the VMC
gradient estimator `2·E[(E_L - E) ∇log ψ]`. `log ψ` is registered with
`register_normal_predictive_distribution`, either inside the custom JVP rule (as FermiNet does with
kfac-jax) or in the loss beside the energy. The exact ground-state energy is `3/2`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

import eqx_kfac

from ..harness import Problem

EXACT_ENERGY = 1.5
_DIM = 3


class Wavefunction(eqx.Module):
    """`log ψ(x) = MLP(x) - |x|²/4` for one walker `x` in 3-D."""

    mlp: eqx.nn.MLP

    def __init__(self, key: PRNGKeyArray, width: int = 32):
        self.mlp = eqx.nn.MLP(_DIM, "scalar", width, 2, activation=jax.nn.tanh, key=key)

    def __call__(self, x: Float[Array, " 3"]) -> Float[Array, ""]:
        return self.mlp(x) - 0.25 * jnp.sum(x**2)


def local_energy(model: Wavefunction, x: Float[Array, " 3"]) -> Float[Array, ""]:
    """`-½(∇²log ψ + |∇log ψ|²) + ½|x|²` at one walker."""
    gradient = jax.grad(model)(x)
    laplacian = jnp.trace(jax.hessian(model)(x))
    return -0.5 * (laplacian + gradient @ gradient) + 0.5 * x @ x


def _energy(register_in_rule: bool):
    @eqx.filter_custom_jvp
    def energy(model, walkers):
        return jnp.mean(jax.vmap(local_energy, (None, 0))(model, walkers))

    @energy.def_jvp
    def energy_jvp(primals, tangents):
        model, walkers = primals
        model_tangent, _ = tangents
        energies = jax.vmap(local_energy, (None, 0))(model, walkers)
        mean = jnp.mean(energies)
        log_psi, log_psi_tangent = eqx.filter_jvp(
            lambda m: jax.vmap(m)(walkers), (model,), (model_tangent,)
        )
        if register_in_rule:
            eqx_kfac.register_normal_predictive_distribution(log_psi[:, None])
        return mean, 2.0 * jnp.mean((energies - mean) * log_psi_tangent)

    return energy


_ENERGY_REGISTERING = _energy(register_in_rule=True)
_ENERGY = _energy(register_in_rule=False)


def loss_registered_in_rule(model: Wavefunction, walkers: Float[Array, "n 3"]) -> Float[Array, ""]:
    """The mean local energy; `log ψ` is registered inside its custom JVP rule (FermiNet's way)."""
    return _ENERGY_REGISTERING(model, walkers)


def loss_registered_in_loss(model: Wavefunction, walkers: Float[Array, "n 3"]) -> Float[Array, ""]:
    """The mean local energy; `log ψ` is registered in the loss, beside the custom-JVP energy."""
    eqx_kfac.register_normal_predictive_distribution(jax.vmap(model)(walkers)[:, None])
    return _ENERGY(model, walkers)


@eqx.filter_jit
def metropolis(
    model: Wavefunction, walkers: Float[Array, "n 3"], key: PRNGKeyArray, steps: int, width: float = 0.6
) -> Float[Array, "n 3"]:
    """`steps` Metropolis-Hastings moves of every walker, with Gaussian proposals, under `|ψ|²`.

    **Arguments:**

    - `model`: the wavefunction.
    - `walkers`: their current positions.
    - `key`: a PRNG key.
    - `steps`: the number of moves (static).
    - `width`: the proposals' standard deviation.

    **Returns:**

    The new positions.
    """

    def move(carry, key):
        x, log_p = carry
        k1, k2 = jax.random.split(key)
        proposal = x + width * jax.random.normal(k1, x.shape, x.dtype)
        log_q = 2.0 * jax.vmap(model)(proposal)
        accept = jnp.log(jax.random.uniform(k2, log_q.shape, x.dtype)) < log_q - log_p
        return (jnp.where(accept[:, None], proposal, x), jnp.where(accept, log_q, log_p)), None

    (walkers, _), _ = jax.lax.scan(
        move, (walkers, 2.0 * jax.vmap(model)(walkers)), jax.random.split(key, steps)
    )
    return walkers


def problem(key: PRNGKeyArray, registration: str = "rule", batch_size: int = 256) -> Problem:
    """The harmonic oscillator's VMC problem (`registration`: `"rule"` or `"loss"`).

    Walkers start from a standard normal and take 100 moves before the first step, then 10 moves
    from their previous positions before every step.
    """
    model = Wavefunction(key)
    start = jax.random.normal(jax.random.fold_in(key, 1), (batch_size, _DIM), jnp.result_type(float))

    def next_batch(model, step, key, previous=None):
        del step
        if previous is None:
            return metropolis(model, start, key, 100)
        return metropolis(model, previous, key, 10)

    loss = {"rule": loss_registered_in_rule, "loss": loss_registered_in_loss}[registration]
    return Problem(
        name=f"vmc_{registration}",
        model=model,
        loss=loss,
        next_batch=next_batch,
        batch_size=batch_size,
        exact_loss=EXACT_ENERGY,
    )
