"""Every `eqx.Module` is abstract or final: no class, in the package or in the docs' examples,
subclasses a concrete one.

The rule, precisely: a class is *abstract* when it cannot be instantiated, i.e. it has abstract
methods or `eqx.AbstractVar` / `eqx.AbstractClassVar` fields left; every other module is
*final*. A class may subclass only abstract modules (and `eqx.Module`). Classes named
`Abstract*` must be abstract by this rule, so the name never lies; the documented extension points
without the prefix (`CurvatureBlock`, `LossFunction`, the block families `Diagonal`, `Full`,
`KroneckerFactored`) are abstract by their abstract methods.
"""

import ast
import importlib
import inspect
import pathlib
import pkgutil
import re

import equinox as eqx
import pytest

import eqx_kfac

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def _is_abstract(cls: type) -> bool:
    return bool(inspect.isabstract(cls) or cls.__abstractvars__ or cls.__abstractclassvars__)


def _package_modules() -> list[type]:
    for info in pkgutil.walk_packages(eqx_kfac.__path__, "eqx_kfac."):
        importlib.import_module(info.name)
    found, stack = set(), [eqx.Module]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                stack.append(sub)
    return sorted(
        (c for c in found if c.__module__.startswith("eqx_kfac")), key=lambda c: (c.__module__, c.__qualname__)
    )


def _concrete_bases(cls: type) -> list[str]:
    """The concrete `eqx.Module`s among the ancestors of `cls`."""
    return [
        f"{b.__module__}.{b.__qualname__}"
        for b in cls.__mro__[1:]
        if b is not eqx.Module and issubclass(b, eqx.Module) and not _is_abstract(b)
    ]


def test_the_check_sees_a_subclass_of_a_final_class():
    class Nesterov(eqx_kfac.MomentumStep):
        pass

    class Rule(eqx_kfac.AbstractStepRule):
        pass

    assert _concrete_bases(Nesterov) == ["eqx_kfac._optim.step_rule.MomentumStep"]
    assert _concrete_bases(Rule) == []
    assert _is_abstract(eqx_kfac.CurvatureBlock) and _is_abstract(eqx_kfac.KroneckerFactored)
    assert not _is_abstract(eqx_kfac.PreconditionedGradient)


def test_no_package_module_subclasses_a_final_class():
    modules = _package_modules()
    assert eqx_kfac.DenseTwoKroneckerFactored in modules and len(modules) > 100
    broken = {f"{c.__module__}.{c.__qualname__}": _concrete_bases(c) for c in modules}
    assert {name: bases for name, bases in broken.items() if bases} == {}


def test_classes_named_abstract_are_abstract():
    named = [c for c in _package_modules() if c.__name__.lstrip("_").startswith("Abstract")]
    assert eqx_kfac.AbstractDirection in named
    assert [f"{c.__module__}.{c.__qualname__}" for c in named if not _is_abstract(c)] == []


def _page_blocks(page: pathlib.Path) -> list[ast.Module]:
    """The page's Python blocks that parse (some are sketches); a block that defines a class
    must parse."""
    parsed = []
    for code in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL):
        try:
            parsed.append(ast.parse(code))
        except SyntaxError:
            assert not re.search(r"^\s*class ", code, flags=re.MULTILINE), f"{page.name}: {code}"
    return parsed


def _declares_abstract(node: ast.ClassDef) -> bool:
    """Whether a docs class is abstract by its own body (an abstract method or variable)."""
    source = ast.unparse(node)
    return "abstractmethod" in source or "AbstractVar" in source or "AbstractClassVar" in source


def _docs_violations(page: pathlib.Path) -> list[str]:
    blocks = _page_blocks(page)
    classes = [n for block in blocks for n in ast.walk(block) if isinstance(n, ast.ClassDef)]
    if not classes:
        return []
    imports = [n for block in blocks for n in block.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    namespace: dict = {}
    exec(compile(ast.Module(imports, type_ignores=[]), str(page), "exec"), namespace)
    own = {node.name: node for node in classes}
    broken = []
    for node in classes:
        for base in node.bases:
            name = ast.unparse(base)
            if name in own:
                if not _declares_abstract(own[name]):
                    broken.append(f"{page.name}: {node.name} subclasses the final {name} (on the page)")
                continue
            value = eval(name, namespace)
            if isinstance(value, type) and issubclass(value, eqx.Module) and value is not eqx.Module:
                if not _is_abstract(value):
                    broken.append(f"{page.name}: {node.name} subclasses the final {name}")
    return broken


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=lambda p: str(p.relative_to(DOCS)))
def test_docs_examples_subclass_only_abstract_modules(page):
    assert _docs_violations(page) == []


def test_the_docs_check_sees_a_subclass_of_a_final_class(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport eqx_kfac\n\nclass Nesterov(eqx_kfac.MomentumStep):\n    pass\n```\n"
        "```python\nclass Fine(eqx_kfac.AbstractStepRule):\n    pass\n\n\nclass Worse(Fine):\n    pass\n```\n"
    )
    assert _docs_violations(page) == [
        "page.md: Nesterov subclasses the final eqx_kfac.MomentumStep",
        "page.md: Worse subclasses the final Fine (on the page)",
    ]
