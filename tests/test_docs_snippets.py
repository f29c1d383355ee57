"""Every bash and Python snippet of the docs runs here on the embedded model, or says why it cannot run offline
(the marker convention is in docs/development.md)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
CODE_LANGUAGES = {"bash", "sh", "shell", "console", "python"}
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\S*)\s*$")
# The line above a bash or python block: "<!-- snippet: run -->", "<!-- snippet: run, finetune shortened by: ARGS -->"
# (ARGS added to each `wgpu-train finetune`, for fewer steps) or "<!-- snippet: not runnable offline: REASON -->".
# The runnable blocks of a page run in order in one fresh folder, so a later block sees what an earlier one wrote.
MARKER = re.compile(r"^\s*<!-- snippet: (?P<kind>run|run, finetune shortened by: (?P<args>[^>]*?)|"
                    r"not runnable offline: (?P<reason>[^>]*?)) -->\s*$")


@dataclass
class Snippet:
    page: str
    line: int
    language: str
    code: str
    marker: re.Match | None

    @property
    def runnable(self) -> bool:
        return bool(self.marker) and self.marker.group("kind").startswith("run")


def snippets(page: Path, root: Path = DOCS) -> list[Snippet]:
    """The fenced blocks of a page, each with the marker line just above it (or None)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        indent = len(fence.group("indent"))
        code = "\n".join(line[indent:] for line in lines[i + 1:end])
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        found.append(Snippet(str(page.relative_to(root)), i + 1, fence.group("lang"), code, MARKER.match(previous)))
        i = end + 1
    return found


PAGES = sorted(DOCS.rglob("*.md"))
ALL = [s for page in PAGES for s in snippets(page)]
RUNNABLE_PAGES = sorted({s.page for s in ALL if s.runnable})


def test_every_fence_names_its_language_and_every_code_block_its_marker():
    assert ALL, "no fenced blocks found under docs/"
    problems = [f"{s.page}:{s.line}: a fence without a language (use text for output)" for s in ALL if not s.language]
    problems += [f"{s.page}:{s.line}: {s.language} block without a snippet marker line above it"
                 for s in ALL if s.language in CODE_LANGUAGES and not s.marker]
    problems += [f"{s.page}:{s.line}: not runnable, with no reason" for s in ALL
                 if s.marker and s.marker.group("reason") is not None and not s.marker.group("reason").strip()]
    assert problems == []


def test_the_marker_convention_catches_an_unmarked_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n```bash\nwgpu-train devices\n```\n\n<!-- snippet: not runnable offline: why -->\n"
                    "```python\nprint(1)\n```\n")
    unmarked, marked = snippets(page, tmp_path)
    assert unmarked.marker is None and marked.marker.group("reason") == "why" and not marked.runnable


def shortened(code: str, args: str) -> str:
    """The shell code with `args` appended to each `wgpu-train finetune` command (continuation lines joined)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return "\n".join(re.sub(r"^(\s*wgpu-train finetune\b[^#]*?)(\s*(#.*)?)$", rf"\1 {args}\2", line)
                     for line in joined.splitlines())


def test_shortening_appends_to_finetune_commands_only():
    code = "wgpu-train finetune --objective dpo --out runs/dpo   # demo\nwgpu-train eval --split valid"
    assert shortened(code, "--max-steps 2") == \
        "wgpu-train finetune --objective dpo --out runs/dpo --max-steps 2   # demo\nwgpu-train eval --split valid"


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_runnable_snippets_run(page, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "wgpu-train"     # the command line of this checkout, whatever is installed
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m wgpu_train.cli \"$@\"\n")
    shim.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1"}
    for snippet in (s for s in ALL if s.page == page and s.runnable):
        args = snippet.marker.group("args")
        code = shortened(snippet.code, args) if args else snippet.code
        shell = ["bash", "-euo", "pipefail", "-c", code]
        command = [sys.executable, "-c", code] if snippet.language == "python" else shell
        print(f"{page}:{snippet.line}:\n{code}")
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{page}:{snippet.line} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
