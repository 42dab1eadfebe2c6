"""Every design reference in the repository cites a section of docs/design.md that exists,
and none points outside the repository (docs/design.md §1)."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN = os.path.join(ROOT, "docs", "design.md")
SKIP_DIRS = {".git", ".venv", "__pycache__", "build", "dist", "node_modules"}
REF = re.compile(r"docs/design\.md`?\s*§\s*(\d+)")
# the brief the project answers lives outside the repository: a clone cannot open it
STALE = re.compile(r"DESIGN(?:\.md)?`?\s*§|shared/DESIGN|\.\./shared/")


def design_sections(path: str = DESIGN) -> set[int]:
    """The numbers of docs/design.md's `## N. Title` sections."""
    with open(path, encoding="utf-8") as fh:
        return {int(m.group(1)) for m in re.finditer(r"^## (\d+)\. \S", fh.read(), re.M)}


def _text_files(root: str):
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.endswith(".egg-info")]
        for f in files:
            if f.endswith((".py", ".md", ".toml", ".sh", ".qss", ".txt")):
                yield os.path.join(d, f)


def bad_references(root: str, sections: set[int]) -> list[str]:
    """`file:line: why` for each reference to a missing section or to a design outside the repo."""
    bad = []
    for path in _text_files(root):
        if os.path.abspath(path) == os.path.abspath(__file__):
            continue  # its own examples of bad references
        with open(path, encoding="utf-8", errors="replace") as fh:
            for no, line in enumerate(fh, 1):
                where = f"{os.path.relpath(path, root)}:{no}"
                bad += [f"{where}: no section §{n} in docs/design.md"
                        for n in map(int, REF.findall(line)) if n not in sections]
                if STALE.search(line):
                    bad.append(f"{where}: cites a design outside the repository: {line.strip()[:80]}")
    return bad


def test_the_design_is_in_the_repository_with_numbered_sections():
    sections = design_sections()
    assert sections == set(range(1, max(sections) + 1)), sorted(sections)
    assert len(sections) >= 10


def test_every_design_reference_names_an_existing_section():
    bad = bad_references(ROOT, design_sections())
    assert not bad, "\n".join(bad)


def test_code_cites_the_design():
    # the references are the point: a clone can follow a comment to the section that explains it
    cited = sum(len(REF.findall(open(p, encoding="utf-8", errors="replace").read()))
                for p in _text_files(ROOT) if not p.endswith("design.md"))
    assert cited >= 20


def test_the_checker_catches_a_missing_section_and_an_outside_reference(tmp_path):
    (tmp_path / "ok.py").write_text('"""Pages (docs/design.md §3)."""\n')
    assert bad_references(str(tmp_path), {1, 2, 3}) == []
    (tmp_path / "bad.py").write_text('"""See docs/design.md §31.\n(DESIGN §4)\nsee ../shared/DESIGN.md"""\n')
    bad = bad_references(str(tmp_path), {1, 2, 3})
    assert any("§31" in b for b in bad) and sum("outside" in b for b in bad) == 2
