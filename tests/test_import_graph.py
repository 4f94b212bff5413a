"""The import graph of src/fedpcd: no cycles, and layers that import one way.

Every import counts: module level, inside functions and under ``if TYPE_CHECKING:`` (a cycle or an arrow up
hidden by a function-level or typing-only import is still one in the design).
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "fedpcd"  # the public front (fedpcd/__init__.py): the top, imported by nothing in the package

# Lowest first. A module belongs to the layer of the longest prefix naming it (a prefix names itself and its
# submodules); it may import modules of its own layer or of lower ones, never of a higher one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "fedpcd._version",
            "fedpcd.errors",
            "fedpcd.seeds",
            "fedpcd.utils",
            "fedpcd.procs_guard",
            "fedpcd.run_format",
            "fedpcd.run_schema",
            "fedpcd.run_read",
            "fedpcd.logs",
        ),
    ),
    ("parameters and registries", ("fedpcd.params", "fedpcd.registry", "fedpcd.catalog")),
    (
        "config schema",
        ("fedpcd.config", "fedpcd.config_input", "fedpcd.config_identity", "fedpcd.config_docs"),
    ),
    ("data and models", ("fedpcd.data", "fedpcd.models")),
    ("algorithms", ("fedpcd.algorithms",)),
    (
        "config resolution",
        ("fedpcd.declarations", "fedpcd.presets", "fedpcd.resolve", "fedpcd.labels", "fedpcd.components"),
    ),
    ("engine, with the local backend", ("fedpcd.engine",)),
    ("the round loop's observers", ("fedpcd.trackers", "fedpcd.observers")),
    ("the Flower backend", ("fedpcd.flower",)),
    ("the choice of backend", ("fedpcd.backends",)),
    ("sweeps, reports", ("fedpcd.sweep", "fedpcd.launchers", "fedpcd.report")),
    ("api", ("fedpcd.api", "fedpcd.demo")),
    ("command line", ("fedpcd.cli", "fedpcd.cli_args", "fedpcd.listing")),
    ("front", (ROOT,)),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "fedpcd").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the fedpcd modules it imports (the longest module prefix of each imported name), counting
    every import statement anywhere in the module."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name == ROOT or name.startswith(ROOT + ".") else None
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of a module's layer (None: in none)."""
    if module == ROOT:
        return len(LAYERS) - 1
    named = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if prefix != ROOT and (module == prefix or module.startswith(prefix + "."))
    ]
    return max(named)[1] if named else None


def upward_imports(graph: dict[str, set[str]]) -> set[str]:
    """Every ``importer -> imported`` where the imported module's layer is above the importer's."""
    return {
        f"{mod} -> {target}"
        for mod, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(mod)  # type: ignore[operator]  # every module has one (tested)
    }


def test_no_import_cycles_in_src():
    graph = import_graph()
    assert len(graph) > 50 and "fedpcd.engine.local" in graph["fedpcd.engine"]
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _modules() if layer_of(m) is None)
    assert not unplaced, f"modules in no layer of LAYERS: {', '.join(unplaced)}"


def test_layers_import_one_way():
    new = sorted(upward_imports(import_graph()))
    assert not new, "imports from a lower layer to a higher one:\n" + "\n".join(
        f"  {arrow} ({LAYERS[layer_of(arrow.split(' -> ')[0])][0]} -> "  # type: ignore[index]
        f"{LAYERS[layer_of(arrow.split(' -> ')[1])][0]})"  # type: ignore[index]
        for arrow in new
    )


def test_function_level_and_type_checking_imports_count():
    graph = import_graph()
    assert "fedpcd.report.document" in graph["fedpcd.cli"]  # only imported inside cmd_report
    assert "fedpcd.api" in graph[ROOT]  # only imported under TYPE_CHECKING


def layer_drawing() -> str:
    """The layers as docs/design.md draws them: one line each, lowest first, with its modules."""
    lines = []
    for number, (name, prefixes) in enumerate(LAYERS, 1):
        names = ", ".join(p.removeprefix(f"{ROOT}.") if p != ROOT else ROOT for p in prefixes)
        lines.append(f"{number:>2}  {name}: {names}")
    return "\n".join(lines)


def test_design_md_draws_these_layers():
    text = (SRC.parent / "docs" / "design.md").read_text()
    block = f"```\n{layer_drawing()}\n```"
    assert block in text, f"docs/design.md's layer drawing is out of date; it is now:\n{block}"


MAX_LINES = 500  # a module doing one job fits in this many lines


def test_no_src_module_is_over_500_lines():
    """Each module of src/fedpcd does one job: none is over MAX_LINES lines."""
    long = {
        str(p.relative_to(SRC)): n
        for p in sorted((SRC / "fedpcd").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these modules: {long}"
