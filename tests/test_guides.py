"""The README is one page that sends a newcomer to one guide per task (docs/*.md), and every
shell command in the README and the guides runs as written.

Each ```bash or ```sh block is run as one bash script, `prefixlab` meaning this checkout's
`python -m app.cli`, from a folder that looks like the repository root (its top-level entries
linked), so what a block writes lands in a temporary folder and `~` is a temporary home. A
block that needs a window, a server kept running, the network or minutes of compute says so
in the line before it, `<!-- not run: why -->`, and is reported as skipped with that reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
# the tasks the README's table must send a newcomer to, one guide each
TASK_GUIDES = {"desktop.md", "serve-and-proxy.md", "replay-and-clusters.md", "twin.md", "watch.md",
               "advisor.md", "bench.md"}
README_MAX_LINES = 200
BLOCK_TIMEOUT_S = 120

SHELLS = ("bash", "sh")
FENCE = re.compile(r"^```(\S*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
PRELUDE = """set -eo pipefail
prefixlab() { "$PREFIXLAB_PYTHON" -m app.cli "$@"; }
python() { "$PREFIXLAB_PYTHON" "$@"; }
"""


@dataclass(frozen=True)
class Block:
    where: str          # file:line of the opening fence, relative to the repository
    script: str
    not_run: str | None  # why it is not run, or None


def markdown_files() -> list[str]:
    return [README] + sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))


def shell_blocks(text: str, name: str) -> tuple[list[Block], list[str]]:
    """The ```bash/```sh blocks of one markdown text, and `name:line: why` for each misplaced
    `not run` marker (one not on the line right before such a block)."""
    blocks, problems, markers, fence, body = [], [], {}, None, []
    for no, line in enumerate(text.split("\n"), 1):
        if fence is not None:
            if line.rstrip() == "```":
                lang, start, why = fence
                if lang in SHELLS:
                    blocks.append(Block(f"{name}:{start}", "\n".join(body) + "\n", why))
                fence = None
            else:
                body.append(line)
        elif m := FENCE.match(line):
            why = markers.pop(no - 1, None)
            if why is not None and m.group(1) not in SHELLS:
                problems.append(f"{name}:{no - 1}: a `not run` marker before a ```{m.group(1)} block")
            fence, body = (m.group(1), no, why), []
        elif m := NOT_RUN.match(line.strip()):
            markers[no] = m.group(1)
    problems += [f"{name}:{no}: a `not run` marker not right before a block" for no in sorted(markers)]
    if fence is not None:
        problems.append(f"{name}:{fence[1]}: a code block that never closes")
    return blocks, problems


def all_blocks() -> list[Block]:
    found = []
    for path in markdown_files():
        with open(path, encoding="utf-8") as fh:
            found += shell_blocks(fh.read(), os.path.relpath(path, ROOT))[0]
    return found


def outside_fences(text: str) -> list[str]:
    out, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def prose(text: str) -> str:
    """The text outside fenced blocks and inline code (links there are code, not links)."""
    return "\n".join(re.sub(r"`[^`]*`", "", line) for line in outside_fences(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as fh:
        return {slug(m.group(1)) for m in map(HEADING.match, outside_fences(fh.read())) if m}


def broken_links(path: str) -> list[str]:
    """`file: target: why` for each relative link or picture of a markdown file that leads nowhere."""
    with open(path, encoding="utf-8") as fh:
        text = prose(fh.read())
    bad, here = [], os.path.relpath(path, ROOT)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:: not ours to check
        file, _, fragment = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            bad.append(f"{here}: {target}: no such file")
        elif fragment and dest.endswith(".md") and fragment not in anchors(dest):
            bad.append(f"{here}: {target}: no heading with that anchor")
    return bad


# --- the README and the links ------------------------------------------------------------------

def test_the_readme_is_one_page_with_the_two_commands_three_pictures_and_a_guide_per_task():
    with open(README, encoding="utf-8") as fh:
        text = fh.read()
    assert len(text.split("\n")) <= README_MAX_LINES, "the README grew past one page: move it to a guide"
    for command in ("bash tools/run.sh", "bash tools/test.sh"):
        assert command in text
        assert os.path.exists(os.path.join(ROOT, command.split()[1]))
    pictures = IMAGE.findall(prose(text))
    assert len(pictures) == 3, pictures
    assert all(p.startswith("docs/") and p.endswith(".png") for p in pictures), pictures
    assert "What a first start shows" in text
    linked = {os.path.basename(t) for t in LINK.findall(prose(text))
              if t.startswith("docs/") and t.endswith(".md")}
    assert TASK_GUIDES <= linked, f"the README's table lacks {sorted(TASK_GUIDES - linked)}"


def test_every_link_and_picture_in_the_readme_and_the_guides_leads_somewhere():
    bad = [b for path in markdown_files() for b in broken_links(path)]
    assert not bad, "\n".join(bad)


def test_every_not_run_marker_stands_right_before_a_shell_block():
    problems = []
    for path in markdown_files():
        with open(path, encoding="utf-8") as fh:
            problems += shell_blocks(fh.read(), os.path.relpath(path, ROOT))[1]
    assert not problems, "\n".join(problems)


def test_the_checkers_catch_dead_links_and_stray_markers_and_keep_a_marked_block(tmp_path):
    text = "\n".join([
        "# Guide", "", "## Two tiers: `disk`", "",
        "[ok](#two-tiers-disk) [gone](missing.md) [bad](#nope)", "",
        "<!-- not run: starts a server -->", "```bash", "prefixlab serve", "```", "",   # 7-10
        "```sh", "prefixlab models", "```", "",                                       # 12-14
        "<!-- not run: output -->", "```text", "prefixlab not a command", "```", "",   # 16-19
        "<!-- not run: nothing follows -->", "", "prose", ""])                        # 21
    blocks, problems = shell_blocks(text, "g.md")
    assert [(b.where, b.not_run) for b in blocks] == [("g.md:8", "starts a server"), ("g.md:12", None)]
    assert blocks[1].script == "prefixlab models\n"
    assert problems == ["g.md:16: a `not run` marker before a ```text block",
                        "g.md:21: a `not run` marker not right before a block"]
    (tmp_path / "g.md").write_text(text)
    bad = broken_links(str(tmp_path / "g.md"))
    assert len(bad) == 2 and any("missing.md" in b for b in bad) and any("#nope" in b for b in bad)


# --- the commands ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def repo_root_copy(tmp_path_factory):
    """A folder whose top-level entries link to the repository's: relative paths in a guide work,
    and what a command writes (advice.json, out.html) stays out of the checkout."""
    root = tmp_path_factory.mktemp("repo-root")
    for entry in os.listdir(ROOT):
        if entry != ".git":
            os.symlink(os.path.join(ROOT, entry), root / entry)
    return root


@pytest.mark.model
@pytest.mark.parametrize("block", all_blocks(), ids=lambda b: b.where)
def test_every_shell_command_in_the_guides_runs_as_written(block, repo_root_copy, tmp_path, real_model):
    # real_model: the weight image is built once, in the tests' own cache, before any block loads it
    if block.not_run:
        pytest.skip(f"{block.where}: not run: {block.not_run}")
    env = dict(os.environ, PREFIXLAB_PYTHON=sys.executable, PYTHONPATH=ROOT, HOME=str(tmp_path),
               QT_QPA_PLATFORM="offscreen")
    proc = subprocess.run(["bash", "-c", PRELUDE + block.script], cwd=repo_root_copy, env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, (f"{block.where} failed (exit {proc.returncode}):\n{block.script}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
