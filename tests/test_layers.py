"""The architecture's rules, checked: sans-IO cores and explicit public surfaces."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

SANS_IO_MODULES = [
    "iop.events",
    "iop.errors",
    "iop.spec",
    "iop.config",
    "iop._reload",
    "iop.capabilities",
    "iop.wire",
    "iop.wire._sse",
    "iop.wire._chunks",
    "iop.wire._engine_load",
    "iop.wire._errors",
    "iop.wire._holdback",
    "iop.wire._openai_stream",
    "iop.wire._toolcalls",
    "iop.wire._tooltext",
    "iop.wire._tool_prompt",
    "iop.wire._system_fold",
    "iop.protocol",
    "iop.protocol._messages",
    "iop.protocol._session",
    "iop.ondemand._table",
]


def _modules_under(package: str) -> list[str]:
    """Every module of ``package``, found on disk: a new module is checked unasked."""
    mod = importlib.import_module(package)
    found = pkgutil.walk_packages(mod.__path__, prefix=package + ".")
    return [package, *sorted(info.name for info in found)]


# Every API surface (request parsing, encoders, collectors) is protocol, not IO.
SANS_IO_MODULES += _modules_under("iop.api")
IO_LIBRARIES = ["trio", "httpx", "httpcore", "quart", "quart_trio", "hypercorn", "anyio"]


@pytest.mark.parametrize("module", SANS_IO_MODULES)
def test_sans_io_modules_import_no_io_library(module: str) -> None:
    # A fresh interpreter, so nothing else has imported trio already.
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        f"bad = [m for m in {IO_LIBRARIES!r} if m in sys.modules]; print(','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "", f"{module} pulls in {out.stdout.strip()}"


PUBLIC_PACKAGES = [
    "iop",
    "iop.runtime",
    "iop.adapters",
    "iop.wire",
    "iop.testing",
    "iop.sim",
    "iop.managed",
    "iop.ondemand",
    "iop.api",
    "iop.edge.scheduler",
    "iop.edge.runs",
]


@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_public_surface_is_explicit(package: str) -> None:
    mod = importlib.import_module(package)
    exported = getattr(mod, "__all__", None)
    assert exported is not None, f"{package} has no __all__"
    for name in exported:
        assert hasattr(mod, name), f"{package}.__all__ names missing {name}"
        assert not name.startswith("_") or name == "__version__"


def test_the_edge_reaches_the_api_surfaces_only_through_iop_api() -> None:
    """Protocol lives in iop.api; iop.edge (routing, HTTP, the link) uses only its
    public names, so no request parsing, encoder or error vocabulary creeps back."""
    edge_dir = Path(importlib.import_module("iop.edge").__file__ or "").parent
    bad = []
    for path in sorted(edge_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            bad += [f"{path.name}: {n}" for n in names if n.startswith("iop.api.")]
    assert bad == []


def _imports_of_each_module() -> dict[str, set[str]]:
    """Module -> the iop modules it imports, ``if TYPE_CHECKING:`` imports included.

    An import of a module's own parent package (``from iop.cli import _edge``
    in ``iop.cli._main``) is how a package reaches its submodules, not a
    dependency on the package's ``__init__``; it is left out.
    """
    iop_dir = Path(importlib.import_module("iop").__file__ or "").parent
    paths = {}
    for path in iop_dir.rglob("*.py"):
        parts = path.relative_to(iop_dir.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        paths[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                found |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        ancestors = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
        graph[name] = {m for m in found if m in paths and m != name and m not in ancestors}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_loop() -> None:
    loop = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(loop) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_modules_import_each_other() -> None:
    """A module that needs another's caller takes what it needs as arguments (or
    a Protocol), as iop.edge._metrics takes the registry, scheduler and runs."""
    assert _cycles(_imports_of_each_module()) == []
