"""The documents tell the truth about the repository: every relative link and anchor in README.md,
docs/ and benchmarks/README.md resolves, the README's two setup commands are the ones CI runs, its
CLI table names exactly the parser's commands, and the README stays a five-minute read.

The figures the README prints are checked by the tests that reproduce them (tests/test_learning.py
for the main job); these checks are text only, milliseconds.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
LINK = re.compile(r"\]\(([^)\s]+)\)|<img src=\"([^\"]+)\"")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.+)$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The targets of a Markdown file's links and images, outside code blocks."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    return [a or b for a, b in LINK.findall(text)]


def test_relative_links_and_anchors_resolve():
    broken = []
    for doc in DOCS:
        for target in links(doc):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_opens_with_the_two_setup_commands_ci_runs():
    text = README.read_text(encoding="utf-8")
    top = text[:text.index("\n## ")]
    commands = re.findall(r"^    (python3 -m venv .+)$", top, re.MULTILINE)
    assert len(commands) == 2, commands
    run_job, run_tests = commands
    assert run_job.endswith("pip install -e . && dapo-flow run graphs/dapo.yaml"), run_job
    install, _, test = run_tests.rpartition(" && ")
    assert test == "python -m pytest", run_tests
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f"bash -c '{install}'" in ci, "CI no longer installs as the README's second command says"
    assert re.search(r"^tier .+ python -m pytest$", ci, re.MULTILINE), "CI no longer runs the README's test command"


def test_readme_cli_table_names_the_parsers_commands():
    from dapo_flow import cli

    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = README.read_text(encoding="utf-8")
    table = text[text.index("\n## CLI\n"):]
    table = table[:table.index("\n## ", 1)]
    named = set(re.findall(r"^\| `dapo-flow ([a-z-]+)", table, re.MULTILINE))
    assert named == set(sub.choices), (sorted(named ^ set(sub.choices)), "README's CLI table vs the parser")


def test_readme_is_a_short_read_and_the_docs_pages_have_contents():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines: move details to docs/"
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        second = [m.start() for m in re.finditer(r"^## ", text, re.MULTILINE)][:1]
        assert second and "Contents" in text[:second[0]], f"{page.name} has no contents list at its top"
