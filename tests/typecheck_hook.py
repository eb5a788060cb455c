"""The suite's run-time type checks (DESIGN.md): jaxtyping's import hook on `eqx_kfac`, with
beartype, installed by `conftest.py` before anything imports the package.

jaxtyping's hook decorates every class and every function. A function without annotations has
nothing to check, yet its wrapper costs ~10 us per call, and a nested one is decorated again,
~1 ms, every time its enclosing function runs (the tracer's helpers run thousands of times per
trace). Here the hook leaves those functions as they are; classes and every function with an
annotation are checked as before. Measured on test_flax_layers.py and
test_estimators_block_diagonal.py (about 100 s): 1,758 decorations instead of 2,794, 6.2 s of
decorating instead of 8.5 s (the hook in all costs about a fifth of their CPU time; most of what
is left is decorating the package's annotated functions once, at import).
`tests/test_typecheck_hook.py` checks both halves, so a jaxtyping release that changes the hook's
internals fails the suite instead of dropping the checks.
"""

import ast

import jaxtyping
from jaxtyping import _import_hook  # the hook's AST transformer (not public: see the test)

PACKAGE, TYPECHECKER = "eqx_kfac", "beartype.beartype"


def has_annotations(node: ast.FunctionDef) -> bool:
    """Whether the function annotates its return or any argument."""
    args = node.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    return node.returns is not None or any(a is not None and a.annotation is not None for a in every)


class AnnotatedOnly(_import_hook.JaxtypingTransformer):
    """jaxtyping's transformer, which leaves functions without annotations undecorated (their
    bodies are still visited, for the classes and annotated functions they define)."""

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        if has_annotations(node):
            return super().visit_FunctionDef(node)
        self.generic_visit(node)
        return node


def install() -> None:
    """Installs the hook for `eqx_kfac` (for the rest of the process)."""
    _import_hook.JaxtypingTransformer = AnnotatedOnly
    jaxtyping.install_import_hook(PACKAGE, TYPECHECKER)
