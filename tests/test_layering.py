"""The planes' import boundary (ARCHITECTURE §2, Contracts): the data plane (`workers/`,
`kernels/`) imports no control-plane module; what both planes exchange lives in
`contracts/`, which imports neither plane (nor torch: the control plane imports it).

Every module is parsed, not imported, so an import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FOLDERS = {
    "workers": "kvloom.workers",
    "kernels": "kvloom.kernels",
    "contracts": "kvloom.contracts",
}


def module_name(path: Path, folder: str) -> str:
    parts = path.relative_to(REPO / folder).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((FOLDERS[folder], *parts))


def imported_modules(path: Path, folder: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth: `import a`,
    `from a import b` (as `a` and `a.b`, since b may be a module), relative imports
    resolved, and `importlib.import_module` / `__import__` of a literal name."""
    name = module_name(path, folder)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            out.append((node.lineno, module))
            out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append((node.lineno, node.args[0].value))
    return out


def violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((REPO / folder).rglob("*.py")):
        for line, module in imported_modules(path, folder):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(REPO)}:{line}: imports {module}")
    return sorted(set(found))


@pytest.mark.parametrize("folder", ["workers", "kernels"])
def test_the_data_plane_imports_no_control_plane_module(folder):
    assert list((REPO / folder).rglob("*.py")), f"no modules under {folder}/"
    assert violations(folder, ("kvloom.cluster",)) == []


def test_contracts_import_neither_plane_nor_torch():
    assert (REPO / "contracts" / "__init__.py").is_file()
    forbidden = ("kvloom.cluster", "kvloom.workers", "kvloom.kernels", "torch")
    assert violations("contracts", forbidden) == []


def test_the_checker_sees_every_kind_of_import(tmp_path, monkeypatch):
    """The scan catches function-level, relative, `from kvloom import cluster` and
    import_module imports (a checker that misses them would pass vacuously)."""
    fake = tmp_path / "workers"
    (fake / "sub").mkdir(parents=True)
    (fake / "sub" / "mod.py").write_text(
        "import importlib\n"
        "def f():\n"
        "    from kvloom.cluster.engine import Engine\n"
        "    from ...cluster import scheduler\n"
        "    from kvloom import cluster\n"
        "    import kvloom.cluster.request\n"
        "    importlib.import_module('kvloom.cluster.tokenizer')\n"
        "from kvloom.contracts.config import EngineConfig\n"
        "from ..layers import attention\n"
    )
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    found = violations("workers", ("kvloom.cluster",))
    expected = [
        (3, "kvloom.cluster.engine"),
        (3, "kvloom.cluster.engine.Engine"),
        (4, "kvloom.cluster"),
        (4, "kvloom.cluster.scheduler"),
        (5, "kvloom.cluster"),
        (6, "kvloom.cluster.request"),
        (7, "kvloom.cluster.tokenizer"),
    ]
    assert found == sorted(f"workers/sub/mod.py:{line}: imports {m}" for line, m in expected)
