"""The finetune, generate, eval and merge subcommands, registered into cli.py's parser through REGISTER."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path

from .errors import AdapterError, ConfigError

BACKENDS = ("auto", "wgpu", "numpy")


def _add_parser(sub, name: str, help_text: str, description: str | None = None) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_text, description=description or help_text)


def _model_options(p, need_adapter: bool = False):
    p.add_argument("--model", default=None, metavar="DIR",
                   help="Hugging Face model folder; default: the adapter's base model when it exists, "
                        "else the embedded model")
    p.add_argument("--adapter-path", default=None, metavar="DIR", required=need_adapter,
                   help="PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors)")


def _device_options(p, storage: bool = False):
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="compute backend: wgpu, numpy, or auto (wgpu when an adapter exists) (default: auto)")
    p.add_argument("--device", default=None, help="WebGPU adapter: an index or part of its name/backend")
    if storage:
        from .reference.quant import BASE_DTYPES, EMBED_CHOICES

        p.add_argument("--base-dtype", default=None, choices=BASE_DTYPES,
                       help="storage of the linear layers' weights; default: as the run that wrote the adapter "
                            "(its train_config.json), else float32")
        p.add_argument("--embed-dtype", default=None, choices=EMBED_CHOICES,
                       help="storage of the embedding and lm_head; default: as the run that wrote the adapter, "
                            "else auto (float16 unless the base is float32)")


# ---- finetune ---------------------------------------------------------------------------------------------

def _unwrap(tp):
    """(base type, optional) of an annotation such as `int | None`."""
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _parse_value(base, optional: bool, name: str):
    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        try:
            return base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {base.__name__} value: {text!r}") from None
    parse.__name__ = base.__name__  # argparse names the type in its messages
    return parse


def add_train_config_options(p):
    """One option per TrainConfig field, with its help text; unset options stay out of the namespace."""
    from .train import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        base, optional = _unwrap(hints[f.name])
        text = f.metadata["help"].replace("%", "%%")
        if base is bool:
            if f.default is True:
                text += " (default: on)"
            action = "store_true" if f.name.startswith("no_") else argparse.BooleanOptionalAction
            p.add_argument(flag, action=action, default=argparse.SUPPRESS, help=text)
            continue
        if f.default is not None and f.name not in ("model", "data"):
            text += f" (default: {f.default})"
        choices = f.metadata.get("choices")
        metavar = None if choices else {"model": "DIR", "data": "PATH", "out": "DIR", "resume": "DIR"}.get(
            f.name, base.__name__.upper())
        p.add_argument(flag, type=_parse_value(base, optional, f.name), default=argparse.SUPPRESS,
                       choices=choices, metavar=metavar, help=text)


def load_toml_config(path) -> dict:
    """TrainConfig values from a TOML file (keys are field names, '-' or '_'); unknown keys or wrong types
    raise ConfigError naming the key."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    from .train import TrainConfig

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None
    hints = typing.get_type_hints(TrainConfig)
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in hints:
            raise ConfigError(f"{path}: unknown key '{key}' (the keys are the options of wgpu-train finetune)")
        base, _ = _unwrap(hints[name])
        if name == "lora_targets" and isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = ",".join(value)
        ok = (isinstance(value, bool) if base is bool else
              isinstance(value, int) and not isinstance(value, bool) if base is int else
              isinstance(value, (int, float)) and not isinstance(value, bool) if base is float else
              isinstance(value, str))
        if not ok:
            raise ConfigError(f"{path}: key '{key}' must be {'a ' + base.__name__ if base is not int else 'an int'}, "
                              f"got {type(value).__name__} {value!r}")
        out[name] = float(value) if base is float else value
    return out


def resolve_train_config(args: argparse.Namespace):
    """TrainConfig from command line > TOML file (--config) > the embedded recipe (only for the default
    run: no --model and no --data anywhere) > defaults."""
    from .train import TrainConfig, default_run_values

    values = load_toml_config(args.config) if getattr(args, "config", None) else {}
    if getattr(args, "model", None) is None and getattr(args, "data", None) is None and \
            values.get("model") is None and values.get("data") is None:
        values = {**default_run_values(), **values}
    for f in dataclasses.fields(TrainConfig):
        if hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return TrainConfig(**values)


def cmd_finetune(args) -> int:
    from .train import Trainer

    summary = Trainer(resolve_train_config(args)).run()
    out = summary["output"]
    line = f"wrote {'adapter' if summary['method'] == 'lora' else 'model'} to {out} after {summary['steps']} steps"
    if summary.get("valid_loss_after") is not None:
        before = summary.get("valid_perplexity_before")
        line += (f"; valid perplexity {before:.3f} -> " if before is not None else "; valid perplexity ") + \
            f"{summary['valid_perplexity_after']:.3f}"
    if summary.get("exact_match_after") is not None:
        before = summary.get("exact_match_before")
        line += (f"; exact match {before:.1%} -> " if before is not None else "; exact match ") + \
            f"{summary['exact_match_after']:.1%} ({summary['exact_match_split']})"
    print(line)
    if summary.get("interrupted"):
        print(f"interrupted; resume with: wgpu-train finetune --resume {summary['checkpoint']} ...")
        return 130
    return 0


def _register_finetune(sub):
    from .train import TrainConfig

    p = _add_parser(sub, "finetune", "fine-tune a model (LoRA or full) on a JSONL dataset",
                    TrainConfig.__doc__ + " Values come from the command line, then --config, then defaults.")
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="TOML file of option values (keys as the options, '-' or '_'); the command line wins")
    add_train_config_options(p)
    p.set_defaults(func=cmd_finetune)


# ---- loading a model with an optional adapter -----------------------------------------------------------

def _adapter_base(adapter_path) -> Path | None:
    """The adapter's base_model_name_or_path when it is a model folder on this machine."""
    try:
        raw = json.loads((Path(adapter_path) / "adapter_config.json").read_text())
        base = Path(raw.get("base_model_name_or_path") or "")
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return base if str(base) not in ("", ".") and (base / "config.json").is_file() else None


def _trained_dtypes(adapter_path) -> dict:
    """{base_dtype, embed_dtype} of the run that wrote an adapter folder: its train_config.json (an output
    folder), or the trainer_state.json beside it (a checkpoint's adapter/); {} when neither says."""
    adapter = Path(adapter_path)
    for path in (adapter / "train_config.json", adapter.parent / "trainer_state.json"):
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(raw, dict) and isinstance(raw.get("base_dtype"), str):
            return {k: raw[k] for k in ("base_dtype", "embed_dtype") if isinstance(raw.get(k), str)}
    return {}


def load_model_and_tokenizer(model_arg, adapter_path, backend="auto", device=None, tokenizer=True,
                             base_dtype=None, embed_dtype=None):
    """(model folder, Model with the adapter loaded, Tokenizer or None) for generate / eval / merge.
    base_dtype / embed_dtype None: as the run that wrote the adapter stored them (said on stderr when that is
    not float32), else float32 and "auto"."""
    from .model import load_model
    from .tokenizer import load_tokenizer
    from .train import default_model_dir

    if adapter_path is not None:
        adapter = Path(adapter_path)
        if not adapter.is_dir():
            raise AdapterError(f"adapter folder not found: {adapter}")
        if not (adapter / "adapter_config.json").is_file() and (adapter / "config.json").is_file():
            raise AdapterError(f"{adapter} is a model folder, not an adapter: pass it as --model")
        if not (adapter / "adapter_config.json").is_file() and (adapter / "adapter" / "adapter_config.json").is_file():
            adapter_path = adapter / "adapter"          # a checkpoint folder: its adapter
    model_dir = Path(model_arg) if model_arg else (adapter_path and _adapter_base(adapter_path)) or default_model_dir()
    tokenizer = load_tokenizer(model_dir) if tokenizer else None
    trained = _trained_dtypes(adapter_path) if adapter_path is not None else {}
    given = {"base_dtype": base_dtype, "embed_dtype": embed_dtype}
    chosen = {k: v or trained.get(k) or {"base_dtype": "float32", "embed_dtype": "auto"}[k] for k, v in given.items()}
    inherited = [f"{k} {chosen[k]}" for k in chosen if given[k] is None and k in trained and chosen[k] != "float32"]
    if inherited:
        print(f"base weights stored as the adapter was trained: {', '.join(inherited)}", file=sys.stderr)
    model = load_model(model_dir, backend=backend, device=device, **chosen)
    if adapter_path is not None:
        model.load_adapter(adapter_path)
    return model_dir, model, tokenizer


# ---- generate ---------------------------------------------------------------------------------------------

def prompt_ids(tokenizer, prompt: str, system: str | None = None, chat_template: bool = True) -> list[int]:
    """Token ids that ask the model to answer `prompt`: the chat template with its generation prompt, or the
    raw prompt text as the trainer's --no-chat-template mode builds it."""
    from .data import raw_prompt_text

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    if chat_template:
        return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos_token else []
    return bos + tokenizer.encode(raw_prompt_text(messages))


def cmd_generate(args) -> int:
    from .tokenizer import StreamDecoder

    if not args.prompt:
        raise ConfigError("--prompt is empty")
    _, model, tok = load_model_and_tokenizer(args.model, args.adapter_path, args.backend, args.device,
                                             base_dtype=args.base_dtype, embed_dtype=args.embed_dtype)
    ids = prompt_ids(tok, args.prompt, args.system, not args.no_chat_template)
    stops = set(tok.stop_token_ids)
    decoder = StreamDecoder(tok)

    def on_token(t):
        if t in stops:
            return
        piece = decoder.push(t)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    model.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop_token_ids=tok.stop_token_ids, on_token=on_token)
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    return 0


def _register_generate(sub):
    p = _add_parser(sub, "generate", "generate an answer to a prompt, streaming tokens as they come")
    _model_options(p)
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", default=None, help="a system message before the prompt")
    p.add_argument("--no-chat-template", action="store_true",
                   help="use the raw prompt text instead of the chat template (as finetune --no-chat-template)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0: all (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling probability mass (default: 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    _device_options(p, storage=True)
    p.set_defaults(func=cmd_generate)


# ---- eval -------------------------------------------------------------------------------------------------

def cmd_eval(args) -> int:
    from .data import resolve_data, tokenize_dataset
    from .errors import DataError
    from .evaluate import evaluate_loss, exact_match
    from .train import PAD_MULTIPLE, default_data_dir

    data_path = Path(args.data) if args.data else default_data_dir()
    splits = resolve_data(data_path, valid_split=0.0, skip_invalid=args.skip_invalid)
    split = args.split or ("test" if splits.test else "valid" if splits.valid else "train")
    records = getattr(splits, split)
    if not records:
        raise DataError(f"{data_path}: no {split} split")
    _, model, tok = load_model_and_tokenizer(args.model, args.adapter_path, args.backend, args.device,
                                             base_dtype=args.base_dtype, embed_dtype=args.embed_dtype)
    use_template = not args.no_chat_template
    max_len = min(args.max_seq_len, model.config.max_position_embeddings)
    examples, stats = tokenize_dataset(tok, records, max_len, use_template)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    result = {"data": splits.files.get(split, str(data_path)), "split": split, "format": splits.format,
              "samples": len(examples), "dropped": stats.n_dropped, "truncated": stats.n_truncated}
    result.update(evaluate_loss(model.engine, examples, args.batch_size, pad, PAD_MULTIPLE))
    if not args.no_generate:
        em = exact_match(model, tok, records, use_template, args.max_new_tokens, args.max_samples,
                         batch_size=args.batch_size)
        result.update(exact_match=em["exact_match"], exact_match_correct=em["correct"], exact_match_n=em["n"])
    result.update(backend=model.backend, base_dtype=model.engine.base_dtype, embed_dtype=model.engine.embed_dtype)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    loss = "n/a" if result["loss"] is None else f"{result['loss']:.4f}"
    ppl = "n/a" if result["perplexity"] is None else f"{result['perplexity']:.3f}"
    line = f"{split} ({result['data']}, {result['samples']} samples): loss {loss}, perplexity {ppl}"
    if result.get("exact_match") is not None:
        line += f", exact match {result['exact_match']:.1%} ({result['exact_match_correct']}/{result['exact_match_n']})"
    print(line)
    return 0


def _register_eval(sub):
    p = _add_parser(sub, "eval", "loss, perplexity and exact match of a model (and adapter) on a dataset")
    _model_options(p)
    p.add_argument("--data", default=None, metavar="PATH",
                   help="JSONL file, or folder with train/valid/test.jsonl; default: the embedded dataset")
    p.add_argument("--split", default=None, choices=("train", "valid", "test"),
                   help="split of a dataset folder (default: test, else valid, else train; a file is one split)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--batch-size", type=int, default=8, help="rows per evaluation batch (default: 8)")
    p.add_argument("--max-seq-len", type=int, default=512, help="truncate samples to this many tokens (default: 512)")
    p.add_argument("--no-chat-template", action="store_true", help="raw prompt + response text (as in training)")
    p.add_argument("--skip-invalid", action="store_true", help="skip invalid JSONL lines instead of stopping")
    p.add_argument("--no-generate", action="store_true", help="skip the exact-match generation")
    p.add_argument("--max-samples", type=int, default=0, help="exact match on at most this many samples (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="longest generated answer (default: 64)")
    _device_options(p, storage=True)
    p.set_defaults(func=cmd_eval)


# ---- merge ------------------------------------------------------------------------------------------------

def cmd_merge(args) -> int:
    # Merging is weight arithmetic: the NumPy engine does it without a device. The update goes onto the
    # original weights, also for an adapter trained over float16 / NF4 ones (as PEFT merges a QLoRA
    # adapter into a 16-bit base): the merged folder carries no rounding of the base.
    model_dir, model, _ = load_model_and_tokenizer(args.model, args.adapter_path, backend="numpy",
                                                  tokenizer=False, base_dtype="float32", embed_dtype="float32")
    out = Path(args.out)
    if out.resolve() == Path(model_dir).resolve():
        raise ConfigError("--out must differ from the base model folder")
    try:
        model.merge_and_save(out)
    except OSError as e:
        raise ConfigError(f"cannot write {out}: {e.strerror or e}") from None
    print(f"wrote the merged model to {out}")
    return 0


def _register_merge(sub):
    p = _add_parser(sub, "merge", "fold a LoRA adapter into its base model's original weights and write a Hugging "
                                  "Face folder")
    _model_options(p, need_adapter=True)
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the merged model")
    p.set_defaults(func=cmd_merge)


REGISTER = [_register_finetune, _register_generate, _register_eval, _register_merge]
