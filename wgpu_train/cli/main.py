"""The wgpu-train command line: argparse subcommands; user errors print one line and exit 2."""
from __future__ import annotations

import argparse
import json
import sys

from wgpu_train import __version__
from wgpu_train.errors import WgpuTrainError


def cmd_devices(args) -> int:
    from wgpu_train.engines import resources

    found = resources.devices()
    if not found:
        print("no WebGPU adapter found; install a Vulkan driver (Debian: mesa-vulkan-drivers) "
              "or run with --backend numpy")
        return 0
    chosen = resources.choose_adapter(args.device)
    for a in found:
        mark = "*" if a.index == chosen.index else " "
        print(f"{mark} {a.describe()}: {a.details()}")
        out, total = resources.kernels_left_out(a)
        if out:
            shaders = ", ".join(sorted({k.shader for k in out}))
            print(f"    {len(out)} of {total} tuned kernels ({shaders}) need a limit or feature beyond it; the tuner "
                  f"runs their twins within it")
    print(f"chosen: [{chosen.index}] (select with --device or WGPU_TRAIN_DEVICE: an index or part of a name/backend)")
    return 0


def cmd_bench(args) -> int:
    from wgpu_train.engines.resources import get_runtime
    from wgpu_train.bench.suite import check_model, check_only, format_table, run_bench

    check_only(args.only)
    check_model(args.only, args.model)
    result = run_bench(get_runtime(args.device), only=args.only, model=args.model)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def cmd_tune(args) -> int:
    import logging

    from wgpu_train.adapters.config import LoraConfig
    from wgpu_train.models.config import ModelConfig
    from wgpu_train.errors import ConfigError
    from wgpu_train.engines.resources import get_runtime
    from wgpu_train.bench.pretune import format_rows, pretune, tune_cache
    from wgpu_train.training.config import default_model_dir

    if args.batch_size < 1 or args.max_seq_len < 1 or args.lora_rank < 1:
        raise ConfigError("--batch-size, --max-seq-len and --lora-rank must be at least 1")
    model_dir = args.model or default_model_dir()
    cfg = ModelConfig.from_folder(model_dir)
    seq = min(args.max_seq_len, cfg.max_position_embeddings)
    lora = LoraConfig(r=args.lora_rank, alpha=2 * args.lora_rank, target_modules=args.lora_targets)
    rt = get_runtime(args.device)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"tuning the GEMMs of a LoRA step of {model_dir} at {args.batch_size} x {seq} tokens on "
          f"{rt.info.describe()} (mode {args.mode}); each new shape is timed once and cached", file=sys.stderr)
    rows = pretune(rt, cfg, lora, args.batch_size, seq, args.mode)
    cache = tune_cache(rt)
    if args.json:
        print(json.dumps({"adapter": rt.info.describe(), "cache": str(cache.path), "fma_peak_gflops": cache.peak_gflops,
                          "shapes": rows}, indent=2))
    else:
        print(format_rows(rows, cache.peak_gflops))
        print(f"cache: {cache.path}")
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
    p.add_argument("--model", default=None, metavar="DIR",
                   help="Hugging Face model folder or hub id of the preference benchmark (default: the embedded "
                        "model)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("tune", help="time the GEMM kernels of a model's LoRA training step on this adapter and "
                                    "cache the fastest per shape (runs also tune on first use; this does it ahead)")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="Hugging Face model folder: only its config.json is read (default: the embedded model)")
    p.add_argument("--batch-size", type=int, default=4, help="rows per micro-batch (default: 4)")
    p.add_argument("--max-seq-len", type=int, default=512, help="tokens per row (default: 512)")
    p.add_argument("--lora-rank", type=int, default=8, help="(default: 8)")
    p.add_argument("--lora-targets", default="all-linear", help="(default: all-linear)")
    p.add_argument("--mode", default="full", choices=("fast", "full"),
                   help="full: every candidate; fast: the likeliest few (default: full)")
    p.add_argument("--device", default=None, help="adapter index or part of its name/backend")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_tune)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Subcommands defined next to the code they drive (training, generation, evaluation, merge)."""
    try:
        from wgpu_train.cli import chat, serve
        from wgpu_train.cli.commands import REGISTER
    except ImportError:
        return []
    return REGISTER + [chat.register, serve.register]


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        from wgpu_train.engines.resources import check_tune_mode
        check_tune_mode()       # a bad WGPU_TRAIN_TUNE is refused before any work
        return int(args.func(args) or 0)
    except WgpuTrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

