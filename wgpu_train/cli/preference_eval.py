"""`wgpu-train eval --objective dpo|simpo|orpo|kto`: a preference objective's loss and TRL's metrics on a split of
preference data, scored as the PreferenceTrainer scores its validation pairs (training/preference_scoring.py);
TRL's vision preference records too, each row with its prompt's images."""
from __future__ import annotations

import json
import sys

from wgpu_train.errors import ConfigError
from wgpu_train.training.objectives import (PREFERENCE_OBJECTIVES, PREFERENCE_OPTIONS, DataKind, PreferenceSettings,
                                            objective_class)

# how preference rows are truncated: TrainConfig's fields, taken from the run that wrote the adapter, else defaults
TRUNCATION_OPTIONS = ("truncation_mode", "max_prompt_length")
EVAL_BATCH = 8      # eval's --batch-size when neither the command line nor the adapter's run gives one


def add_preference_options(p):
    """--objective, its options (TrainConfig's help texts) and --ref-adapter, on eval's parser."""
    import dataclasses

    from wgpu_train.training.config import TrainConfig

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    # the objectives' own defaults (TrainConfig's beta is None: 0.1 for them, 0 for GRPO)
    option_defaults = {f.name: f.default for f in dataclasses.fields(PreferenceSettings)}
    p.add_argument("--objective", default=None, choices=PREFERENCE_OBJECTIVES,
                   help="score preference data (pairs; kto: unpaired examples) with this objective and report its "
                        "loss and TRL's metrics (rewards/*, logps/*; ORPO's nll_loss and log_odds_*; KTO's kl) "
                        "instead of the token loss; no exact match")
    for name in PREFERENCE_OPTIONS:
        f = fields[name]
        kind = type(option_defaults[name])
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, choices=f.metadata.get("choices"),
                       metavar=None if f.metadata.get("choices") else kind.__name__.upper(),
                       help=f"with --objective: {f.metadata['help']} (default: as the run that wrote the adapter when "
                            f"it trained the same objective, else {option_defaults[name]})".replace("%", "%%"))
    p.add_argument("--truncation-mode", default=None, choices=fields["truncation_mode"].metadata["choices"],
                   help=f"with --objective: {fields['truncation_mode'].metadata['help']} (default: as the run that "
                        f"wrote the adapter, else {fields['truncation_mode'].default})")
    p.add_argument("--max-prompt-length", type=int, default=None, metavar="INT",
                   help=f"with --objective: {fields['max_prompt_length'].metadata['help']}, or as the run that wrote "
                        f"the adapter")
    p.add_argument("--ref-adapter", default=None, metavar="DIR",
                   help="with --objective dpo or kto: the reference is the base model with this PEFT adapter "
                        "(default: the base model, the adapter switched off)")


def _objective_settings(args, adapter):
    """(PreferenceSettings of --objective, the scoring batch size, the truncation options): each option from the
    command line, else the adapter's run (the objective's options: when it trained the same objective), else the
    default."""
    import dataclasses

    from wgpu_train.cli.adapter_settings import trained_run_config
    from wgpu_train.training.config import TrainConfig

    run = trained_run_config(adapter) if adapter is not None else {}
    same = run.get("objective") == args.objective
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    # the objectives' own defaults (TrainConfig's beta is None: 0.1 for them, 0 for GRPO)
    option_defaults = {f.name: f.default for f in dataclasses.fields(PreferenceSettings)}
    values = {}
    for name in PREFERENCE_OPTIONS:
        given, kind = getattr(args, name), type(option_defaults[name])
        trained = run.get(name)
        recorded = isinstance(trained, str) if kind is str else (isinstance(trained, (int, float))
                                                                  and not isinstance(trained, bool))
        values[name] = given if given is not None else kind(trained) if same and recorded else option_defaults[name]
    batch = run.get("batch_size")
    batch_size = args.batch_size or (batch if isinstance(batch, int) and batch >= 1 else EVAL_BATCH)
    mode, prompt = run.get("truncation_mode"), run.get("max_prompt_length")
    truncation = {"truncation_mode": args.truncation_mode or (mode if isinstance(mode, str)
                                                              else defaults["truncation_mode"]),
                  "max_prompt_length": args.max_prompt_length or (prompt if isinstance(prompt, int) else None)}
    return PreferenceSettings(args.objective, **values), batch_size, truncation


def wants_preference_eval(args) -> bool:
    """Whether eval's arguments ask for a preference evaluation (--objective, its options or --ref-adapter)."""
    return args.objective is not None or args.ref_adapter is not None or any(
        getattr(args, name) is not None for name in PREFERENCE_OPTIONS + TRUNCATION_OPTIONS)


def _check_arguments(args):
    given = [name for name in PREFERENCE_OPTIONS + TRUNCATION_OPTIONS if getattr(args, name) is not None]
    if args.objective is None:
        option = "--ref-adapter" if args.ref_adapter else f"--{given[0].replace('_', '-')}"
        raise ConfigError(f"{option} is an option of a preference objective: give --objective")
    if args.tasks is not None:
        raise ConfigError("--tasks runs lm-evaluation-harness tasks; leave out --objective (or --tasks)")
    if args.max_prompt_length is not None and args.max_prompt_length < 1:
        raise ConfigError(f"--max-prompt-length must be at least 1, got {args.max_prompt_length}")
    if args.ref_adapter and not objective_class(args.objective).uses_reference:
        raise ConfigError(f"--objective {args.objective} needs no reference model: leave out --ref-adapter")


def _read_split(args, data_path, data: DataKind, held_out: tuple[float, int]):
    """(DataSplits, the split's name, its records): --data read as records of the objective's kind (pairs or
    unpaired), a split named by --split as the run made it (held_out: its valid_split and seed), or without
    --data the embedded demo's, built as a run of that seed builds them."""
    from wgpu_train.data.preference_demo import demo_preference_splits
    from wgpu_train.data.sources import resolve_data
    from wgpu_train.errors import DataError

    valid_split, seed = held_out
    if args.data:
        splits = resolve_data(data_path, valid_split=valid_split if args.split else 0.0, seed=seed,
                              skip_invalid=args.skip_invalid, columns=args.columns, kind=data)
    else:
        splits = demo_preference_splits(resolve_data(data_path, valid_split=0.0, skip_invalid=args.skip_invalid),
                                        seed, data is DataKind.UNPAIRED, names=("train", "valid", "test"))
    split = args.split or ("test" if splits.test else "valid" if splits.valid else "train")
    records = getattr(splits, split)
    if not records:
        raise DataError(f"{data_path}: no {split} split")
    return splits, split, records


def _read_vision_split(args, data_path, data: DataKind, held_out: tuple[float, int]):
    """_read_split's for TRL's vision preference records (one local file whose first record has `images`): the
    records of --split as the run held them out (no test split), pairs or KTO's unpaired records."""
    from wgpu_train.data.preference_vision import vision_preference_records
    from wgpu_train.data.vision_records import vision_splits
    from wgpu_train.errors import DataError

    if args.columns:
        raise ConfigError("--columns is not supported with images yet")
    unpaired = data is DataKind.UNPAIRED
    valid_split, seed = held_out
    splits = vision_splits(data_path, valid_split if args.split else 0.0, seed)
    split = args.split or ("valid" if splits.valid else "train")
    records = vision_preference_records(getattr(splits, split), unpaired, str(data_path))
    if not records:
        raise DataError(f"{data_path}: no {split} split")
    return splits, split, records


def _attach_vision(args, model, model_dir, adapter):
    """The VisionModel over the loaded language model (the tower and projector read from model_dir), the adapter
    loaded through it. LoRA on the tower is scored where the engine runs the tower (SigLIP's: the reference,
    the adapter switched off, switches the tower's LoRA off too); refused elsewhere, as finetune --objective
    refuses it."""
    from wgpu_train.engines.vision_model import attach_vision

    vision = attach_vision(model, model_dir)
    if adapter is not None:
        vision.load_adapter(adapter)
    if vision.tower.lora and not vision.in_step:
        raise ConfigError(f"{adapter}: LoRA on this model's vision tower is scored with --objective "
                          f"{args.objective} where the engine runs the tower inside its step only for now (Gemma 3's "
                          f"and SmolVLM's SigLIP tower), as finetune --objective trains it")
    return vision


def cmd_preference_eval(args) -> int:
    """eval with --objective: see the module's docstring."""
    from wgpu_train.adapters.files import adapter_folder
    from wgpu_train.cli.adapter_settings import choose_settings, held_out_split, load_model_and_tokenizer, model_folder
    from wgpu_train.cli.options import given_no_chat_template
    from wgpu_train.data.preference_batching import kl_partners
    from wgpu_train.data.preference_tokenize import tokenize_preferences, tokenize_unpaired
    from wgpu_train.data.preference_vision import tokenize_vision_preferences
    from wgpu_train.data.vision_records import is_vision_data
    from wgpu_train.training.config import default_data_dir
    from wgpu_train.training.preference_scoring import ADAPTER_OFF, PreferenceScorer, engine_reference

    _check_arguments(args)
    adapter = adapter_folder(args.adapter_path)
    ref_adapter = adapter_folder(args.ref_adapter)
    objective, batch_size, truncation = _objective_settings(args, adapter)
    unpaired = objective.unit.data is DataKind.UNPAIRED
    data_path = args.data if args.data else default_data_dir()
    with_images = is_vision_data(data_path)
    read = _read_vision_split if with_images else _read_split
    splits, split, records = read(args, data_path, objective.unit.data, held_out_split(adapter))
    model_dir = model_folder(args.model, adapter)
    settings = choose_settings({"base_dtype": args.base_dtype, "embed_dtype": args.embed_dtype,
                                "no_chat_template": given_no_chat_template(args), "max_seq_len": args.max_seq_len},
                               adapter, model_dir)
    if with_images and settings["no_chat_template"]:
        raise ConfigError("--no-chat-template is not supported with images yet")
    model, tok = load_model_and_tokenizer(model_dir, None if with_images else adapter, args.backend, args.device,
                                          base_dtype=settings["base_dtype"], embed_dtype=settings["embed_dtype"])
    use_template = not settings["no_chat_template"]
    max_len = min(settings["max_seq_len"], model.config.max_position_embeddings)
    vision, image_ids, cut = None, frozenset(), 0
    if with_images:         # each row with its prompt's images, tokenized as the PreferenceTrainer tokenizes them
        vision = _attach_vision(args, model, model_dir, adapter)
        span = vision.image_span(tok)
        image_ids = frozenset(tok.token_to_id(t) for t in span.token_names) - {None}
        examples, stats, cut = tokenize_vision_preferences(tok, records, span, max_len, image_ids, **truncation)
    else:
        tokenize = tokenize_unpaired if unpaired else tokenize_preferences
        examples, stats = tokenize(tok, records, max_len, use_chat_template=use_template,
                                   skip_invalid=args.skip_invalid, **truncation)
    scorer = PreferenceScorer(objective, batch_size, tok.pad_token_id if tok.pad_token_id is not None else 0, vision,
                              image_ids)
    partners = kl_partners(len(examples), batch_size) if unpaired else None
    reference, described = None, None
    if objective.unit.uses_reference:
        if ref_adapter is not None:
            ref_model, _ = load_model_and_tokenizer(model_dir, ref_adapter, args.backend, args.device, tokenizer=False,
                                                    base_dtype=settings["base_dtype"],
                                                    embed_dtype=settings["embed_dtype"])
            reference = engine_reference(scorer, ref_model.engine, examples, partners)
            described = f"the base model with the adapter {ref_adapter}"
        else:
            reference = (ADAPTER_OFF if adapter is not None
                         else engine_reference(scorer, model.engine, examples, partners))
            described = "the base model" + (" (the adapter switched off)" if adapter is not None else "")
    scores = scorer.evaluate(model.engine, examples, reference, partners)
    result = {"data": splits.files.get(split, str(data_path)), "split": split, "format": splits.format,
              "objective": vars(objective), "reference": described, "examples": len(examples),
              "dropped": stats.n_dropped, "truncated": stats.n_truncated,
              **({"images": sum(len(e.images) for e in examples), "rows_cut_in_image": cut} if with_images else {}),
              "skipped": splits.n_skipped + stats.n_skipped, "max_seq_len": max_len, **truncation,
              "chat_template": use_template,
              "batch_size": batch_size, "loss": None if scores is None else scores["loss"],
              **({} if scores is None else scores["metrics"]),
              "backend": model.backend, "base_dtype": model.engine.base_dtype, "embed_dtype": model.engine.embed_dtype}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    what = "examples" if unpaired else "pairs"
    line = f"{split} ({result['data']}, {len(examples)} {what}): {objective.objective} loss "
    if scores is None:
        print(line + "n/a (nothing left after tokenization)")
        return 0
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in scores["metrics"].items())
    print(line + f"{scores['loss']:.4f}, {metrics}")
    if stats.n_dropped or stats.n_truncated or cut:
        print(f"note: {stats.describe()}{f', {cut} dropped (cut inside or before an image)' if cut else ''} at "
              f"{max_len} tokens", file=sys.stderr)
    return 0
