"""The import direction of docs/ARCHITECTURE.md holds: frontend -> engine/server -> scheduler -> model -> kernels,
and the leaves (memory, sampling, constrained, kernels, token_ids) import nothing of the runtime above them.

Every import statement of the package is read with ``ast`` (relative imports resolved); imports under
``if TYPE_CHECKING:`` are annotations only and do not count. An import inside a function is "lazy": it runs only
when that function is called, which is how the HTTP process stays free of torch.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Folder on disk -> package name (pyproject's package-dir).
PACKAGES = {"radixrt": "radixrt", "frontend": "radixrt.frontend", "kernels": "radixrt.kernels"}

# Importer prefix -> the radixrt modules it may import (prefixes), at module level or lazily.
# The first matching importer prefix wins, so the more specific ones come first.
ALLOWED: list[tuple[str, tuple[str, ...]]] = [
    ("radixrt.frontend", ("radixrt.frontend", "radixrt.procs", "radixrt.reasoning")),
    ("radixrt.kernels", ("radixrt.kernels",)),
    ("radixrt.token_ids", ()),
    ("radixrt.device_copy", ()),
    ("radixrt.procs", ()),
    ("radixrt.env", ()),
    ("radixrt.metrics", ()),
    ("radixrt.reasoning", ("radixrt.reasoning", "radixrt.tools.markers", "radixrt.tools.regex")),
    ("radixrt.memory", ("radixrt.memory", "radixrt.token_ids")),
    ("radixrt.sampling", ("radixrt.sampling", "radixrt.device_copy", "radixrt.kernels")),
    ("radixrt.constrained", ("radixrt.constrained", "radixrt.token_ids")),
    ("radixrt.protocol", ("radixrt.protocol", "radixrt.sampling.params", "radixrt.constrained.patterns")),
    ("radixrt.model", ("radixrt.model", "radixrt.kernels", "radixrt.memory.page_pool", "radixrt.device_copy",
                       "radixrt.env")),
    ("radixrt.server_args", ("radixrt.env",)),
    ("radixrt.detokenize", ("radixrt.protocol", "radixrt.sampling.stop_regex")),
    ("radixrt.response", ("radixrt.protocol",)),
    ("radixrt.client", ("radixrt.protocol", "radixrt.response", "radixrt.metrics")),
    ("radixrt.tools", ("radixrt.tools", "radixrt.protocol", "radixrt.constrained.patterns",
                       "radixrt.constrained.text_regex")),
    ("radixrt.distributed", ("radixrt.distributed", "radixrt.model", "radixrt.server_args", "radixrt.procs")),
    ("radixrt.scheduler", ("radixrt.scheduler", "radixrt.memory", "radixrt.model", "radixrt.sampling",
                           "radixrt.constrained", "radixrt.protocol", "radixrt.detokenize", "radixrt.server_args",
                           "radixrt.token_ids", "radixrt.metrics")),
]
# The top of the stack: nothing else imports these (radixrt/__init__.py re-exports the frontend).
UPPER = ("radixrt.engine", "radixrt.server", "radixrt.frontend", "radixrt.bench", "radixrt.cli",
         "radixrt.launch_server")
# Modules the HTTP process and the Engine may load only inside a function (they pull in torch and the model).
HEAVY = ("radixrt.scheduler.scheduler", "radixrt.loaded_model", "radixrt.model", "radixrt.lockstep", "torch",
         "transformers")


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    lazy: bool
    line: int


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts).replace("/", ".")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_of(path: pathlib.Path) -> list[Import]:
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub, lazy)
                continue
            if isinstance(child, ast.Import):
                found.extend(Import(name, alias.name, lazy, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                # `from pkg import mod` imports pkg.mod when mod is a submodule.
                for alias in child.names:
                    sub = f"{target}.{alias.name}"
                    is_module = any(p.exists() for p in _candidate_paths(sub))
                    found.append(Import(name, sub if is_module else target, lazy, child.lineno))
            else:
                visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return found


def _candidate_paths(module: str) -> list[pathlib.Path]:
    parts = module.split(".")
    if parts[0] != "radixrt":
        return []
    folder = "radixrt"
    if len(parts) > 1 and parts[1] in ("frontend", "kernels"):
        folder, parts = parts[1], parts[2:]
    else:
        parts = parts[1:]
    base = ROOT / folder / pathlib.Path(*parts) if parts else ROOT / folder
    return [base.with_suffix(".py"), base / "__init__.py"]


def _all_imports() -> list[Import]:
    files = [p for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))]
    return [imp for p in files for imp in _imports_of(p)]


def _matches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _radixrt(module: str) -> bool:
    return module == "radixrt" or module.startswith("radixrt.")


def test_the_import_reader_sees_relative_and_lazy_imports():
    imports = _all_imports()
    assert len(imports) > 300
    assert "radixrt.loaded_model" in {i.target for i in imports if i.importer == "radixrt.engine" and i.lazy}
    assert any(i.importer.startswith("radixrt.frontend") and i.target.startswith("radixrt.frontend.")
               for i in imports)


def test_lower_layers_import_only_what_they_may():
    bad = []
    for imp in _all_imports():
        if not _radixrt(imp.target) or imp.target == imp.importer:
            continue
        for prefix, allowed in ALLOWED:
            if _matches(imp.importer, (prefix,)):
                if not _matches(imp.target, allowed):
                    bad.append(f"{imp.importer}:{imp.line} imports {imp.target}")
                break
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_nothing_below_the_top_imports_the_engine_the_server_or_the_frontend():
    bad = [f"{i.importer}:{i.line} imports {i.target}" for i in _all_imports()
           if _matches(i.target, UPPER) and not _matches(i.importer, UPPER) and i.importer != "radixrt"]
    assert not bad, "\n".join(bad)


def test_the_engine_and_the_http_process_load_the_model_side_only_when_called():
    bad = [f"{i.importer}:{i.line} imports {i.target} at module level" for i in _all_imports()
           if _matches(i.importer, ("radixrt.engine", "radixrt.server")) and not i.lazy
           and _matches(i.target, HEAVY)]
    assert not bad, "\n".join(bad)


def test_the_http_process_and_the_request_checks_import_no_torch():
    modules = ["radixrt", "radixrt.protocol.request", "radixrt.protocol.validation", "radixrt.constrained",
               "radixrt.protocol.messages", "radixrt.client", "radixrt.server.launch", "radixrt.server.tokenizer_manager",
               "radixrt.server.openapi", "radixrt.server.security", "radixrt.engine"]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "heavy = [m for m in ('torch', 'transformers', 'outlines_core') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]


def test_every_package_on_disk_is_listed_for_the_wheel():
    """pyproject lists the packages a wheel holds: a folder left out installs without it (the wheel once lacked
    radixrt.protocol, so every installed copy failed at its first import of it)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join([package, *init.parent.relative_to(ROOT / folder).parts])
        for folder, package in PACKAGES.items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert on_disk - listed == set(), f"packages missing from pyproject.toml: {sorted(on_disk - listed)}"
