"""The README is the landing page: short, with the two quickstart commands CI relies on, and links that resolve."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
QUICKSTART = ('pip install . && wgpu-train finetune                              # the main job\n'
              'pip install -e ".[test]" && python -m pytest -q                   # the tests\n')


def test_readme_is_a_landing_page_of_at_most_200_lines():
    assert len(README.splitlines()) <= 200, "move the new section into a page under docs/ and link it"


def test_the_two_quickstart_commands_are_unchanged_and_ci_runs_the_test_command():
    assert f"```bash\n{QUICKSTART}```" in README
    assert "python -m pytest -q" in (REPO / ".ci" / "run").read_text(encoding="utf-8")


def test_every_relative_link_of_the_readme_resolves():
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", README) if "://" not in t]
    assert targets, "the README links into the docs"
    missing = [t for t in targets if not (REPO / t.split("#")[0]).exists()]
    assert missing == []
