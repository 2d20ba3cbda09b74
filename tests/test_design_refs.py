"""Every design reference in ``shardkit/`` names a section of ``docs/design.md`` that exists.

Code points into the design document as ``docs/design.md §N`` (several sections as ``§2, §9``). A
reference to a section that does not exist, a ``§`` that is not part of such a reference, or the old
``DESIGN §N`` spelling (a document that was never in the repository) fails here, naming the file and
line.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
PACKAGE = ROOT / "shardkit"

#: ``## 4. The tiered sampler``: the numbered sections references may name.
HEADING = re.compile(r"^## (\d+)\. \S", re.MULTILINE)
#: ``docs/design.md §2, §9`` (a line break, indentation or ``#`` may separate the parts).
REFERENCE = re.compile(r"docs/design\.md[\s#]*§(\d+)((?:[\s#]*(?:,|and)[\s#]*§\d+)*)")
SECTION = re.compile(r"§(\d+)")
STALE = re.compile(r"\bDESIGN\s*§")


def design_sections(text: str) -> list[int]:
    """The section numbers of the design document, in the order they appear."""
    return [int(n) for n in HEADING.findall(text)]


def reference_problems(name: str, text: str, sections: set[int]) -> list[str]:
    """Every broken design reference in ``text`` (the file ``name``), one message each."""
    problems: list[str] = []
    covered: set[int] = set()

    def line_of(offset: int) -> int:
        return text.count("\n", 0, offset) + 1

    for match in REFERENCE.finditer(text):
        for section in SECTION.finditer(match.group(0)):
            covered.add(match.start() + section.start())
            number = int(section.group(1))
            if number not in sections:
                problems.append(
                    f"{name}:{line_of(match.start())}: docs/design.md has no section {number} "
                    f"(expected one of {sorted(sections)}, found {match.group(0)!r})"
                )
    for stale in STALE.finditer(text):
        covered.add(stale.end() - 1)
        problems.append(f"{name}:{line_of(stale.start())}: {stale.group(0)!r} names no document; write 'docs/design.md §N'")
    for mark in re.finditer("§", text):
        if mark.start() not in covered:
            context = text[max(0, mark.start() - 30) : mark.start() + 5]
            problems.append(f"{name}:{line_of(mark.start())}: a '§' that is not part of a docs/design.md reference: {context!r}")
    return problems


def test_design_document_sections_are_numbered_once() -> None:
    numbers = design_sections(DESIGN.read_text(encoding="utf-8"))
    assert numbers, f"{DESIGN}: expected numbered '## N. Title' sections, found none"
    assert len(numbers) == len(set(numbers)), f"{DESIGN}: a section number is used twice: {numbers}"


def test_every_design_reference_in_the_package_resolves() -> None:
    sections = set(design_sections(DESIGN.read_text(encoding="utf-8")))
    problems: list[str] = []
    references = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        references += len(REFERENCE.findall(text))
        problems += reference_problems(str(path.relative_to(ROOT)), text, sections)
    assert not problems, "broken design references:\n" + "\n".join(problems)
    assert references > 0, "expected design references in shardkit/, found none (is the pattern still right?)"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("see docs/design.md §4.", []),
        ("(docs/design.md §2, §9)", []),
        ("see\n    docs/design.md §4 for", []),
        ("# see docs/design.md\n# §10 and §12", []),
        ("see docs/design.md §99", ["no section 99"]),
        ("(docs/design.md §2, §77)", ["no section 77"]),
        ("the algorithm (DESIGN §4)", ["names no document"]),
        ("see §4 of the notes", ["not part of a docs/design.md reference"]),
    ],
)
def test_reference_checker(text: str, expected: list[str]) -> None:
    problems = reference_problems("x.py", text, {2, 4, 9, 10, 12})
    assert len(problems) == len(expected), problems
    for problem, fragment in zip(problems, expected):
        assert fragment in problem


def test_readme_links_the_design_document() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/design.md" in readme, "README.md: expected a link to docs/design.md among its docs links, found none"
