"""The shape the code keeps (docs/development.md): small files, classes a reader can hold, the family
known only to `model/`. ruff checks the rest (private names, complexity)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "splitlm"
MAX_FILE_LINES = 450
MAX_CLASS_LINES = 250


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
