"""The shape the code keeps (docs/development.md): small files, classes a reader can hold, the family
known only to `model/`. ruff checks the rest (private names, complexity)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "splitlm"
MAX_FILE_LINES = 450
MAX_CLASS_LINES = 250
MAX_PARAMETERS = 8


def sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_no_file_is_over_450_lines():
    long = {str(p.relative_to(SRC)): n for p in sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_class_is_over_250_lines():
    big = {}
    for p in sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big[f"{p.relative_to(SRC)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not big, f"classes over {MAX_CLASS_LINES} lines: {big}"


def parameter_count(args: ast.arguments) -> int:
    """A function's parameters, *args and **kwargs included, less a method's `self` or `cls`."""
    named = [*args.posonlyargs, *args.args]
    count = len(named) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)
    return count - (bool(named) and named[0].arg in ("self", "cls"))


def long_signatures(tree: ast.AST) -> dict[str, int]:
    """Functions (methods, nested functions and lambdas too) that take more than 8 parameters:
    `line:name` -> how many."""
    return {
        f"{node.lineno}:{getattr(node, 'name', '<lambda>')}": n
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        and (n := parameter_count(node.args)) > MAX_PARAMETERS
    }


def test_no_function_takes_more_than_8_parameters():
    """A long signature wants a request or settings object (a dataclass: its generated constructor is
    not in the source, so it is not counted)."""
    long = {
        f"{p.relative_to(SRC)}:{at}": n
        for p in sources()
        for at, n in long_signatures(ast.parse(p.read_text())).items()
    }
    assert not long, f"functions taking more than {MAX_PARAMETERS} parameters: {long}"


FAMILY_WORDS = ("gemma", "llama", "qwen", "mistral", "model_type")


def family_questions(tree: ast.AST) -> list[str]:
    """Names, attributes and compared strings that ask which family a model is (comments and
    docstrings may name families)."""
    found = []
    for node in ast.walk(tree):
        words = []
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, ast.Compare):
            words = [
                c.value
                for c in [node.left, *node.comparators]
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            ]
        found += [w for w in words if any(f in w.lower() for f in FAMILY_WORDS)]
    return found


def test_only_model_knows_the_family():
    """Outside `model/` code reads a config's traits, never which family it is (the CLI's list of
    bundled models may name them)."""
    asking = {}
    for p in sources():
        rel = p.relative_to(SRC)
        if rel.parts[0] not in ("model", "cli") and (found := family_questions(ast.parse(p.read_text()))):
            asking[str(rel)] = found
    assert not asking, asking


def test_the_shape_checks_can_fail():
    """Each check sees what it looks for (a guard against an AST walk that finds nothing)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES + 1))
    node = ast.parse(f"class Long:\n{body}\n").body[0]
    assert node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    asks = "scale = 2.0 if cfg.gemma else 1.0\nif cfg.model_type == 'qwen2': pass\n"
    assert sorted(family_questions(ast.parse(asks))) == ["gemma", "model_type", "qwen2"]
    assert family_questions(ast.parse('"""Gemma 3 has a scaled embedding."""\nx = cfg.embed_scale\n')) == []
    nine = "def f(a, b, c, d, e, f, g, h, i): pass\n"
    eight = "class C:\n    def m(self, a, b, c, d, e, f, *args, **kwargs): pass\n"
    assert long_signatures(ast.parse(nine)) == {"1:f": 9} and long_signatures(ast.parse(eight)) == {}
    assert long_signatures(ast.parse("def g(a, /, b, *c, d, e=1, f, g, h, **i): pass\n")) == {"1:g": 9}
