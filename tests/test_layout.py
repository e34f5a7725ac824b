"""The package layout shows the architecture: `exporter` (with the draft heads, `heads`) and
`runtime` never import each other, `contract` imports none of them (nor anything heavy), and
nothing imports the package under a second name."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import eagle_deploy

PACKAGE = Path(eagle_deploy.__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    """Absolute module names imported anywhere in `path` (relative imports resolved)."""
    package = ".".join(("eagle_deploy", *path.relative_to(PACKAGE).parent.parts))
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def sources(subpackage: str) -> list[Path]:
    return sorted((PACKAGE / subpackage).rglob("*.py"))


@pytest.mark.parametrize("src, forbidden", [("exporter", "runtime"), ("runtime", "exporter"),
                                            ("heads", "runtime"), ("runtime", "heads"),
                                            ("contract", "runtime"), ("contract", "exporter"),
                                            ("contract", "heads"), ("contract", "common"),
                                            ("common", "runtime"), ("common", "exporter"),
                                            ("common", "heads")])
def test_no_import_crosses_between_halves(src, forbidden):
    crossings = [f"{path.relative_to(PACKAGE)} imports {name}"
                 for path in sources(src) for name in imported_modules(path)
                 if name.startswith(f"eagle_deploy.{forbidden}")]
    assert not crossings, "\n".join(crossings)


@pytest.mark.parametrize("subpackage", ["contract", "common"])
def test_contract_and_common_import_nothing_heavy(subpackage):
    heavy = ("torch", "onnx", "onnxruntime", "transformers", "tensorrt", "polygraphy")
    found = [f"{path.relative_to(PACKAGE)} imports {name}" for path in sources(subpackage)
             for name in imported_modules(path) if name.split(".")[0] in heavy]
    assert not found, "\n".join(found)


def test_import_checker_sees_a_crossing(tmp_path):
    """The checker itself finds relative and absolute crossings (so the tests above can fail)."""
    fake = PACKAGE / "exporter" / "_crossing_probe.py"
    fake.write_text("from ..runtime import decode\nimport eagle_deploy.runtime.kv\n")
    try:
        names = imported_modules(fake)
    finally:
        fake.unlink()
    assert "eagle_deploy.runtime" in names and "eagle_deploy.runtime.kv" in names


def test_package_comes_from_src_layout():
    """Tests import the package from src/, never from a folder that shadows it at the repo root."""
    assert PACKAGE.parent.name == "src", PACKAGE
    root = PACKAGE.parent.parent
    assert not any((root / name / "__init__.py").exists() for name in ("exporter", "runtime", "tools"))


def test_design_map_names_every_module():
    """The "How it works" map in docs/design.md names every module of the package."""
    design = (PACKAGE.parent.parent / "docs" / "design.md").read_text()
    section = design[design.index("## How it works"):]
    section = section[: section.index("\n## ", 5)]
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py" or "data" in rel.parts:
            continue
        folder = f"{rel.parent.as_posix()}/"
        named = f"`{rel.as_posix()}`" in section or (rel.name in section and folder in section)
        if not named:
            missing.append(rel.as_posix())
    assert not missing, missing


def test_no_import_cycle_between_files_and_no_import_up_the_layers():
    """scripts/import_graph.py over the package: no two files import each other (directly or
    round a loop) and no module imports one from a higher layer (contract < common < exporter, heads,
    runtime < validate, train < bench, serve, triton < each package's cli), nor runtime from exporter
    or heads."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "import_graph.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "import cycles between files: 0" in proc.stdout and "upward imports: 0" in proc.stdout


def test_import_graph_ranks_console_entry_points_above_every_layer():
    """A package's `cli` module may import any layer (eagle-export writes the Triton repository),
    a command never imports another, and a library module never imports a command."""
    import importlib.util

    script = Path(__file__).resolve().parent.parent / "scripts" / "import_graph.py"
    spec = importlib.util.spec_from_file_location("import_graph", script)
    graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph)
    edges = {"eagle_deploy.exporter.cli": {"eagle_deploy.triton.repo": 1, "eagle_deploy.runtime.cli": 2},
             "eagle_deploy.triton.repo": {"eagle_deploy.contract.manifest": 3},
             "eagle_deploy.exporter.export": {"eagle_deploy.exporter.cli": 4, "eagle_deploy.triton.repo": 5}}
    assert graph.upward(edges) == [("eagle_deploy.exporter.cli", "eagle_deploy.runtime.cli", 2),
                                   ("eagle_deploy.exporter.export", "eagle_deploy.exporter.cli", 4),
                                   ("eagle_deploy.exporter.export", "eagle_deploy.triton.repo", 5)]
