"""The import layers, read from the source: the core imports no framework and no integration, not even through a
module name in a string; the package face imports the transformers integration openly; every ``__all__`` is whole."""

import ast
import importlib
from pathlib import Path

import pytest

import cudnn_attention

CORE_DIR = Path(cudnn_attention.__file__).parent
INTEGRATIONS_DIR = Path(importlib.import_module("cudnn_attention.integrations").__file__).parent
FRAMEWORKS = ("transformers", "lightning", "pytorch_lightning")
# Calls that import the module their first argument names.
STRING_IMPORTS = {"import_module", "__import__", "find_spec"}


def core_modules() -> list[Path]:
    """Every module of the core: ``cudnn_attention/*.py`` but the package face, ``__init__.py``."""
    return sorted(path for path in CORE_DIR.glob("*.py") if path.name != "__init__.py")


def _module_strings(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` bindings, so that ``import_module(NAME)`` is read like ``import_module("text")``."""
    strings = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    strings[target.id] = node.value.value
    return strings


def imported_names(path: Path) -> list[tuple[int, str]]:
    """``(line, module name)`` for every import in ``path``, function bodies included: ``import``/``from`` statements
    (relative ones with their dots) and calls of ``importlib.import_module``, ``__import__`` and ``find_spec`` (a
    name the source does not spell, e.g. one built at run time, reads as ``<dynamic>``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    strings = _module_strings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            # `from package import x` may import the submodule x: both names are listed.
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}" if node.module else base + alias.name) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args:
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if callee not in STRING_IMPORTS:
                continue
            argument = node.args[0]
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                found.append((node.lineno, argument.value))
            elif isinstance(argument, ast.Name) and argument.id in strings:
                found.append((node.lineno, strings[argument.id]))
            else:
                found.append((node.lineno, "<dynamic>"))
    return sorted(found, key=lambda item: item[0])  # ast.walk goes breadth-first: source order reads better


def _reaches_out(name: str) -> bool:
    return name == "<dynamic>" or name.lstrip(".").split(".")[0] in FRAMEWORKS or "integrations" in name.split(".")


def test_the_core_imports_no_framework_and_no_integration_not_even_by_string():
    # The integrations import the core, never the reverse; a name in a string is an import all the same.
    offenders = [f"{path.name}:{line} {name}" for path in core_modules() for line, name in imported_names(path) if _reaches_out(name)]
    assert not offenders, offenders


def test_the_guard_reads_string_imports(tmp_path):
    # The guard above can fail: each spelling of an import of the integration is caught, a name held in a constant too.
    module = tmp_path / "hook.py"
    module.write_text(
        "import importlib\n"
        "_TARGET = 'cudnn_attention.integrations.hf.registration'\n"
        "def a(): importlib.import_module(_TARGET)\n"
        "def b(): __import__('transformers.modeling_utils')\n"
        "def c(name): importlib.import_module(name)\n"
        "def d(): from .integrations.hf import registration\n"
        "def e(): import lightning.pytorch\n"
    )
    caught = [name for _, name in imported_names(module) if _reaches_out(name)]
    assert caught == [
        "cudnn_attention.integrations.hf.registration",
        "transformers.modeling_utils",
        "<dynamic>",
        ".integrations.hf",
        ".integrations.hf.registration",
        "lightning.pytorch",
    ]


def test_the_face_imports_the_transformers_integration_openly():
    names = [name for _, name in imported_names(CORE_DIR / "__init__.py")]
    assert ".integrations.hf" in names, names
    assert not any(name == "<dynamic>" or name.split(".")[0] in FRAMEWORKS for name in names), names


# ----------------------------------------------------------------------------------------------
# __all__: each names what exists, and every public function and class defined in the module
# ----------------------------------------------------------------------------------------------


def public_modules() -> list[str]:
    """Dotted names of every module of the core (the face included) and of the integrations; the launcher's
    ``bootstrap`` directory holds a start-up script (``sitecustomize``), not a module to import, and the top-level
    start-up hook the package installs, named here by its own name."""
    names = ["cudnn_attention_autoload"]
    for root, package in ((CORE_DIR, "cudnn_attention"), (INTEGRATIONS_DIR, "cudnn_attention.integrations")):
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "bootstrap" in parts:
                continue
            names.append(".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return names


def _declared_all(tree: ast.Module) -> list[str]:
    """The names in ``__all__``; none when it has none (then the module may define no public function or class)."""
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(target, ast.Name) and target.id == "__all__" for target in targets):
                return [element.value for element in node.value.elts]
    return []


@pytest.mark.parametrize("name", public_modules())
def test_all_names_every_public_function_and_class_and_only_what_exists(name):
    spec = importlib.util.find_spec(name)
    tree = ast.parse(Path(spec.origin).read_text())
    declared = _declared_all(tree)
    defined = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    missing = sorted(public for public in defined if not public.startswith("_") and public not in declared)
    assert not missing, f"{name}.__all__ misses {missing}"
    assert len(set(declared)) == len(declared), f"{name}.__all__ repeats a name: {declared}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:  # the Lightning callbacks import their namespace: the names above were read without it
        if (error.name or "").split(".")[0] not in FRAMEWORKS:
            raise
        pytest.skip(f"{name} imports {error.name}, not installed")
    absent = [public for public in declared if not hasattr(module, public)]
    assert not absent, f"{name}.__all__ names what it does not have: {absent}"


# ----------------------------------------------------------------------------------------------
# The core's modules import one another without a circle, and none imports the package face
# ----------------------------------------------------------------------------------------------


def core_import_graph() -> dict[str, set[str]]:
    """``{module: core modules it imports}`` for every module of the core (the face included), imports in function bodies
    too, read from the source."""
    modules = {path.stem for path in CORE_DIR.glob("*.py")}
    graph = {}
    for path in sorted(CORE_DIR.glob("*.py")):
        names = set()
        for _, name in imported_names(path):
            if name == "." or not name.startswith(".") or name.startswith(".."):
                continue  # `from . import x` is listed as "." and ".x": x says what it imports
            first = name[1:].split(".")[0]
            names.add(first if first in modules else "__init__")  # `from . import __version__` reads the face
        graph[path.stem] = {name for name in names if name in modules and name != path.stem}
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(module, path):
        state[module] = 1
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                return path + [imported]
            if not state.get(imported):
                found = visit(imported, path + [imported])
                if found:
                    return found
        state[module] = 2
        return None

    for module in sorted(graph):
        if not state.get(module):
            found = visit(module, [module])
            if found:
                return found
    return None


def test_the_core_imports_without_a_circle_and_never_its_face():
    graph = core_import_graph()
    assert not [module for module, imported in graph.items() if "__init__" in imported], "a core module imports the package face"
    assert _circle(graph) is None, f"an import circle: {' -> '.join(_circle(graph))}"
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the guard can fail
