"""The package's layers: no module imports from a layer above its own, and no import cycles.

`LAYERS` is the one place where the order is written down (`docs/internals.md` describes it):
each entry is a module prefix and its rank; a module belongs to the longest prefix that names
it, and may import only modules of the same or a lower rank. Within a rank, the modules'
imports must not form a cycle.
"""

import ast
import pathlib

import pytest


PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "eqx_kfac"

LAYERS = {
    # core: dense linear algebra, control flow, device helpers, caching
    "eqx_kfac._core": 0,
    # tracing: tags, the jaxpr interpreter, the tracer, the graph matcher, the losses
    "eqx_kfac._tracing": 1,
    # curvature, bottom to top: structured operators, their powers and spectral functions, the
    # Kronecker solvers, patches; the blocks' curvature operators; the blocks; the estimators and
    # the parameter-space operator; what is built from estimators and blocks (the K-FAC operator,
    # the estimator solves)
    "eqx_kfac._curvature.operators": 2,
    "eqx_kfac._curvature.solvers": 2,
    "eqx_kfac._curvature.patches": 2,
    "eqx_kfac._curvature.operators.block_operators": 3,
    "eqx_kfac._curvature.blocks": 4,
    "eqx_kfac._curvature.estimators": 5,
    "eqx_kfac._curvature.operators.parameter_space": 5,
    "eqx_kfac._curvature.operators.kfac": 6,
    "eqx_kfac._curvature.solvers.estimator": 6,
    "eqx_kfac._curvature": 6,
    # optimisation: the optimizer's parts, the optimizer, the optax transformation
    "eqx_kfac._optim": 7,
    # physics-informed networks: Taylor-mode layers, their blocks and optimizers (on all above)
    "eqx_kfac._pinn": 8,
    # the face: the public namespace and the testing kit
    "eqx_kfac": 9,
}


def _module_name(path: pathlib.Path) -> tuple[str, bool]:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name, is_package = _module_name(path)
        modules[name] = (path, is_package)
    return modules


def _imports(name: str, path: pathlib.Path, is_package: bool, modules) -> set[str]:
    """The package's modules that `name` imports (a package stands for its `__init__`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: None if is_package else -1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [f"{target}.{alias.name}" for alias in node.names] + [target]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                found.add(target)
    return found


def _rank(name: str) -> int:
    prefixes = [p for p in LAYERS if name == p or name.startswith(p + ".")]
    return LAYERS[max(prefixes, key=len)]


MODULES = _modules()
IMPORTS = {name: _imports(name, path, pkg, MODULES) for name, (path, pkg) in MODULES.items()}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_from_a_higher_layer(name):
    upward = sorted(t for t in IMPORTS[name] if _rank(t) > _rank(name))
    assert not upward, f"{name} (layer {_rank(name)}) imports from higher layers: {upward}"


def test_no_import_cycles():
    cycles = []
    state: dict[str, str] = {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for target in sorted(IMPORTS[name]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[name] = "done"

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_module_has_a_layer():
    assert all(name == "eqx_kfac" or name.startswith("eqx_kfac.") for name in MODULES)
    assert len(MODULES) > 50
