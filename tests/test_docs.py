"""The documentation describes this repository and only it.

- No source, doc, config or script refers to design or background notes that live outside the
  repository: a root-level design file, ``research`` notes or a ``shared`` folder beside the
  checkout. The design contracts are docs/design.md; derivations live in docs/.
- Every repository path written in backticks in docs/design.md's "Where things are" exists.
- Every relative link in docs/*.md and README.md resolves to a file or folder.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED_SUFFIXES = {".py", ".md", ".toml", ".sh", ".proto"}
# Build outputs, caches and environments: not part of the repository's text.
SKIPPED_DIRS = {
    ".git",
    ".venv",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    ".benchmarks",
    "build",
    "dist",
    "out",
}
# Written with character classes so that this file does not match its own patterns.
OUTSIDE_REFERENCE = re.compile(
    r"\bDESIGN[.]md\b"  # a design file at the root (the contracts are docs/design.md)
    r"|\bresearch[/]"  # background notes
    r"|[.][.][/]shared\b|\bshared[/]research\b"  # a folder beside the checkout
)
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
FENCED_BLOCK = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def _repository_text_files() -> list[pathlib.Path]:
    files = []
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in parts[:-1]):
            continue
        if path.suffix in SCANNED_SUFFIXES and path.is_file():
            files.append(path)
    return sorted(files)


def _section(text: str, title: str) -> str:
    """The body of the ``## …title`` section of a Markdown text (up to the next ``## ``)."""
    match = re.search(rf"^## [^\n]*{re.escape(title)}[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"no section titled {title!r}"
    return match.group(1)


def test_no_file_refers_outside_the_repository():
    files = _repository_text_files()
    assert len(files) > 100  # the walk sees the package, the tests, the docs and the configs
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if OUTSIDE_REFERENCE.search(line)
    ]
    assert not hits, "references outside the repository:\n" + "\n".join(hits)


def test_where_things_are_names_existing_paths():
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    section = _section(design, "Where things are")
    spans = re.findall(r"`([^`\s]+)`", section)
    paths = [span for span in spans if "/" in span]
    assert len(paths) >= 40, f"the section lists only {len(paths)} paths"
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert not missing, f"docs/design.md, Where things are: missing {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    prose = INLINE_CODE.sub("", FENCED_BLOCK.sub("", doc.read_text(encoding="utf-8")))
    targets = [target for target in LINK.findall(prose) if not re.match(r"[a-z]+:|#", target)]
    broken = [t for t in targets if not (doc.parent / t.split("#", 1)[0]).exists()]
    assert not broken, f"{doc.relative_to(ROOT)}: links to missing files {broken}"
