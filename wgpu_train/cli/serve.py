"""`wgpu-train serve`: an OpenAI-compatible HTTP server over a model and its adapters (wgpu_train/serve/); every
bad option, adapter or port refused in one line before it serves."""
from __future__ import annotations

import logging
import sys

from wgpu_train.errors import ConfigError
from wgpu_train.cli.options import (add_parser, chat_template_option, device_options, given_no_chat_template,
                                    stage_options, whole)

DEFAULT_CONTEXT = 4096      # positions per row of the running batch's KV cache unless --max-model-len says


def cmd_serve(args) -> int:
    scheduler, sock = prepare(args)             # the serve extra checked first
    from wgpu_train.cli.adapter_settings import close_stages
    from wgpu_train.serve.app import build_app
    from wgpu_train.serve.server import serve, url_of

    try:
        app = build_app(scheduler, args.api_key, args.allow_remote_images)
        scheduler.start()                       # the batch's KV cache allocated: one that does not fit is one line
        served_log = logging.getLogger("wgpu_train.serve")      # a line per answer, beside uvicorn's per request
        served_log.setLevel(args.log_level.upper())
        served_log.addHandler(logging.StreamHandler())
        print(f"serving {', '.join(scheduler.registry.names())} ({scheduler.model.backend}) at {url_of(sock)}/v1, "
              f"the OpenAI API{'' if args.api_key else ' (no --api-key: anyone who reaches it may use it)'}; Ctrl-C "
              f"stops", file=sys.stderr, flush=True)
        serve(app, sock, args.log_level)
    finally:
        scheduler.close()
        close_stages(scheduler.model)
    return 0


def prepare(args):
    """(Scheduler, bound socket): every check made, the model loaded with its adapters, nothing served yet."""
    from wgpu_train.adapters.files import adapter_base_model, adapter_base_name, adapter_folder
    from wgpu_train.cli.adapter_settings import model_folder
    from wgpu_train.serve.adapters import check_bases, parse_adapter_spec
    from wgpu_train.serve.server import bind, require_extra
    from wgpu_train.training.config import default_model_dir

    require_extra()
    stages = stage_options(args)
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key is empty: give the key clients must send, or leave --api-key out to serve "
                          "without one")
    specs = [parse_adapter_spec(text) for text in args.adapter]
    names = [s.name for s in specs]
    if len(set(names)) < len(names):
        raise ConfigError(f"--adapter: the name {next(n for n in names if names.count(n) > 1)!r} is given twice")
    folders = [adapter_folder(s.source) for s in specs]
    first = folders[0] if folders else None
    model_dir = model_folder(args.model, first)
    from_adapter = first is not None and not args.model and adapter_base_model(first) is not None
    embedded = model_dir.resolve() == default_model_dir().resolve()     # the README's `default`, not its path
    base_name = args.served_model_name or args.model or (adapter_base_name(first) if from_adapter and not embedded
                                                         else "default")
    for warning in check_bases([(s.name, f) for s, f in zip(specs, folders)], args.model, model_dir):
        print(f"warning: {warning}", file=sys.stderr)
    sock = bind(args.host, args.port)            # before the model loads: a port in use fails at once
    try:
        return _load(args, specs, folders, model_dir, base_name, stages), sock
    except BaseException:
        sock.close()
        raise


def _load(args, specs, folders, model_dir, base_name, stages):
    """The Scheduler over the model loaded with every adapter read and checked (its pipeline stages closed when
    a check fails)."""
    from wgpu_train.cli.adapter_settings import (choose_settings, close_stages, load_model_and_tokenizer,
                                                 trained_data_format)
    from wgpu_train.serve.adapters import AdapterRegistry
    from wgpu_train.serve.prompts import PromptStyle
    from wgpu_train.serve.scheduler import Scheduler

    first = folders[0] if folders else None
    settings = choose_settings({"base_dtype": args.base_dtype, "embed_dtype": args.embed_dtype}, first, model_dir)
    model, tok = load_model_and_tokenizer(model_dir, None, args.backend, args.device,
                                          base_dtype=settings["base_dtype"], embed_dtype=settings["embed_dtype"],
                                          kv_dtype=args.kv_dtype, stages=stages)
    try:
        given = given_no_chat_template(args)
        registry = AdapterRegistry(model, base_name, PromptStyle(chat_template=not given))
        for spec, folder in zip(specs, folders):
            raw = choose_settings({**settings, "no_chat_template": given}, folder, model_dir)["no_chat_template"]
            registry.add(spec.name, folder, PromptStyle(not raw, trained_data_format(folder) == "completions"))
        positions = model.config.max_position_embeddings
        if args.max_model_len is not None and args.max_model_len > positions:
            raise ConfigError(f"--max-model-len {args.max_model_len}: the model has {positions} positions "
                              f"(max_position_embeddings)")
        from wgpu_train.cli.vision import vision_of

        vision = vision_of(model, model_dir)
    except BaseException:
        close_stages(model)
        raise
    return Scheduler(model, registry, tok, args.max_queue, args.max_batch,
                     args.max_model_len or min(positions, DEFAULT_CONTEXT), vision)


def register(sub):
    from wgpu_train.serve.server import EXTRA

    p = add_parser(sub, "serve", "serve a model and its adapters over an OpenAI-compatible HTTP API",
                    "An OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models, streamed or "
                    "not) over one base model and any number of LoRA adapters: a request's `model` names the "
                    "adapter (or the base), switched without reloading the base. Requests queue in order and join "
                    "the running batch at its next step (continuous batching) while they share its adapter. "
                    f"/health and /metrics (Prometheus) answer without the key. Needs {EXTRA}.")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="Hugging Face model folder or hub id org/name[@revision]; default: the first adapter's base "
                        "model when it exists, else the embedded model")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                   help="serve a PEFT LoRA adapter (a folder or hub id) as model NAME; a hub id alone is named by "
                        "itself; repeat for more")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the base model's name in requests and /v1/models (default: --model as given, else the "
                        "first adapter's base, else 'default'; the embedded model is always 'default')")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=whole(0), default=8000, help="TCP port; 0 picks a free one (default: 8000)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every request (401 otherwise)")
    p.add_argument("--max-queue", type=whole(1), default=64,
                   help="requests that may wait; more get 503 with Retry-After (default: 64)")
    p.add_argument("--max-batch", type=whole(1), default=8,
                   help="rows of the running batch: answers generated together (default: 8)")
    p.add_argument("--max-model-len", type=whole(1), default=None, metavar="N",
                   help="positions of each row of the batch's KV cache, a prompt and its answer together (default: "
                        f"the model's max_position_embeddings, at most {DEFAULT_CONTEXT})")
    chat_template_option(p, "ask chat requests")
    p.add_argument("--allow-remote-images", action="store_true",
                   help="a vision model's chat images may be http(s) URLs, fetched by the server (default: only "
                        "data: URLs and file:// paths; a remote URL is a 400)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="log level of uvicorn and the worker (default: info: a line per request and per batch)")
    device_options(p, storage=True, kv_cache=True)
    p.set_defaults(func=cmd_serve)
