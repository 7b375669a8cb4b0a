"""The README stays short and every relative link in it and in docs/ resolves (files and #anchors)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(path: Path) -> str:
    """The page without fenced code blocks (a `[x](y)` in code is not a link)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", prose(path), flags=re.M)}


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path)) if not re.match(r"[a-z]+:", t)]


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 15 * 1024
    first_block = re.search(r"```sh\n(.*?)```", text, flags=re.S).group(1)
    assert [line.split()[:2] for line in first_block.strip().splitlines()] == [["make", "demo"], ["make", "test"]]
    assert text.index("make demo") < text.index("\n## ")


def test_docs_index_lists_every_page():
    listed = set(links(ROOT / "docs" / "index.md"))
    missing = [p.name for p in PAGES[1:] if p.name != "index.md" and p.name not in listed]
    assert not missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page: Path):
    broken = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def readme_commands() -> list[list[str]]:
    """Every `splitlm ...` command line of the README's shell blocks (continuations joined, comments and
    a leading `echo ... |` dropped)."""
    import shlex

    commands = []
    for block in re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].split("|")[-1].strip()
            if line.startswith("splitlm "):
                commands.append(shlex.split(line)[1:])
    return commands


def test_readme_commands_parse_as_written():
    from splitlm.cli import build_parser

    commands = readme_commands()
    assert {c[0] for c in commands} >= {"split", "serve-cloud", "generate", "chat", "serve-edge"}
    for argv in commands:
        build_parser().parse_args(argv)  # an unknown flag or a bad value exits here


def test_readme_openai_example_asks_for_the_model_it_serves():
    text = (ROOT / "README.md").read_text()
    served = [c[c.index("--model-name") + 1] for c in readme_commands() if c[0] == "serve-edge"]
    asked = set(re.findall(r'"model": "([^"]+)"', text))
    assert served and asked == set(served)
