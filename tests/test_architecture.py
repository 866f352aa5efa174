"""The package's layering, read from the code's own imports (those inside functions included).

Units are qtool's stage packages and its top-level modules. Each sits on a level; an
import may go to its own unit or to a unit on a lower level, never sideways or up. That
one rule gives the ones docs/architecture.md states: no import circle; the ground
package (graph/) imports no stage; quantization/ imports neither calibration/ nor
evaluation/; integer/ imports only graph/, data/, table/ and the top-level modules below
them; nothing below the API imports the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "qtool"

LEVELS = {
    "errors": 0, "interrupt": 0, "progress": 0, "targets": 0,
    "config": 1, "atomic": 1,
    "graph": 2,
    "data": 3, "prepare": 3,
    "plan": 4,
    "table": 5,
    "calibration": 6, "quantization": 6, "integer": 6,
    "evaluation": 7,
    "choices": 8,
    "api": 9, "__init__": 9,
    "cli": 10,
    "__main__": 11,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every qtool module `path` imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("qtool"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("qtool"):
            folder = PACKAGE.parent / node.module.replace(".", "/")
            for alias in node.names:
                if (folder / f"{alias.name}.py").exists() or (folder / alias.name).is_dir():
                    found.add(f"{node.module}.{alias.name}")  # `from qtool.pkg import module`
                elif (node.module, alias.name) != ("qtool", "__version__"):  # metadata, not a layer
                    found.add(node.module)
    return found


def _unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:  # `qtool` itself: its __init__
        return "__init__"
    return parts[1]


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: sorted(i for i in _imports(path) if i != name) for name, path in MODULES.items()}


def test_every_unit_has_a_level():
    units = {_unit(m) for m in MODULES}
    assert units <= set(LEVELS), f"units without a level: {sorted(units - set(LEVELS))}"


def test_imports_go_down_the_levels_only():
    wrong = []
    for module, imported in GRAPH.items():
        unit = _unit(module)
        for target in imported:
            other = _unit(target)
            if other != unit and LEVELS[other] >= LEVELS[unit]:
                wrong.append(f"{module} -> {target} ({unit} level {LEVELS[unit]}, {other} level {LEVELS[other]})")
    assert not wrong, "imports that go sideways or up:\n" + "\n".join(wrong)


def _circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The import circles: each group of two or more modules that reach one another (Tarjan)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module):
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in graph.get(module, []):
            if target not in graph:
                continue
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            group = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(group) > 1:
                circles.append(sorted(group))

    for module in graph:
        if module not in order:
            visit(module)
    return circles


def test_no_import_circle_between_modules():
    """No two modules of qtool/ import each other, directly or through others.

    The edges are the imports the files write, module-level and inside functions alike (as for the
    levels above); the parent packages Python runs first when a submodule is imported are not
    edges. A registry package lists its members by importing them; the members import only the
    small module that defines their type (qtool.plan.ops.rule, qtool.table.formats.base).
    """
    circles = _circles(GRAPH)
    assert not circles, f"{len(circles)} import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


@pytest.mark.parametrize("rule, unit, forbidden", [
    ("the ground package imports no stage", "graph",
     {"data", "prepare", "plan", "table", "calibration", "quantization", "integer", "evaluation", "api", "cli"}),
    ("quantization imports neither calibration nor evaluation", "quantization", {"calibration", "evaluation"}),
    ("integer imports only graph, data and table of the stages", "integer",
     {"prepare", "plan", "calibration", "quantization", "evaluation", "api", "cli"}),
])
def test_named_rules(rule, unit, forbidden):
    broken = [f"{m} -> {t}" for m, ts in GRAPH.items() if _unit(m) == unit for t in ts if _unit(t) in forbidden]
    assert not broken, f"{rule}: " + ", ".join(broken)


def test_nothing_below_the_cli_imports_it():
    importers = [m for m, ts in GRAPH.items() if _unit(m) not in ("cli", "__main__") and "qtool.cli" in ts]
    assert not importers


# Each ground concept has one home; a second copy elsewhere is how the old copies drifted apart
# (one shape inference handled models over 2 GiB, the others did not).
HOMES = {
    "shape_inference.infer_shapes": "qtool.graph.shapes",
    "InferenceSession": "qtool.graph.runtime",
    "SessionOptions": "qtool.graph.runtime",
    "get_attribute_value": "qtool.graph.index",
    "convert_version": "qtool.prepare.graph_prep",
}
DEFINED_ONCE = ("node_label", "attribute", "set_attribute", "names_read", "with_outputs", "sub_model", "GraphIndex")


def _producer_map(node: ast.AST) -> bool:
    """`{out: n for n in g.node for out in n.output}`: a graph index built by hand."""
    if not isinstance(node, (ast.DictComp, ast.SetComp)):
        return False
    iters = [ast.unparse(g.iter) for g in node.generators]
    return len(iters) == 2 and iters[0].endswith(".node") and iters[1].endswith(".output")


def test_each_ground_concept_has_one_home():
    misplaced, definitions = [], {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                name = next((n for n in HOMES if called == n or called.endswith("." + n)), None)
                if name and module != HOMES[name]:
                    misplaced.append(f"{module} calls {name} (its home is {HOMES[name]})")
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in DEFINED_ONCE:
                definitions.setdefault(node.name, []).append(module)
            elif _producer_map(node) and module != "qtool.graph.index":
                misplaced.append(f"{module} builds a producer map by hand (line {node.lineno}): use GraphIndex")
    twice = [f"{name} defined in {', '.join(where)}" for name, where in definitions.items() if len(where) > 1]
    assert not misplaced + twice, "\n".join(misplaced + twice)
    assert set(definitions) == set(DEFINED_ONCE)  # the homes exist: the test reads real code
