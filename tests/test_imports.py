"""The package's import graph has no cycles: no module imports (at the top or inside a function)
one that imports it back, directly or through others. And the layering of the developer guide holds
where it is cheapest to check: `model` imports nothing else of ours (but the progress bars), the edge never
imports cloud/."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in (SRC / "splitlm").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
        # a module "imports" the nearest enclosing module we have (splitlm.x.y.func -> splitlm.x.y)
        resolved = set()
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name and t != "splitlm":
                resolved.add(t)
        graph[name] = resolved
    return graph


class Tarjan:
    """Strongly connected components of a graph (Tarjan's algorithm)."""

    def __init__(self, graph: dict[str, set[str]]):
        self.graph, self.index, self.low, self.stack, self.on_stack = graph, {}, {}, [], set()
        self.components: list[list[str]] = []

    def visit(self, v: str) -> None:
        self.index[v] = self.low[v] = len(self.index)
        self.stack.append(v)
        self.on_stack.add(v)
        for w in self.graph.get(v, ()):
            if w not in self.index:
                self.visit(w)
                self.low[v] = min(self.low[v], self.low[w])
            elif w in self.on_stack:
                self.low[v] = min(self.low[v], self.index[w])
        if self.low[v] == self.index[v]:
            self.components.append(self.pop_component(v))

    def pop_component(self, v: str) -> list[str]:
        component: list[str] = []
        while not component or component[-1] != v:
            w = self.stack.pop()
            self.on_stack.discard(w)
            component.append(w)
        return component


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module."""
    tarjan = Tarjan(graph)
    for v in sorted(graph):
        if v not in tarjan.index:
            tarjan.visit(v)
    return [sorted(c) for c in tarjan.components if len(c) > 1]


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_layering():
    graph = import_graph()
    assert graph["splitlm.progress"] == set()  # a leaf: every layer may draw bars
    for name, targets in graph.items():
        if name.startswith("splitlm.model"):
            assert all(t.startswith(("splitlm.model", "splitlm.progress")) for t in targets), (name, targets)
        if name.startswith("splitlm.edge"):
            assert not any(t.startswith("splitlm.cloud") for t in targets), (name, targets)
        if not name.startswith(("splitlm.cli", "splitlm.demo", "splitlm.bench", "splitlm.__main__")):
            assert not any(t.startswith(("splitlm.cli", "splitlm.demo", "splitlm.bench")) for t in targets), (
                name,
                targets,
            )
