"""The build hook's list rewriting: GitHub-style lists become what Python-Markdown nests the same way."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "docs"))
from github_lists import python_markdown_lists  # noqa: E402  (tools/docs is not a package)


def test_a_list_under_a_paragraph_gets_a_blank_line_and_nested_items_four_spaces():
    assert python_markdown_lists("Text:\n- a\n  - b\n    more b\n- c") == "Text:\n\n- a\n    - b\n    more b\n- c"


def test_a_paragraph_inside_an_item_is_indented_to_its_item_and_a_list_after_it_is_set_apart():
    assert python_markdown_lists("- a\n  - b\n\n  Of a\n- c") == "- a\n    - b\n\n    Of a\n\n- c"


def test_a_fence_in_an_item_moves_with_it_and_ends_at_a_blank_line():
    assert python_markdown_lists("- item\n  ```bash\n  code\n  ```\n- next") == \
        "- item\n\n    ```bash\n    code\n    ```\n\n- next"


def test_what_is_not_a_list_is_unchanged():
    text = "Para\n\n    indented code\n\n| a | b |\n| --- | --- |\n\n```text\n  - not an item\n```"
    assert python_markdown_lists(text) == text
