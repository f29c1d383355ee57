"""The generated CLI reference lists exactly the options of the argparse parsers, with their defaults and help."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

from wgpu_train.cli.main import build_parser

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "docs"))
import cli_reference  # noqa: E402  (tools/docs is not a package)

ROW = re.compile(r"^\| `(?P<label>[^`]*)` \| `(?P<default>[^`]*)` \| (?P<help>.*) \|$")


def parser_options(parser: argparse.ArgumentParser) -> dict[str, dict[str, argparse.Action]]:
    """Command -> option string -> action, read from argparse itself (not from the generator)."""
    commands = {"wgpu-train": parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands.update({f"wgpu-train {name}": sub for name, sub in action.choices.items()})
    return {command: {s: a for a in p._actions for s in a.option_strings if s not in ("-h", "--help")}
            for command, p in commands.items()}


def page_options(markdown: str) -> dict[str, dict[str, tuple[str, str]]]:
    """Command -> option string -> (default cell, help cell), read from the generated page."""
    found: dict[str, dict[str, tuple[str, str]]] = {}
    command = None
    for line in markdown.splitlines():
        heading = re.match(r"^## `(wgpu-train.*)`$", line)
        if heading:
            command = heading.group(1)
            found[command] = {}
        row = ROW.match(line)
        if row and command:
            for name in row.group("label").replace(",", " ").split():
                if name.startswith("-"):
                    found[command][name] = (row.group("default"), row.group("help"))
    return found


def differences(expected: dict, listed: dict) -> list[str]:
    """Commands and options that are in one and not the other."""
    problems = [f"command {c} only in the parser" for c in expected.keys() - listed.keys()]
    problems += [f"command {c} only in the page" for c in listed.keys() - expected.keys()]
    for command in expected.keys() & listed.keys():
        problems += [f"{command} {o}: only in the parser" for o in expected[command].keys() - listed[command].keys()]
        problems += [f"{command} {o}: only in the page" for o in listed[command].keys() - expected[command].keys()]
    return problems


@pytest.fixture(scope="module")
def generated_page() -> str:
    """docs/reference/cli.md as the MkDocs hook makes it: its placeholder replaced by the generated sections."""
    page = (REPO / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    assert cli_reference.PLACEHOLDER in page, "the CLI page lost the placeholder the build hook fills"
    return page.replace(cli_reference.PLACEHOLDER, cli_reference.render())


def test_every_option_of_every_command_is_on_the_page_and_nothing_else(generated_page):
    expected = parser_options(build_parser())
    listed = page_options(generated_page)
    assert {"wgpu-train finetune", "wgpu-train serve", "wgpu-train merge"} <= expected.keys(), sorted(expected)
    assert differences(expected, listed) == []


def test_each_option_shows_its_default_and_help(generated_page):
    parser = build_parser()
    listed = page_options(generated_page)
    for command, options in parser_options(parser).items():
        for name, action in options.items():
            default, help_cell = listed[command][name]
            if action.nargs != 0 and action.default not in (None, argparse.SUPPRESS) and not action.required:
                shown = ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) \
                    else str(action.default)
                assert default == (shown or "-"), (command, name)
            words = re.sub(r"%\([a-z_]+\)s", " ", action.help or "").replace("*", " ").replace("|", " ").split()
            assert all(word in help_cell for word in words if word.isalnum()), (command, name, help_cell)


def test_a_missing_or_extra_option_is_caught(generated_page):
    expected = parser_options(build_parser())
    without_lr = "\n".join(line for line in generated_page.splitlines() if not line.startswith("| `--lr FLOAT`"))
    assert "wgpu-train finetune --lr: only in the parser" in differences(expected, page_options(without_lr))
    extra = generated_page.replace("## `wgpu-train merge`\n", "## `wgpu-train merge`\n\n| `--imaginary` | `-` | x |\n")
    assert "wgpu-train merge --imaginary: only in the page" in differences(expected, page_options(extra))


def test_the_hand_written_command_table_names_only_real_commands_and_options():
    expected = parser_options(build_parser())
    page = (REPO / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    table = page.split("## Commands at a glance", 1)[1].split("\n\n", 2)[1]
    named = {}
    for row in table.splitlines()[2:]:
        usage = row.split("`")[1]
        command = " ".join(usage.split()[:2])
        options = re.findall(r"--(?:\[no-\])?[a-z0-9-]+", usage)
        named.setdefault(command, set()).update(o.replace("[no-]", "") for o in options)
    assert named.keys() == expected.keys() - {"wgpu-train"}
    unknown = {c: sorted(o for o in options if o not in expected[c]) for c, options in named.items()}
    assert {c: o for c, o in unknown.items() if o} == {}
