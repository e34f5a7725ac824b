"""The package's import graph between files: cycles and imports that go up the layers.

    python scripts/import_graph.py [--edges]

Every module under src/eagle_deploy is parsed with `ast`; every import counts, at module level
or inside a function, relative or absolute, and `from x import y` names the submodule `x.y` when
`y` is one. It prints

- the import cycles between files: strongly connected components of more than one module;
- the upward imports under the layering (lowest first)
      contract < common < exporter, heads, runtime < validate, train < bench, serve, triton
        < the console entry points
  that is, a module of a lower layer importing one of a higher layer, and the imports between
  `runtime` and `exporter` or `heads`, siblings that never import each other. (`heads` builds
  its modules on the exporter's torch layers and the exporter's draft graphs wrap heads: the
  two import each other's files, never in a loop, which the cycle check sees.) The console
  entry points, each package's `cli` module, sit above every layer, as Polygraphy's `tools/`
  over its `backend/`: one may import any package (eagle-export calls the Triton repository
  writer for --triton-repo), and no module imports one. (The smaller commands whose `main` lives
  beside their library code, eagle-eval and the two eagle-triton-*, stay in their package's layer.)

Imports of a package's `__init__` that importing a submodule runs implicitly are not edges (the
package's own `__init__.py` is an edge only when it is named). Exits 1 when there is a cycle or
an upward import, so it can run as a check.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = "eagle_deploy"
PACKAGE = Path(__file__).resolve().parent.parent / "src" / ROOT

LAYERS = [("contract",), ("common",), ("exporter", "heads", "runtime"), ("validate", "train"),
          ("bench", "serve", "triton")]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
NEVER_EACH_OTHER = {frozenset(("exporter", "runtime")), frozenset(("heads", "runtime"))}
ENTRY = "entry points"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join((ROOT, *parts))


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, known: dict[str, Path]) -> dict[str, int]:
    """The package's modules that `name` imports, each with the first line that imports it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        # the longest prefix of `target` that is one of the package's modules
        parts = target.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        if parts and parts != [ROOT] or target == ROOT:
            found.setdefault(".".join(parts), line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == ROOT:
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != ROOT:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in known else source, node.lineno)
    found.pop(name, None)
    return found


def graph() -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}, known


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def layer(name: str) -> str | None:
    parts = name.split(".")
    if len(parts) == 3 and parts[1] in RANK and parts[2] == "cli":
        return ENTRY
    return parts[1] if len(parts) > 1 and parts[1] in RANK else None


def rank(layer_name: str) -> int:
    return len(LAYERS) if layer_name == ENTRY else RANK[layer_name]


def upward(edges: dict[str, dict[str, int]]) -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import from a lower layer into a higher one, between
    two siblings that never import each other, or between two console entry points."""
    found = []
    for src, targets in sorted(edges.items()):
        for dst, line in sorted(targets.items()):
            a, b = layer(src), layer(dst)
            if a is None or b is None or (a == b and a != ENTRY):  # one command never imports another
                continue
            if a == b or rank(a) < rank(b) or frozenset((a, b)) in NEVER_EACH_OTHER:
                found.append((src, dst, line))
    return found


def short(name: str) -> str:
    return name.removeprefix(f"{ROOT}.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="also print every import edge")
    args = parser.parse_args(argv)
    edges, known = graph()
    if args.edges:
        for src, targets in sorted(edges.items()):
            for dst, line in sorted(targets.items()):
                print(f"{short(src)} -> {short(dst)}  (line {line})")
        print()
    found_cycles = cycles(edges)
    print(f"import cycles between files: {len(found_cycles)}")
    for component in found_cycles:
        print("  " + " <-> ".join(short(name) for name in component))
        members = set(component)
        for src in component:
            for dst, line in sorted(edges[src].items()):
                if dst in members:
                    print(f"      {short(src)}:{line} imports {short(dst)}")
    found_upward = upward(edges)
    print(f"upward imports: {len(found_upward)}  "
          f"(layers, lowest first: {' < '.join(', '.join(names) for names in LAYERS)} < {ENTRY})")
    for src, dst, line in found_upward:
        print(f"  {short(src)}:{line} imports {short(dst)}")
    print(f"({len(known)} modules, {sum(map(len, edges.values()))} imports between them)")
    return 1 if found_cycles or found_upward else 0


if __name__ == "__main__":
    sys.exit(main())
