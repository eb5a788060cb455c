"""`import eqx_kfac.kfac_jax as kfac_jax`: kfac-jax's names, keywords and defaults on `eqx_kfac`.

`Optimizer` takes kfac-jax's constructor keywords with kfac-jax's defaults and builds the same
parts as `eqx_kfac.Optimizer`, whose constructor takes the parts themselves.
"""

from .optimizer import Optimizer as Optimizer
