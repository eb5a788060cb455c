"""Curvature: structured operators, curvature blocks, estimators and solvers."""
