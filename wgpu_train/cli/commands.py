"""The finetune, generate and eval subcommands, and merge's (merge.py) and memory's (memory.py), registered into
main.py's parser through REGISTER."""
from __future__ import annotations

import argparse
import json
import shlex
import sys

from wgpu_train.errors import ConfigError
from wgpu_train.cli import memory, merge
from wgpu_train.cli.train_options import JoinRepeated, add_train_config_options, resolve_train_config
from wgpu_train.cli.adapter_settings import (FALLBACKS, choose_settings, closing_stages, held_out_split,
                                             load_model_and_tokenizer, model_folder, trained_data_format)
from wgpu_train.adapters.files import adapter_folder
from wgpu_train.cli.harness_eval import add_harness_options, cmd_harness_eval, refuse_harness_options
from wgpu_train.cli.preference_eval import (EVAL_BATCH, add_preference_options, cmd_preference_eval,
                                            wants_preference_eval)
from wgpu_train.cli.options import (add_parser, chat_template_option, device_options, given_no_chat_template,
                                    model_options, sampling_options, stage_options, whole)

# ---- finetune ---------------------------------------------------------------------------------------------

def cmd_finetune(args) -> int:
    from wgpu_train.distributed.dispatch import finetune

    summary = finetune(resolve_train_config(args))
    out = summary["output"]
    if summary.get("adapter_step") is None and summary.get("interrupted"):
        return 130                      # the trainer said that nothing was trained
    line = f"wrote {'adapter' if summary['method'] == 'lora' else 'model'} to {out} after {summary['steps']} steps"
    preference = summary.get("objective")
    if preference and summary.get("valid_loss_after") is not None:
        before, after = summary.get("valid_loss_before"), summary["valid_loss_after"]
        line += (f"; valid {preference['name']} loss " + (f"{before:.4f} -> " if before is not None else "")
                 + f"{after:.4f}")
        acc = preference.get("reward_accuracy")
        if acc and acc.get("after") is not None:
            line += "; reward accuracy " + (f"{acc['before']:.1%} -> " if acc.get("before") is not None else "") + \
                f"{acc['after']:.1%}"
    elif summary.get("valid_loss_after") is not None:
        before = summary.get("valid_perplexity_before")
        line += (f"; valid perplexity {before:.3f} -> " if before is not None else "; valid perplexity ") + \
            f"{summary['valid_perplexity_after']:.3f}"
    if summary.get("reward_after") is not None:
        before = summary.get("reward_before")
        line += (f"; reward {before:.3f} -> " if before is not None else "; reward ") + \
            f"{summary['reward_after']:.3f} (greedy, {summary['reward_split']})"
        if summary.get("tool_share_after") is not None:       # GRPO with tools: rollouts that called one
            share = summary.get("tool_share_before")
            line += "; called a tool " + (f"{share:.0%} -> " if share is not None else "") + \
                f"{summary['tool_share_after']:.0%}"
    if summary.get("exact_match_after") is not None:
        before = summary.get("exact_match_before")
        line += (f"; exact match {before:.1%} -> " if before is not None else "; exact match ") + \
            f"{summary['exact_match_after']:.1%} ({summary['exact_match_split']})"
    print(line)
    if summary.get("interrupted"):
        print(f"interrupted; resume with: wgpu-train finetune --resume {shlex.quote(str(summary['checkpoint']))}")
        return 130
    return 0


def _register_finetune(sub):
    from wgpu_train.training.config import TrainConfig

    p = add_parser(sub, "finetune", "fine-tune a model (LoRA or full) on a JSONL dataset",
                    TrainConfig.__doc__ + " Values come from the command line, then --config, then defaults.")
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="TOML file of option values (keys as the options, '-' or '_'); the command line wins")
    add_train_config_options(p)
    p.set_defaults(func=cmd_finetune)


# ---- generate ---------------------------------------------------------------------------------------------

def prompt_ids(tokenizer, prompt: str, system: str | None = None, chat_template: bool = True,
               completions: bool = False) -> list[int]:
    """Token ids that ask the model to answer `prompt`: the chat template with its generation prompt, or the
    raw prompt text as the trainer's --no-chat-template mode builds it (for an adapter trained on completions
    data, the prompt without the blank line other formats put before the response)."""
    from wgpu_train.data.tokenize import generation_prompt_ids

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    if completions:
        messages[-1]["raw_separator"] = ""
    return generation_prompt_ids(tokenizer, messages, chat_template)


GENERATE_TOKENS = 256   # generate's --max-new-tokens default, within the model's positions


def stream_printer(tokenizer):
    """(on_token, finish) for model.generate: on_token prints each decoded piece as it comes (stop tokens left
    out); finish prints the rest and a newline, and returns the whole answer."""
    from wgpu_train.formats.tokenizer import StreamDecoder

    stops, decoder, pieces = set(tokenizer.stop_token_ids), StreamDecoder(tokenizer), []

    def on_token(t):
        if t in stops:
            return
        piece = decoder.push(t)
        if piece:
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()

    def finish() -> str:
        pieces.append(decoder.flush())
        sys.stdout.write(pieces[-1] + "\n")
        sys.stdout.flush()
        return "".join(pieces)

    return on_token, finish


def cmd_generate(args) -> int:
    if not args.prompt:
        raise ConfigError("--prompt is empty")
    adapter = adapter_folder(args.adapter_path)
    model_dir = model_folder(args.model, adapter)
    if args.image or args.video:
        from wgpu_train.cli.vision import generate_with_images

        return generate_with_images(args, model_dir, adapter)
    settings = choose_settings({"base_dtype": args.base_dtype, "embed_dtype": args.embed_dtype,
                                "no_chat_template": given_no_chat_template(args)}, adapter, model_dir)
    stages = stage_options(args)
    model, tok = load_model_and_tokenizer(model_dir, adapter, args.backend, args.device,
                                          base_dtype=settings["base_dtype"], embed_dtype=settings["embed_dtype"],
                                          kv_dtype=args.kv_dtype, stages=stages)
    with closing_stages(model):
        _generate(args, model, tok, adapter, not settings["no_chat_template"])
    return 0


def _generate(args, model, tok, adapter, chat_template: bool):
    """Print the model's answer to --prompt as it comes."""
    trained_on = trained_data_format(adapter) if adapter else None
    ids = prompt_ids(tok, args.prompt, args.system, chat_template, trained_on == "completions")
    positions = model.config.max_position_embeddings
    room = positions - len(ids)
    if room < 1:
        raise ConfigError(f"the prompt has {len(ids)} tokens, and the model takes at most {positions} "
                          f"(max_position_embeddings): no room for an answer")
    max_new = args.max_new_tokens or GENERATE_TOKENS
    if max_new > room:
        if args.max_new_tokens is not None:
            print(f"note: --max-new-tokens {max_new} capped to {room}: the prompt's {len(ids)} tokens and the answer "
                  f"share the model's {positions} positions", file=sys.stderr)
        max_new = room
    on_token, finish = stream_printer(tok)
    model.generate(ids, max_new_tokens=max_new, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop_token_ids=tok.stop_token_ids, on_token=on_token)
    finish()


def _register_generate(sub):
    p = add_parser(sub, "generate", "generate an answer to a prompt, streaming tokens as they come")
    model_options(p)
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", default=None, help="a system message before the prompt")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image the prompt asks about (repeat for several, in order before the prompt's text): "
                        "a Gemma 3 vision-language model, greedy, on the NumPy engine (the vision extra: Pillow)")
    p.add_argument("--video", action="append", default=None, metavar="PATH",
                   help="a video the prompt asks about (Qwen3-VL, Qwen3.5; repeat for several, after the images): "
                        "a folder of frame images (in name order) or a video file (sampled as the model's video "
                        "processor samples it; needs PyAV: pip install av)")
    chat_template_option(p, "ask")
    p.add_argument("--max-new-tokens", type=whole(1), default=None,
                   help=f"most tokens to generate, capped (with a note) to the positions the prompt leaves in the "
                        f"model's max_position_embeddings (default: {GENERATE_TOKENS}, or what fits)")
    sampling_options(p)
    device_options(p, storage=True, kv_cache=True)
    p.set_defaults(func=cmd_generate)


# ---- eval -------------------------------------------------------------------------------------------------

def cmd_eval(args) -> int:
    if args.tasks is None:
        refuse_harness_options(args)
    stages = stage_options(args)
    if stages is not None and (args.tasks is not None or wants_preference_eval(args)):
        raise ConfigError(f"eval {'--tasks' if args.tasks is not None else '--objective'} loads the model in one "
                          f"process: leave out --pipeline-stages and --stage-layers (they evaluate --data's loss "
                          f"and exact match)")
    if wants_preference_eval(args):
        return cmd_preference_eval(args)
    args.batch_size = args.batch_size or EVAL_BATCH      # (a preference evaluation's default is the run's)
    if args.tasks is not None:
        return cmd_harness_eval(args)
    from wgpu_train.data.sources import resolve_data
    from wgpu_train.errors import DataError
    from wgpu_train.training.config import default_data_dir

    data_path = args.data if args.data else default_data_dir()
    adapter = adapter_folder(args.adapter_path)
    # a split asked for by name is the run's: data without a valid one held out as the run held it out
    valid_split, seed = held_out_split(adapter) if args.split else (0.0, 0)
    splits = resolve_data(data_path, valid_split=valid_split, seed=seed, skip_invalid=args.skip_invalid,
                          columns=args.columns)
    split = args.split or ("test" if splits.test else "valid" if splits.valid else "train")
    records = getattr(splits, split)
    if not records:
        raise DataError(f"{data_path}: no {split} split")
    model_dir = model_folder(args.model, adapter)
    settings = choose_settings({"base_dtype": args.base_dtype, "embed_dtype": args.embed_dtype,
                                "no_chat_template": given_no_chat_template(args),
                                "train_on_last_turn": args.train_on_last_turn, "max_seq_len": args.max_seq_len},
                               adapter, model_dir)
    model, tok = load_model_and_tokenizer(model_dir, adapter, args.backend, args.device,
                                          base_dtype=settings["base_dtype"], embed_dtype=settings["embed_dtype"],
                                          stages=stages)
    with closing_stages(model):
        result = _evaluate(args, model, tok, splits, split, records, settings, str(data_path))
    max_len = result["max_seq_len"]
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    loss = "n/a" if result["loss"] is None else f"{result['loss']:.4f}"
    ppl = "n/a" if result["perplexity"] is None else f"{result['perplexity']:.3f}"
    line = f"{split} ({result['data']}, {result['samples']} samples): loss {loss}, perplexity {ppl}"
    if result.get("exact_match") is not None:
        line += f", exact match {result['exact_match']:.1%} ({result['exact_match_correct']}/{result['exact_match_n']})"
    if result.get("exact_match_skipped_too_long"):
        line += f", {result['exact_match_skipped_too_long']} prompts too long for {max_len} positions not asked"
    print(line)
    return 0


def _evaluate(args, model, tok, splits, split: str, records: list, settings: dict, data: str) -> dict:
    """eval's numbers of the model on a split: its loss and perplexity, and exact match unless --no-generate."""
    from wgpu_train.data.tokenize import tokenize_dataset
    from wgpu_train.training.config import PAD_MULTIPLE
    from wgpu_train.training.evaluate import evaluate_loss, exact_match

    use_template = not settings["no_chat_template"]
    max_len = min(settings["max_seq_len"], model.config.max_position_embeddings)
    examples, stats = tokenize_dataset(tok, records, max_len, use_template, settings["train_on_last_turn"],
                                       skip_invalid=args.skip_invalid)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    result = {"data": splits.files.get(split, data), "split": split, "format": splits.format,
              "samples": len(examples), "dropped": stats.n_dropped, "truncated": stats.n_truncated,
              "skipped": splits.n_skipped + stats.n_skipped,
              "max_seq_len": max_len, "chat_template": use_template,
              "train_on_last_turn": settings["train_on_last_turn"]}
    result.update(evaluate_loss(model.engine, examples, args.batch_size, pad, PAD_MULTIPLE))
    if not args.no_generate:
        em = exact_match(model, tok, records, use_template, args.max_new_tokens, args.max_samples,
                         batch_size=args.batch_size, max_seq_len=max_len, skip_invalid=args.skip_invalid)
        result.update(exact_match=em["exact_match"], exact_match_correct=em["correct"], exact_match_n=em["n"],
                      exact_match_skipped_too_long=em["skipped_too_long"])
    result.update(backend=model.backend, base_dtype=model.engine.base_dtype, embed_dtype=model.engine.embed_dtype)
    return result


def _register_eval(sub):
    p = add_parser(sub, "eval", "loss, perplexity and exact match of a model (and adapter) on a dataset, a "
                                 "preference objective's loss and reward metrics (--objective), or "
                                 "lm-evaluation-harness tasks (--tasks)")
    model_options(p)
    add_harness_options(p)
    add_preference_options(p)
    p.add_argument("--data", default=None, metavar="PATH", action=JoinRepeated,
                   help="data file (JSONL, JSON, Parquet), folder with train/valid/test splits, hub dataset id or "
                        "glob (repeat to mix); default: the embedded dataset")
    p.add_argument("--columns", default=None, metavar="FIELD=COLUMN[,...]",
                   help="other column names of the data (as finetune --columns)")
    p.add_argument("--split", default=None, choices=("train", "valid", "test"),
                   help="split of the data (default: test, else valid, else train; a file without splits is train "
                        "as a whole). Named, valid and train of data without a valid split are those of the run "
                        "that wrote the adapter: the fraction it held out (its valid_split and seed; without an "
                        "adapter, finetune's defaults) and the rest")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--batch-size", type=whole(1), default=None,
                   help=f"rows per evaluation batch (default: {EVAL_BATCH}); with --objective, examples (pairs) per "
                        f"scored step, as the run's steps take them (KTO's KL estimate and ORPO's NLL are per step) "
                        f"(default: as the run that wrote the adapter, else {EVAL_BATCH})")
    p.add_argument("--max-seq-len", type=whole(2), default=None,
                   help="truncate samples to this many tokens, and ask exact match only of prompts that leave room "
                        f"for the answer within it; default: as the run that wrote the adapter, else "
                        f"{FALLBACKS['max_seq_len']}")
    chat_template_option(p, "score and ask")
    p.add_argument("--train-on-last-turn", action=argparse.BooleanOptionalAction, default=None,
                   help="score only the last assistant turn of a multi-turn chat; default: as the run that wrote "
                        "the adapter, else off")
    p.add_argument("--skip-invalid", action="store_true", help="skip invalid JSONL lines instead of stopping")
    p.add_argument("--no-generate", action="store_true", help="skip the exact-match generation")
    p.add_argument("--max-samples", type=whole(0), default=0,
                   help="exact match on at most this many samples (0: all)")
    p.add_argument("--max-new-tokens", type=whole(1), default=64, help="longest generated answer (default: 64)")
    device_options(p, storage=True)
    p.set_defaults(func=cmd_eval)


REGISTER = [_register_finetune, _register_generate, _register_eval, merge.register, memory.register]
