"""GitHub-style lists (nested by 2 spaces, a list right under a paragraph) rewritten as Python-Markdown reads them."""
from __future__ import annotations

import re

ITEM = re.compile(r"^(?P<indent> *)(?P<marker>[-*] |\d+\. )")
FENCE = re.compile(r"^ *```")


def python_markdown_lists(markdown: str) -> str:
    """Each nesting level of a list, and the blocks inside its items, indented by 4 spaces; a blank line before a
    list that follows a paragraph. What is not in a list is left as it is."""
    out: list[str] = []
    columns: list[int] = []         # where the text of each open item starts (GitHub's rule), outermost first
    fence_shift = None              # inside a fenced block: the spaces added to each of its lines
    after_blank = False             # the previous line was blank
    loose_paragraph = False         # the current paragraph began after a blank line
    fence_closed = False            # the previous line closed a fenced block
    for line in markdown.split("\n"):
        if fence_shift is not None:
            out.append(" " * fence_shift + line if line.strip() else line)
            if FENCE.match(line):
                fence_shift, fence_closed = None, True
            continue
        if not line.strip():
            out.append(line)
            after_blank = True
            continue
        if fence_closed and line.strip():   # Python-Markdown ends a block after a fence only at a blank line
            out.append("")
            after_blank = True
        fence_closed = False
        indent = len(line) - len(line.lstrip(" "))
        item = ITEM.match(line)
        if item:
            under_paragraph = out and out[-1].strip() and not ITEM.match(out[-1]) and (loose_paragraph or not columns)
            while columns and indent < columns[-1]:
                columns.pop()
            if under_paragraph:
                out.append("")
            shift = 4 * len(columns) - indent
            columns.append(indent + len(item.group("marker")))
            loose_paragraph = False
        elif after_blank:           # a new block: inside the innermost item its indent reaches, or outside the list
            while columns and indent < columns[-1]:
                columns.pop()
            shift = 4 * len(columns) - indent if columns else 0
            loose_paragraph = True
        elif FENCE.match(line) and columns:   # a fence right under an item's text: a block of that item
            out.append("")
            shift = 4 * len(columns) - indent
        else:                       # a continuation line
            shift = 0
        out.append(" " * shift + line if shift >= 0 else line[-shift:])
        if FENCE.match(line):
            fence_shift = shift
        after_blank = False
    return "\n".join(out)
