"""The command-line reference, generated from wgpu-train's argparse parsers: every command, option, default and help."""
from __future__ import annotations

import argparse

from wgpu_train.cli.main import build_parser

PLACEHOLDER = "<!-- cli-reference: generated from the argparse parsers at build time -->"


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommand parsers of `parser`, by name, in the order `wgpu-train --help` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def documented_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options and positionals a user can give (not --help, not the subcommand slot)."""
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS]


def option_label(action: argparse.Action) -> str:
    """`--lora-rank R`-style: the option strings, then what the option takes."""
    names = ", ".join(action.option_strings) or action.dest
    if action.nargs == 0:
        return names
    if action.choices is not None:
        return f"{names} {{{','.join(str(c) for c in action.choices)}}}"
    return f"{names} {action.metavar or action.dest.upper()}"


def default_text(action: argparse.Action) -> str:
    """The default as a user would type it; a dash where there is none."""
    if action.required:
        return "required"
    if action.default in (None, argparse.SUPPRESS) or isinstance(action, argparse._VersionAction):
        return "-"
    if action.nargs == 0:
        return "on" if action.default else "off"
    if isinstance(action.default, (list, tuple)):
        return ",".join(str(v) for v in action.default) or "-"
    return str(action.default)


def help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help string with argparse's %(default)s-style fields filled in, as --help prints it."""
    if not action.help:
        return ""
    return parser._get_formatter()._expand_help(action)


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;").split())


def render_command(name: str, parser: argparse.ArgumentParser) -> str:
    """One command's section: description, usage, and a table of its options per argument group."""
    lines = [f"## `{name}`", ""]
    if parser.description:
        lines += [_cell(parser.description), ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a in documented_actions(parser)]
        if not actions:
            continue
        if group.title not in ("options", "optional arguments", "positional arguments"):
            lines += [f"**{group.title}**", ""]
        lines += ["| option | default | help |", "| --- | --- | --- |"]
        lines += [f"| `{option_label(a)}` | `{_cell(default_text(a))}` | {_cell(help_text(parser, a))} |"
                  for a in actions]
        lines.append("")
    return "\n".join(lines)


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole reference: the top-level program, then each subcommand."""
    parser = parser or build_parser()
    sections = [render_command("wgpu-train", parser)]
    sections += [render_command(f"wgpu-train {name}", sub) for name, sub in subcommands(parser).items()]
    return "\n".join(sections)
