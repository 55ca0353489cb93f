"""The import graph of the code (tests aside), measured from its own imports:

    python scripts/structure.py [--root DIR]

prints its modules, the layers they stand in, the imports between modules, the imports that run
back up a layer (a lower layer importing a higher one), and the import cycles. tests/unit's
layout test holds the last two at none, and the OpenAI facade to the job service's exports.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("thinkbatch", "api", "worker", "devstack", "demo", "bench", "scripts")

# From the ground up: a module may import its own layer and those below it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("thinkbatch",)),  # settings, models, errors, the guard, db, queue, ...
    ("ledger", ("thinkbatch.ledger",)),
    ("services", ("thinkbatch.jobs", "thinkbatch.keys")),
    ("facades", ("thinkbatch.openai", "thinkbatch.sweeper", "thinkbatch.cli")),
    ("processes", ("api", "worker")),
    ("dev stack", ("devstack",)),
    ("tools", ("demo", "bench", "scripts")),
)


def modules(root: Path = ROOT) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def layer(module: str) -> int:
    """The highest layer whose prefix names the module (the most specific one wins)."""
    best, length = 0, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = index, len(prefix)
    return best


def imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The known modules `module` imports, at any depth (a function-level import counts)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                yield target
                break


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: set(imports(name, path, known)) for name, path in known.items()}


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in edges.items() for b in targets if layer(b) > layer(a))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def main(argv: list[str]) -> int:
    root = Path(argv[argv.index("--root") + 1]) if "--root" in argv else ROOT
    edges = graph(root)
    print(f"modules: {len(edges)}")
    for number, (name, prefixes) in enumerate(LAYERS, start=1):
        members = sum(1 for m in edges if layer(m) == number - 1)
        print(f"layer {number} {name:<10} {members:>3} modules  ({', '.join(prefixes)})")
    print(f"imports between modules: {sum(len(t) for t in edges.values())}")
    up = upward(edges)
    print(f"imports back up a layer: {len(up)}")
    for a, b in up:
        print(f"  {a} -> {b}")
    found = cycles(edges)
    print(f"import cycles: {len(found)}")
    for component in found:
        print(f"  {' <-> '.join(component)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
