"""The suite's run-time type checks (`typecheck_hook.py`): annotated functions and classes of
`eqx_kfac` are checked, and functions without annotations are left as they are."""

import ast
import importlib
import inspect
import os
import pkgutil

import jax.numpy as jnp
import jaxtyping
import pytest

import eqx_kfac
from eqx_kfac._core import linalg


def _undecorated_functions():
    """`(name, function as the hook left it)` for every function of `eqx_kfac` written with no
    decorator, at a module's top level or as a method of a class there."""
    for info in pkgutil.walk_packages(eqx_kfac.__path__, "eqx_kfac."):
        module = importlib.import_module(info.name)
        for node in ast.parse(inspect.getsource(module)).body:
            if isinstance(node, ast.ClassDef) and not node.decorator_list:
                owner, nodes, prefix = vars(getattr(module, node.name)), node.body, f"{node.name}."
            else:
                owner, nodes, prefix = vars(module), [node], ""
            for function in nodes:
                if isinstance(function, ast.FunctionDef) and not function.decorator_list:
                    value = owner[function.name]  # (`__init_subclass__` is made a classmethod)
                    if inspect.isfunction(value):
                        yield f"{module.__name__}.{prefix}{function.name}", value


def _in_jaxtyping(function) -> bool:
    return function.__code__.co_filename.startswith(os.path.dirname(jaxtyping.__file__))


def test_annotated_functions_are_wrapped_and_the_others_are_not():
    functions = dict(_undecorated_functions())
    wrapped = {name for name, f in functions.items() if _in_jaxtyping(f)}
    annotated = {name for name, f in functions.items() if inspect.unwrap(f).__annotations__}
    # Both kinds are plentiful in the package (so each half of the check has something to check).
    assert len(annotated) > 500 and len(set(functions) - annotated) > 20
    assert wrapped == annotated, (sorted(wrapped - annotated)[:5], sorted(annotated - wrapped)[:5])


def test_a_wrong_shape_is_refused():
    linalg.eigh(jnp.eye(3))
    with pytest.raises(jaxtyping.TypeCheckError, match="eigh"):
        linalg.eigh(jnp.ones((3, 2)))  # not square: `Float[Array, "*batch n n"]`


def test_a_module_field_is_checked():
    # An `eqx.Module` of the package checks its fields' annotations when it is built.
    with pytest.raises(jaxtyping.TypeCheckError):
        eqx_kfac.LevenbergMarquardtDamping(1.0, interval="5")  # `interval: int`
    assert eqx_kfac.LevenbergMarquardtDamping(1.0, interval=5).interval == 5
