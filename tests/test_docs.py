"""The facts the code relies on live in this repository's docs/: every `docs/X.md §N` a docstring,
recipe or README cites exists there, and nothing points at notes outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [*sorted((ROOT / "specheads").rglob("*.py")), *sorted((ROOT / "recipes").rglob("*.yaml")),
           *sorted((ROOT / "bench").glob("*.py")), ROOT / "README.md"]
CITE = re.compile(r"docs/([a-z_]+\.md)(?: §(\d+)(?:\.(\d+))?(?:-(\d+)\.(\d+))?)?")


def sections(doc: Path) -> set[str]:
    """'N' for each `## N.` heading, 'N.M' for each `### N.M` heading or item `M.` under `## N.`."""
    found, current = set(), None
    for line in doc.read_text().splitlines():
        if m := re.match(r"##\s+(\d+)\.", line):
            current = m.group(1)
            found.add(current)
        elif m := re.match(r"###\s+(\d+)\.(\d+)", line):
            found.add(f"{m.group(1)}.{m.group(2)}")
        elif current and (m := re.match(r"(\d+)\. ", line)):
            found.add(f"{current}.{m.group(1)}")
    return found


def citations() -> list[tuple[str, str, str | None]]:
    """(source file, doc name, section or None) for every citation."""
    out = []
    for path in SOURCES:
        for m in CITE.finditer(path.read_text()):
            doc, major, minor, major2, minor2 = m.groups()
            where = str(path.relative_to(ROOT))
            if major is None:
                out.append((where, doc, None))
                continue
            out.append((where, doc, f"{major}.{minor}" if minor else major))
            if major2:
                out.append((where, doc, f"{major2}.{minor2}"))
    return out


def test_every_cited_docs_section_exists():
    cites = citations()
    assert len(cites) > 40  # the code does cite its docs
    missing = []
    for where, doc, section in cites:
        path = ROOT / "docs" / doc
        if not path.is_file():
            missing.append(f"{where}: docs/{doc} does not exist")
        elif section is not None and section not in sections(path):
            missing.append(f"{where}: docs/{doc} has no section {section}")
    assert not missing, "\n".join(missing)


def test_nothing_points_outside_the_repository():
    outside = [f"{p.relative_to(ROOT)}:{i}" for p in SOURCES
               for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bresearch/|research notes", line)]
    assert not outside, f"references to notes a user of the repository does not have: {outside}"
