"""Options and argument types that several subcommands share: the model and adapter, the backend and device,
the pipeline stages a model is loaded as, the storage dtypes, the chat template, sampling, and whole numbers with a minimum."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from wgpu_train.engines.backend_choice import BACKENDS
from wgpu_train.engines.shared.kv_dtype import KV_DTYPES
from wgpu_train.engines.shared.quant import BASE_CHOICES, EMBED_CHOICES
from wgpu_train.errors import ConfigError


def add_parser(sub, name: str, help_text: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand's parser, its description the help text unless given."""
    return sub.add_parser(name, help=help_text, description=description or help_text)


def model_options(p, need_adapter: bool = False):
    """--model and --adapter-path (required with need_adapter)."""
    p.add_argument("--model", default=None, metavar="DIR",
                   help="Hugging Face model folder or hub id org/name[@revision]; default: the adapter's base "
                        "model when it exists (folder or hub id), else the embedded model")
    p.add_argument("--adapter-path", default=None, metavar="DIR", required=need_adapter,
                   help="PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) or hub id")


@dataclass(frozen=True)
class StageOptions:
    """--pipeline-stages, --stage-layers and --ray-address of a command that loads a model (stage_options)."""

    count: int | None
    layers: str | None
    ray_address: str | None


def stage_options(args) -> StageOptions | None:
    """The pipeline stages a command's model is loaded as, or None: one process (--ray-address alone refused)."""
    if not (args.pipeline_stages or args.stage_layers):
        if args.ray_address is not None:
            raise ConfigError("--ray-address joins a Ray cluster for --pipeline-stages: give both")
        return None
    return StageOptions(args.pipeline_stages, args.stage_layers, args.ray_address)


def device_options(p, storage: bool = False, kv_cache: bool = False):
    """--backend and --device; with storage --base-dtype and --embed-dtype, with kv_cache --kv-dtype."""
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="compute engine: wgpu, numpy, or auto (WebGPU on a GPU; where the only WebGPU adapters are "
                        "CPUs, the NumPy engine for a model whose layers hold under 1M weights, like the embedded "
                        "one, and the CPU adapter for a larger one; nothing is timed) (default: auto)")
    p.add_argument("--device", default=None,
                   help="WebGPU adapter: an index or part of its name/backend; with --pipeline-stages, one per stage "
                        "(comma-separated) or one for all")
    p.add_argument("--pipeline-stages", type=whole(1), default=None, metavar="S",
                   help="load the model as S pipeline stages, each a Ray actor that reads and holds only its "
                        "layers (the first also the embedding, the last the final norm and head), for a model "
                        "larger than one device; balanced by the weights each holds; the adapter applies through "
                        "them; needs pip install 'wgpu-train[pipeline]'")
    p.add_argument("--stage-layers", default=None, metavar="FIRST-LAST,...",
                   help="the stages' layers by hand, e.g. 0-11,12-23 (every layer exactly once, in order)")
    p.add_argument("--ray-address", default=None,
                   help="with --pipeline-stages: the Ray cluster to join (auto, or HOST:PORT of its head); default: "
                        "start a local Ray instance, shut down at the end")
    if storage:
        p.add_argument("--base-dtype", default=None, choices=BASE_CHOICES,
                       help="storage of the linear layers' weights; default: as the run that wrote the adapter "
                            "(its train_config.json), else auto (as the checkpoint stores them)")
        p.add_argument("--embed-dtype", default=None, choices=EMBED_CHOICES,
                       help="storage of the embedding and lm_head; default: as the run that wrote the adapter, "
                            "else auto (the base's own over a float32 or bfloat16 base, else float16)")
    if kv_cache:
        p.add_argument("--kv-dtype", default="float32", choices=KV_DTYPES,
                       help="storage of generation's KV cache: bfloat16 halves its memory, attention still computes "
                            "in float32 (default: float32)")


def whole(minimum: int):
    """An argparse type: an int of at least `minimum` (a usage error, one line, otherwise)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = "int"
    return parse


def chat_template_option(p, what: str):
    """--chat-template / --no-chat-template, unset by default (the adapter's run decides)."""
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help=f"{what} with the model's chat template, or (--no-chat-template) from the raw prompt text as "
                        f"finetune --no-chat-template trains; default: as the run that wrote the adapter, else on")


def given_no_chat_template(args):
    """no_chat_template as the command line gave it: None when neither option was given."""
    return None if args.chat_template is None else not args.chat_template


def sampling_options(p):
    """generate's and chat's sampling options."""
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--top-k", type=whole(0), default=0,
                   help="sample among the k likeliest tokens; 0: all (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling probability mass (default: 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
