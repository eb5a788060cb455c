"""Structured lineax operators (Kronecker, block-diagonal), their factorisations and solvers."""
