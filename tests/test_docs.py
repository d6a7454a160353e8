"""The documentation describes this repository and only it.

- No source, doc, config or script refers to design or background notes that live outside the
  repository: a root-level design file, ``research`` notes or a ``shared`` folder beside the
  checkout. The design contracts are docs/design.md; derivations live in docs/.
- Every repository path written in backticks in docs/design.md's "Where things are" exists.
- Every relative link in docs/*.md and README.md resolves to a file or folder.
- The README is short (at most 250 lines) and opens with the two set-up commands.
- No user doc cites a commit: numbers carry the command that reproduces them, not a hash.
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
README_MAX_LINES = 250
SETUP_COMMANDS = [
    "pip install -e . && prfaas demo",
    'pip install -e ".[test]" && python -m pytest -q',
]
# A commit cited as a marker ("at 1a2b3c4", "before …"), and any bare abbreviated or full hash:
# a word of 7 to 40 hex digits holding both a digit and a letter.
COMMIT_MARKER = re.compile(r"\b(at|before|since|against) [0-9a-f]{7,40}\b")
# Seven to 40 hex digits with a letter and a digit, not part of a number (2.701056e+06).
BARE_HASH = re.compile(
    r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w+-]|\.\d)"
)


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


def test_readme_is_short_and_opens_with_the_setup_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    first = re.search(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    assert first, "the README has no fenced block"
    assert first.group(1).splitlines() == SETUP_COMMANDS
    before = text[: first.start()].strip().splitlines()
    assert len(before) == 1 and before[0].startswith("# "), "the set-up block follows the title"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_cites_a_commit(doc):
    lines = doc.read_text(encoding="utf-8").splitlines()
    hits = [
        f"{number}: {line.strip()}"
        for number, line in enumerate(lines, start=1)
        if COMMIT_MARKER.search(line) or BARE_HASH.search(line)
    ]
    assert not hits, f"{doc.relative_to(ROOT)} cites commits:\n" + "\n".join(hits)
