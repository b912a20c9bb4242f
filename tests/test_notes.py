"""Every ``NOTE [name]`` the repository cites is written down in it, where it says, and
``docs/design.md`` indexes every one.

A *definition* is a ``NOTE [name]`` that opens a line of code (``# NOTE [name]``,
``// NOTE [name]``, or a docstring line ``NOTE [name]:``), followed by ``:`` or the end of the
line; a note may be defined in more than one file (elaborated where the code is). Any other
``NOTE [name]`` (and the ``[other]`` names a citation lists after it: ``NOTE [a] / [b]``) is a
*reference*. A reference may say where the note is (``NOTE [name] in graphstash/x.py``): that
file must define it. Names wrap across lines as prose does; line breaks, indentation and
comment markers inside the brackets read as one space.
"""
from __future__ import annotations

import json
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
CODE = (".py", ".cu", ".cuh")
TEXT = CODE + (".md", ".ipynb", ".toml")
SELF = "tests/test_notes.py"      # its text is about notes: left out of the scan

DEFINITION = re.compile(r"^[ \t]*(?:#|//)?[ \t]*NOTE \[([^\]]+)\](?=:|[ \t]*$)", re.MULTILINE)
CITATION = re.compile(r"NOTE\s+(\[[^\]]+\](?:\s*(?:,|/|and|or)\s*\[[^\]]+\])*)"
                      r"(?:\s+in\s+`{0,2}([\w./-]+\.(?:py|cuh|cu|md))`{0,2})?")
BRACKETED = re.compile(r"\[([^\]]+)\]")
WRAP = re.compile(r"\s*\n\s*(?:#|//)?\s*|\s+")


def normalize(name: str) -> str:
    """A note's name as one line: wraps, indentation and comment markers become one space."""
    return WRAP.sub(" ", name).strip()


def repository_files() -> list[Path]:
    """The files git tracks, and those it would track (not ignored), under the repository."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return sorted(ROOT / f for f in set(out.split())
                  if f.endswith(TEXT) and (ROOT / f).is_file() and f != SELF)


def text_of(path: Path) -> str:
    """A file's text; a notebook's cells joined (its JSON escapes would split names)."""
    text = path.read_text()
    if path.suffix == ".ipynb":
        cells = json.loads(text).get("cells", [])
        text = "\n".join("".join(c.get("source", [])) for c in cells)
    return text


def scan(files: list[Path]) -> tuple[dict, list]:
    """``({name: {file, ...}}, [(name, file, named file or None), ...])``: the definitions
    (code files only) and every citation."""
    definitions: dict[str, set[str]] = defaultdict(set)
    citations = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        text = text_of(path)
        if path.suffix in CODE:
            for m in DEFINITION.finditer(text):
                definitions[normalize(m.group(1))].add(rel)
        for m in CITATION.finditer(text):
            for name in BRACKETED.findall(m.group(1)):
                citations.append((normalize(name), rel, m.group(2)))
    return definitions, citations


def index_of(design: str) -> dict[str, set[str]]:
    """The NOTE index of ``docs/design.md``: its table rows ``| [name] | `file`, ... |``."""
    section = design.split("## NOTE index", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\|\s*\[([^\]]+)\]\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`([^`]+)`", m.group(2)))
    return rows


@pytest.fixture(scope="module")
def notes():
    return scan(repository_files())


def test_every_cited_note_is_defined(notes):
    definitions, citations = notes
    missing = sorted({f"NOTE [{name}] cited in {file}" for name, file, _ in citations
                      if name not in definitions})
    assert missing == [], "define these (a `# NOTE [name]:` block or a docstring `NOTE [name]:`)"


def test_a_citation_that_names_a_file_finds_the_note_there(notes):
    definitions, citations = notes
    wrong = sorted({f"{file}: NOTE [{name}] in {where}, defined in {sorted(definitions[name])}"
                    for name, file, where in citations
                    if where and name in definitions
                    and not any(d.endswith(where) for d in definitions[name])})
    assert wrong == []


def test_the_design_index_lists_every_definition(notes):
    definitions, _ = notes
    index = index_of(DESIGN.read_text())
    expected = {name: set(files) for name, files in definitions.items()}
    lines = [f"| [{name}] | {', '.join(f'`{f}`' for f in sorted(files))} |"
             for name, files in sorted(expected.items()) if index.get(name) != files]
    stale = sorted(set(index) - set(expected))
    assert lines == [] and stale == [], (
        "docs/design.md's NOTE index differs from the code; rows it should have:\n"
        + "\n".join(lines) + f"\nrows naming no defined note: {stale}")


def test_the_scan_finds_what_it_should():
    """The rules on a sample: definitions, wrapped and listed citations, a named file."""
    sample = ROOT / "tests" / "test_notes.py"
    text = '''# NOTE [alpha beta]: defined here
x = 1   # NOTE [gamma] cited after code, not defined
    NOTE [delta]:
# see NOTE [alpha
#    beta] / [delta] in tests/test_notes.py
'''
    definitions, citations = defaultdict(set), []
    for m in DEFINITION.finditer(text):
        definitions[normalize(m.group(1))].add(sample.name)
    for m in CITATION.finditer(text):
        for name in BRACKETED.findall(m.group(1)):
            citations.append((normalize(name), m.group(2)))
    assert set(definitions) == {"alpha beta", "delta"}
    assert ("gamma", None) in citations
    assert ("alpha beta", "tests/test_notes.py") in citations
    assert ("delta", "tests/test_notes.py") in citations
