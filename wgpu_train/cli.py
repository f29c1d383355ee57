"""The wgpu-train command line: argparse subcommands; user errors print one line and exit 2."""
from __future__ import annotations

import argparse
import json
import sys

from . import __version__
from .errors import WgpuTrainError


def cmd_devices(args) -> int:
    from .gpu import runtime

    found = runtime.devices()
    if not found:
        print("no WebGPU adapter found; install a Vulkan driver (Debian: mesa-vulkan-drivers) "
              "or run with --backend numpy")
        return 0
    chosen = runtime.choose_adapter(args.device)
    for a in found:
        mark = "*" if a.index == chosen.index else " "
        print(f"{mark} {a.describe()}: {a.details()}")
    print(f"chosen: [{chosen.index}] (select with --device or WGPU_TRAIN_DEVICE: an index or part of a name/backend)")
    return 0


def cmd_bench(args) -> int:
    from .gpu import runtime
    from .gpu.bench import check_only, format_table, run_bench

    check_only(args.only)
    result = run_bench(runtime.get_runtime(args.device), only=args.only)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


class OneLineParser(argparse.ArgumentParser):
    """A parser whose usage errors are one line and exit 2 (unknown arguments included); the
    subcommand parsers inherit it."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="wgpu-train",
                           description="LoRA fine-tuning of Llama-family language models on any GPU through WebGPU.")
    parser.add_argument("--version", action="version", version=f"wgpu-train {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("devices", help="list the WebGPU adapters and say which one would be chosen")
    p.add_argument("--device", default=None, help="adapter index or part of its name/backend")
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("bench", help="kernel and training benchmarks, as ratios to references measured in the same run")
    p.add_argument("--device", default=None, help="adapter index or part of its name/backend")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--only", default=None, help="run only the benchmarks whose name starts with this")
    p.set_defaults(func=cmd_bench)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Subcommands defined next to the code they drive (training, generation, evaluation, merge)."""
    try:
        from .commands import REGISTER
    except ImportError:
        return []
    return REGISTER


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except WgpuTrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
