"""`pytree_method`: a method bound as a `jax.tree_util.Partial` PyTree, as equinox's
`BoundMethod` binds one, without building an `eqx.Module` at every access."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_kfac
from eqx_kfac._core.methods import pytree_method


class _Scaled(eqx.Module):
    scale: jax.Array
    name: str = eqx.field(static=True, default="s")

    @pytree_method
    def apply(self, x: jax.Array) -> jax.Array:
        """Scales `x`."""
        return self.scale * x

    def plain(self, x: jax.Array) -> jax.Array:
        return self.scale * x


def test_bound_method_is_a_pytree_of_the_instance():
    module = _Scaled(jnp.asarray(3.0))
    bound = module.apply
    assert isinstance(bound, jax.tree_util.Partial)
    # The same leaves as equinox's BoundMethod: the instance's arrays, its static fields not.
    assert jax.tree.leaves(bound) == jax.tree.leaves(module.plain) == [module.scale]
    np.testing.assert_array_equal(bound(jnp.asarray(2.0)), 6.0)
    # Through a transformation the instance's arrays are traced arguments, not constants.
    scaled = jax.tree.map(lambda a: 2 * a, bound)
    np.testing.assert_array_equal(eqx.filter_jit(lambda f, x: f(x))(scaled, jnp.asarray(2.0)), 12.0)
    np.testing.assert_array_equal(jax.jit(bound)(jnp.asarray(1.0)), 3.0)


def test_class_attribute_is_the_function():
    module = _Scaled(jnp.asarray(2.0))
    assert _Scaled.apply(module, jnp.asarray(5.0)) == 10.0
    assert _Scaled.apply.__doc__ == "Scales `x`." and _Scaled.__dict__["apply"].__name__ == "apply"


def test_the_step_binds_without_equinox_bound_methods():
    def loss(params, batch):
        eqx_kfac.register_squared_error_loss(batch @ params)
        return jnp.mean((batch @ params) ** 2)

    optimizer = eqx_kfac.Optimizer(jax.value_and_grad(loss))
    for bound in (optimizer.step, optimizer.check, optimizer.damping_rule.check, optimizer.guard.check):
        assert isinstance(bound, jax.tree_util.Partial)
