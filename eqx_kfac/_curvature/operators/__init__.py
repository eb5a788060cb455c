"""Every linear operator of the curvature, bottom to top: `structured.py` (lineax's Kronecker and
block-diagonal operators), `kronecker_powers.py` (their damped powers, factor-wise),
`spectral.py` (trace, logdet, eigenvalues, norms and powers without a dense matrix),
`curvature/` (one block's damped curvature as an operator on its parameters),
`parameter_space.py` (an estimator's, on the parameter PyTree) and `kfac.py` (the K-FAC
operator). Import the modules themselves: this package imports nothing, so that each layer keeps
to the ones below it."""
