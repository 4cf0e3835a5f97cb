"""The package's shape: its modules import one another without a circle, the MoE layer (``moe/``), the model
(``model/``) and the distributed pieces (``parallel/``) import nothing of the training loop (``train/``), ``moe/``
imports nothing of ``model/`` (which is built from it), nothing outside ``tools/`` imports a command, and no class
or top-level function grows past a screenful.

Read from the source with ``ast``, nothing imported. An import counts wherever it stands: at the top of a
module or inside a function (a lazy import, made there to keep a light module light or a Triton kernel off
the CPU, still ties the two modules: the one that imports lazily cannot work without the other). So a
circle that only a function-local import closes is a circle too. ``megablocks_utils/__init__.py``'s
``importlib`` table of re-exports is no import statement and is not read.

An import of ``megablocks_utils.a.b`` (``import``, ``from megablocks_utils.a import b``, or a relative
``from .b import c``) is an arrow to the module ``a/b.py``, or to the package ``a/__init__.py`` where ``b``
is a name it defines; package ``__init__`` files run on the way are not arrows of their own.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "megablocks_utils"
MAX_LINES = 150  # a class or top-level function of 150 lines or more is two ideas


def package_modules() -> dict[str, str]:
    """Every module of the package: dotted name -> file path (a package is its ``__init__.py``)."""
    modules = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imported_modules(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The package's modules that ``module`` imports, at its top or inside its functions."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package, up level - 1 more
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from a import b``: b is a module of a, or a name that a defines
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # ``import a.b.c`` where c is a name: the module a.b
                name = name.rpartition(".")[0]
            if name.startswith(PACKAGE) and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {module: imported_modules(module, path, modules) for module, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as [a, b, ..., a], or None (depth-first search, in sorted order)."""
    state = {}  # module -> "open" while on the current path, "done" once all it reaches is searched
    path = []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_import_graph_is_read():
    graph = import_graph()
    assert "megablocks_utils.moe.dispatch" in graph["megablocks_utils.moe.layer"]
    # a function-local import counts: dispatch imports its Triton gathers inside its functions
    assert "megablocks_utils.moe.gather_kernels" in graph["megablocks_utils.moe.dispatch"]
    assert "megablocks_utils.quiet" in graph["megablocks_utils"]  # relative import


def test_find_cycle_names_the_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_package_imports_have_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "modules of megablocks_utils import each other in a circle: " + " -> ".join(cycle)


def room_ties(room: str, above: str) -> list[str]:
    """Each import from a module of ``room/`` into ``above/``, as "module -> target"."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if module.startswith(f"{PACKAGE}.{room}.")
        for target in targets
        if target.startswith(f"{PACKAGE}.{above}.")
    )


@pytest.mark.parametrize("room", ["parallel", "model", "moe"])
def test_lower_room_does_not_import_train(room):
    """The MoE layer, the model and how it is spread over GPUs stand below the training loop: what one of them needs
    of ``train/`` moves down, or the piece that needs both moves up into ``train/`` (as ``train/checkpoint_export``)."""
    ties = room_ties(room, "train")
    assert not ties, f"{room}/ imports train/ (move the piece it needs down, or the piece that needs both up): " + "; ".join(ties)


def test_moe_does_not_import_model():
    """``model/`` is built from ``moe/``'s layers, so ``moe/`` stands below it: which modules are MoE blocks is
    ``moe/blocks``', and a check of a model-table row is ``model/``'s."""
    ties = room_ties("moe", "model")
    assert not ties, "moe/ imports model/ (move the piece it needs into moe/, or the piece that needs both up into model/): " + "; ".join(ties)


@pytest.mark.parametrize("room,above", [("moe", "parallel"), ("data", "model"), ("model", "parallel")])
def test_a_room_does_not_import_the_one_built_on_it(room, above):
    """``parallel/`` spreads the MoE layers over GPUs (the layer reads the mesh it is given, nothing of ``parallel/``);
    ``model/`` reads the data's rows (varlen's document boundaries are the packed rows': ``data/packing``); ``model/``
    is built onto the mesh (``mesh.py``, below both) and ``parallel/`` spreads it over it."""
    ties = room_ties(room, above)
    assert not ties, f"{room}/ imports {above}/: " + "; ".join(ties)


def test_only_tools_import_tools():
    """``tools/`` holds command-line entry points only: a piece that another room needs lives in that room."""
    tools = f"{PACKAGE}.tools"
    ties = sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if not (module == tools or module.startswith(f"{tools}."))
        for target in targets
        if target == tools or target.startswith(f"{tools}.")
    )
    assert not ties, "a module outside tools/ imports a command (move the piece it needs into the room that owns it): " + "; ".join(ties)


def test_no_class_or_function_of_150_lines_or_more():
    long_parts = []
    for module, path in sorted(package_modules().items()):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines >= MAX_LINES:
                    long_parts.append(f"{module}.{node.name}: {lines} lines")
    assert not long_parts, f"split by idea what has grown to {MAX_LINES} lines or more: " + "; ".join(long_parts)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
