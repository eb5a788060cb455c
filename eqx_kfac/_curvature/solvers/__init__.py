"""Solvers: `kronecker.py` (lineax solvers for damped Kronecker operators) and `estimator.py`
(solves with an estimator's curvature, block by block). Import the modules themselves: this
package imports nothing, so that each layer keeps to the ones below it."""
