"""MkDocs hooks: pages generated at build time from their one source (ARCHITECTURE.md, benchmarks/README.md, CLI)."""
from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cli_reference  # noqa: E402  (the path above makes it importable)
from github_lists import python_markdown_lists  # noqa: E402

# docs page -> (repository file it is made from, the page's title)
INCLUDED = {
    "architecture.md": ("ARCHITECTURE.md", "Architecture"),
    "benchmarks/log.md": ("benchmarks/README.md", "Benchmark log: kernel variants and measurements"),
}

# pictures placed under an included page's title
PICTURES = {"architecture.md": "\n![The layers of wgpu_train](images/architecture.svg)\n\n"
                               "*Drawn by `python tools/docs/figures.py --only architecture`.*\n"}


def included_markdown(page: str) -> str:
    """The repository file behind `page`, its first heading replaced by the page's title."""
    source, title = INCLUDED[page]
    text = (REPO / source).read_text(encoding="utf-8")
    first, _, rest = text.partition("\n")
    note = f"*This page is `{source}` of the repository, included when the site is built.*\n"
    picture = PICTURES.get(page, "")
    return f"# {title}\n\n{note}{picture}{rest if first.startswith('# ') else text}"


def on_files(files, config):
    for page in INCLUDED:
        files.append(File.generated(config, page, content=included_markdown(page)))
    return files


def on_page_markdown(markdown, page, config, files):
    markdown = python_markdown_lists(markdown)      # the pages are written, and included, as GitHub renders them
    if cli_reference.PLACEHOLDER in markdown:
        return markdown.replace(cli_reference.PLACEHOLDER, cli_reference.render())
    return markdown
