"""Optimisation: the K-FAC optimizer and its parts, the optax transformation, the multi-device step."""
