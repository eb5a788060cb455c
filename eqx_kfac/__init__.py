"""eqx_kfac: K-FAC second-order optimization and curvature estimation for JAX and Equinox."""

from ._layer_data import EstimationData as EstimationData, LayerSpec as LayerSpec

__version__ = "0.1.0"
