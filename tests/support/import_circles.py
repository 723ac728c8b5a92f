"""Fails when the runtime package imports in a circle: ``python -m tests.support.import_circles`` (the lint session).

Reads every ``import`` / ``from ... import`` statement of ``gdn_compat`` and ``_gdn_compat_auto.py`` (at any depth: a
function-level import is an arrow too; ``if TYPE_CHECKING:`` blocks are not), resolves each to a file of the package,
and looks for a cycle. Standard library only.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def modules() -> dict[str, pathlib.Path]:
    found = {"_gdn_compat_auto": ROOT / "_gdn_compat_auto.py"}
    for path in sorted((ROOT / "gdn_compat").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The package modules ``name`` imports (a ``from pkg import sub`` names the submodule when there is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            todo += node.orelse
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
        todo += list(ast.iter_child_nodes(node))
    resolved = set()
    for target in out:
        while target and target not in known:  # import a.b.c of a package module a.b
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def circles() -> list[list[str]]:
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def main() -> int:
    found = circles()
    for cycle in found:
        print("import circle: " + " -> ".join(cycle))
    print(f"{len(modules())} modules read, {len(found)} import circle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
