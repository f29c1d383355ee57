"""`wgpu-train memory`: the GPU memory a fine-tuning run needs, from the model's config.json alone, as a whole and
for each pipeline stage (--pipeline-stages), in the precision the run will use; a vision model's tower and its
images too (on the stages: the image inputs each holds)."""
from __future__ import annotations

import json

from wgpu_train.cli.options import add_parser, whole
from wgpu_train.errors import ConfigError


# ---- memory -----------------------------------------------------------------------------------------------

def cmd_memory(args) -> int:
    from wgpu_train.formats import hub
    from wgpu_train.adapters.config import LoraConfig
    from wgpu_train.models.config import ModelConfig
    from wgpu_train.adapters.layout import (describe_layout, describe_targets, last_layers, model_targets,
                                            parse_layers, parse_pattern)
    from wgpu_train.engines.resources import format_bytes, memory_report
    from wgpu_train.engines.shared.quant import check_dtypes, describe_packed
    from wgpu_train.training.config import default_model_dir

    model_dir = hub.resolve(args.model, "model") if args.model else default_model_dir()
    cfg = ModelConfig.from_folder(model_dir)
    if args.batch_size < 1 or args.max_seq_len < 1:
        raise ConfigError("--batch-size and --max-seq-len must be at least 1")
    base, embed = check_dtypes(args.base_dtype, args.embed_dtype, cfg.checkpoint_dtype, full=args.method == "full")
    if args.method == "full" and (base, embed) != ("float32", "float32"):
        raise ConfigError("method full trains every weight, so it needs float32 base and embedding dtypes")
    length = min(args.max_seq_len, cfg.max_position_embeddings)
    vision = _vision_estimate(args, model_dir, length)
    targets = args.lora_targets if vision is None else vision.pop("language_targets")
    stage_images = None if vision is None else vision.pop("stage_images")
    lora = None
    if args.method == "lora":
        layers = parse_layers(args.lora_layers)
        lora = LoraConfig(r=args.lora_rank, target_modules=model_targets(targets, cfg),
                          layers_to_transform=last_layers(layers, cfg.num_hidden_layers) if isinstance(layers, int)
                          else layers, rank_pattern=parse_pattern(args.lora_rank_pattern, "--lora-rank-pattern"),
                          use_dora=args.dora, modules_to_save=args.modules_to_save,
                          ensure_weight_tying=args.ensure_weight_tying,
                          target_parameters=args.lora_target_parameters or ())
    elif args.modules_to_save:
        raise ConfigError("--modules-to-save trains copies beside LoRA: method lora (method full trains every weight)")
    from wgpu_train.engines.protocol import check_precision_widths

    precision, why = run_precision(args.precision, args.backend, args.device, cfg)
    check_precision_widths(precision, cfg)
    est = memory_report(cfg, args.batch_size, length, lora, args.method, base, embed, args.gradient_checkpointing,
                        precision)
    largest = est.pop("largest_activation_buffer")
    result = {"model": str(model_dir), "architecture": cfg.architecture, "parameters": est.pop("parameters"),
              "batch_size": args.batch_size, "seq_len": length, "method": args.method, "base_dtype": base,
              "embed_dtype": embed, "gradient_checkpointing": args.gradient_checkpointing, "precision": precision,
              "precision_reason": why, **est, "largest_activation_buffer": largest}
    if vision:
        from wgpu_train.engines.resources import image_input_bytes

        # the device's image inputs of a micro-batch, as one process holds them: a single stage of every layer
        vision["image_inputs"] = image_input_bytes(cfg, stage_images, args.batch_size, length,
                                                   range(cfg.num_hidden_layers), True, precision)
        result["vision"] = vision
        result["total"] = est["total"] = est["total"] + vision["tower_weights"] + vision["tower_activations"] + \
            vision["image_inputs"] + vision["tower_lora_state"]
    elif args.images_per_row is not None:
        raise ConfigError("--images-per-row: the model takes no images (a Gemma 3 vision model does)")
    if args.pipeline_stages or args.stage_layers:
        result["stages"] = _stage_estimates(args, cfg, length, lora, base, embed, precision, stage_images)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    what = (f"LoRA r={lora.r} on {describe_targets(lora, cfg)}{describe_layout(lora)}" if lora
            else "full fine-tuning")
    n = result["parameters"]
    said = "" if why == "as given" else f" ({why})"
    print(f"{model_dir} ({cfg.label}, {f'{n / 1e9:.2f}B' if n >= 1e9 else f'{n / 1e6:.1f}M'} parameters): "
          f"training batch "
          f"{args.batch_size} x {length}, {what}, base {base} (embedding {embed}"
          f"{describe_packed(cfg.packed_experts, base)}), precision {precision}{said}"
          + (", gradient checkpointing" if args.gradient_checkpointing else ""))
    for key in ("weights", "trainable_state", "activations", "logits", "total"):
        ratio = (f"  ({result['activations_vs_fp32']:.2f}x of fp32's)" if key == "activations" and precision.sixteen_bit
                 else "")
        if key == "total" and vision:
            for part, label in (("tower_weights", "vision weights"), ("tower_activations", "vision activs"),
                                ("image_inputs", "image inputs"), ("tower_lora_state", "vision LoRA")):
                if part in vision and (vision[part] or part != "tower_lora_state"):
                    print(f"  {label:<16} {format_bytes(vision[part]):>12}")
        print(f"  {key.replace('_', ' '):<16} {format_bytes(est[key]):>12}{ratio}")
    if vision:
        print(f"  ({vision['images']} images of {vision['tokens_per_image']} tokens each per step "
              f"(--images-per-row {vision['images_per_row']}): the tower "
              f"{'with LoRA' if vision['tower_lora'] else 'frozen'} in float32 on the NumPy engine; the image "
              f"tokens' activations in the language model lie within its {length} tokens a row)")
        if vision.get("crops"):
            print(f"  (pan-and-scan: each image counted with the most crops, {vision['crops']}; the processor's "
                  f"sentences around them are not counted)")
        if vision.get("images_capped"):
            print(f"  (Qwen3-VL: an image of up to max_pixels would take more; {vision['tokens_per_image']} tokens "
                  f"is what a row of {length} leaves each)")
    for i, stage in enumerate(result.get("stages", ())):
        print(f"stage {i} (layers {stage['layers']}, {stage['in_flight']} micro-batch(es) held): "
              + ", ".join(f"{key.replace('_', ' ')} {format_bytes(stage[key])}"
                          for key in ("weights", "trainable_state", "activations", "logits", "image_inputs", "total")
                          if key in stage))
    if vision and result.get("stages"):
        print("  (the stages' image inputs: each micro-batch's image embeddings and their gradient on the first, "
              "its blocks on every stage, M-RoPE positions and DeepStack features where taken; the tower runs in "
              "the driver's process, on the CPU)")
    print(f"largest activation buffer {format_bytes(largest)}: it must fit the device's max storage binding. "
          f"WebGPU does not report a GPU's memory size: compare the total with yours.")
    return 0


def _vision_estimate(args, model_dir, length: int) -> dict | None:
    """A vision model's tower and projector (float32 weights, the values its forward holds over the step's
    images) and the image tokens per row, which must fit --max-seq-len (stage_images: the images of a row as the
    device takes them); None for a model without images."""
    from pathlib import Path

    from wgpu_train.engines.resources import StageImages
    from wgpu_train.models.vision import (CONNECTOR, ENCODER_MODULES, PROJ, VisionConfig, split_targets,
                                          tensor_shapes, tower_activation_values, tower_parameters)

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if not raw.get("vision_config"):
        return None
    vc = VisionConfig.from_config(raw, str(Path(model_dir) / "config.json"))
    per_row = 1 if args.images_per_row is None else args.images_per_row
    if hasattr(vc, "mrope_section"):
        return _qwen_estimate(args, model_dir, vc, length, per_row)
    if hasattr(vc, "downsample_factor"):
        return _lfm2_estimate(args, model_dir, vc, length, per_row)
    tiles, rows = 1, 0
    if vc.scale_factor:     # SmolVLM: the largest image's tiles, two markers each (three the global one), newlines
        from wgpu_train.data.image_tiles import TileSettings

        tiles, rows = TileSettings.from_folder(model_dir, vc.image_size).most_tiles
    else:                   # Gemma 3 with pan-and-scan: the most crops an image takes, beside it
        from wgpu_train.data.images import ImageSettings

        settings = ImageSettings.from_folder(model_dir, vc.image_size)
        tiles += settings.max_num_crops if settings.pan_and_scan else 0
    per_image = tiles * (vc.mm_tokens_per_image + 2) + (1 + rows + 1 if rows else 1) if vc.scale_factor else \
        tiles * (vc.mm_tokens_per_image + 2)
    tokens = per_row * per_image        # each image's tokens and its begin / end markers
    if tokens >= length:
        raise ConfigError(f"{per_row} image(s) a row take {tokens} tokens, and a row has {length} (--max-seq-len): "
                          f"no room for text")
    language, tower = split_targets(args.lora_targets) if args.method == "lora" else (args.lora_targets, ())
    connector = (CONNECTOR.removeprefix(PROJ),) if vc.scale_factor else ()       # SmolVLM's connector projection
    qwen = [m for m in tower if m not in ENCODER_MODULES + connector]
    if qwen:
        raise ConfigError(f"--lora-targets {args.lora_targets}: {qwen[0]} is not a module of this model's vision "
                          f"tower (its encoder's: fc1, fc2, vision_tower.q_proj, ...; SmolVLM's connector)")
    if tower and not language:
        raise ConfigError(f"--lora-targets {args.lora_targets}: the vision tower's alone; name the language "
                          f"model's too (q_proj, ...), as finetune trains them")
    images = args.batch_size * per_row
    params = tower_parameters(vc)
    return {"tower_parameters": params, "tower_weights": 4 * params, "images": images, "images_per_row": per_row,
            "tokens_per_image": per_image, "image_tokens_per_row": tokens, "tower_lora": bool(tower),
            **_tower_lora_state(args, vc, tensor_shapes(vc), tower),
            "tower_activations": 4 * tower_activation_values(vc, images * tiles, bool(tower)),
            "language_targets": language, "stage_images": StageImages(per_row * tiles * vc.mm_tokens_per_image),
            "crops": 0 if vc.scale_factor else tiles - 1}


def _qwen_estimate(args, model_dir, vc, length: int, per_row: int) -> dict:
    """_vision_estimate's for Qwen3-VL: each image as large as its processor makes one (max_pixels), capped to
    what a row leaves it; the tower over the step's images at once (frozen, or with LoRA: its activations kept for
    the backward); its stage_images with the DeepStack features (and their gradients, which the backward gathers)
    and every token's M-RoPE positions."""
    from wgpu_train.data.qwen_images import QwenImageSettings
    from wgpu_train.engines.resources import StageImages
    from wgpu_train.models.qwen3_vl import tensor_shapes, tower_activation_values, tower_parameters
    from wgpu_train.models.vision import CONNECTOR, ENCODER_MODULES, PROJ, split_targets

    settings = QwenImageSettings.from_folder(model_dir, vc)
    block = settings.factor ** 2
    largest, smallest = settings.max_pixels // block, -(-settings.min_pixels // block)   # merged patches
    room = (length - 1) // max(per_row, 1) - 2      # an image's tokens and its begin / end markers, and a text token
    if per_row and room < smallest:
        raise ConfigError(f"{per_row} image(s) a row take at least {per_row * (smallest + 2)} tokens, and a row has "
                          f"{length} (--max-seq-len): no room for text")
    merged = min(largest, room)
    language, tower = split_targets(args.lora_targets) if args.method == "lora" else (args.lora_targets, ())
    siglip = [m for m in tower if m in ENCODER_MODULES or m == CONNECTOR.removeprefix(PROJ)]
    if siglip:
        raise ConfigError(f"--lora-targets {args.lora_targets}: {siglip[0]} is not a module of {vc.name}'s vision "
                          f"tower (qkv, attn.proj, linear_fc1, linear_fc2, merger.linear_fc1, ...)")
    if tower and not language:
        raise ConfigError(f"--lora-targets {args.lora_targets}: the vision tower's alone; name the language "
                          f"model's too (q_proj, ...), as finetune trains them")
    images = args.batch_size * per_row
    params = tower_parameters(vc)
    return {"tower_parameters": params, "tower_weights": 4 * params, "images": images, "images_per_row": per_row,
            "tokens_per_image": merged + 2, "image_tokens_per_row": per_row * (merged + 2), "tower_lora": bool(tower),
            **_tower_lora_state(args, vc, tensor_shapes(vc), tower),
            "tower_activations": 4 * tower_activation_values(vc, images, merged * vc.merge_unit, bool(tower)),
            "images_capped": merged < largest, "language_targets": language,
            "stage_images": StageImages(per_row * merged, len(vc.deepstack_indexes), mrope=True)}


def _lfm2_estimate(args, model_dir, vc, length: int, per_row: int) -> dict:
    """_vision_estimate's for LFM2-VL: each image as large as its processor makes one (max_tiles tiles and the
    thumbnail, marked); the tower a tile at a time, with LoRA on it every tile's activations kept; its
    stage_images."""
    from wgpu_train.data.lfm2_images import Lfm2ImageSettings
    from wgpu_train.engines.resources import StageImages
    from wgpu_train.models.lfm2_vl import tensor_shapes, tower_activation_values, tower_parameters
    from wgpu_train.models.vision import ENCODER_MODULES, split_targets

    settings = Lfm2ImageSettings.from_folder(model_dir, vc.patch_size, vc.downsample_factor)
    tiles, per_image = settings.largest
    # the tokens the embeddings replace: the image's but its markers (start and end, and each tile's)
    embedded = per_image - int(settings.use_image_special_tokens) * (2 + (tiles if settings.do_image_splitting else 0))
    tokens = per_row * per_image
    if tokens >= length:
        raise ConfigError(f"{per_row} image(s) a row take {tokens} tokens, and a row has {length} (--max-seq-len): "
                          f"no room for text")
    language, tower = split_targets(args.lora_targets) if args.method == "lora" else (args.lora_targets, ())
    other = [m for m in tower if m not in ENCODER_MODULES]
    if other:
        raise ConfigError(f"--lora-targets {args.lora_targets}: {other[0]} is not a module of LFM2-VL's vision tower "
                          f"(its encoder's: fc1, fc2, vision_tower.q_proj, ...)")
    if tower and not language:
        raise ConfigError(f"--lora-targets {args.lora_targets}: the vision tower's alone; name the language "
                          f"model's too (q_proj, ...), as finetune trains them")
    images, params = args.batch_size * per_row, tower_parameters(vc)
    patches = max((settings.tile_size // vc.patch_size) ** 2 if settings.do_image_splitting else 0,
                  settings.max_image_tokens * vc.downsample_factor ** 2)
    return {"tower_parameters": params, "tower_weights": 4 * params, "images": images, "images_per_row": per_row,
            "tokens_per_image": per_image, "image_tokens_per_row": tokens, "tower_lora": bool(tower),
            **_tower_lora_state(args, vc, tensor_shapes(vc), tower),
            "tower_activations": 4 * tower_activation_values(vc, patches, images * per_image,
                                                             images * tiles if tower else 0),
            "language_targets": language, "stage_images": StageImages(per_row * embedded)}


def _tower_lora_state(args, vc, shapes: dict, modules) -> dict:
    """The tower's LoRA on the linear modules (of `shapes`, the tower's {our name: shape}) that split_targets'
    `modules` select: its parameters (at --lora-rank, or --lora-rank-pattern's on their full names) and their
    state in float32 on either engine: the tensors, their gradients and AdamW's two moments."""
    from wgpu_train.adapters.layout import parse_pattern
    from wgpu_train.adapters.tower_scales import tower_scales
    from wgpu_train.models.vision import selects

    paths = [n.removesuffix(".weight") for n, shape in shapes.items() if n.endswith(".weight") and len(shape) == 2
             and any(selects(n.removesuffix(".weight"), m) for m in modules)]
    ranks = tower_scales(paths, vc, args.lora_rank, 1.0, rank_pattern=parse_pattern(args.lora_rank_pattern,
                                                                                     "--lora-rank-pattern"))
    n = sum(ranks[p][0] * sum(shapes[p + ".weight"]) for p in paths)
    return {"tower_lora_parameters": n, "tower_lora_state": 4 * 4 * n}


def run_precision(precision: str, backend: str, device, cfg) -> tuple:
    """(the precision a finetune with these --precision, --backend and --device runs, why), found without timing
    anything: as given, else what auto resolves to on the engine the run takes here. The NumPy engine runs fp32,
    and so does a CPU adapter: where the only adapters are CPUs, backend auto's choice between the two does not
    change it. A GPU runs bf16 (fp32 for a model of odd widths); so does --backend wgpu planned on a machine
    without an adapter."""
    from wgpu_train.engines.loading import precision_choice
    from wgpu_train.engines.protocol import Precision
    from wgpu_train.engines.resources import choose_adapter, devices

    if Precision.parse(precision).resolved or backend == "numpy":
        return precision_choice(precision, "numpy", cfg=cfg)
    if not devices():
        if backend == "auto":
            return precision_choice(precision, "numpy", cfg=cfg)
        chosen, why = precision_choice(precision, "wgpu", cfg=cfg)
        return chosen, f"{why}; no WebGPU adapter here, so a GPU's"
    adapter = choose_adapter(device)
    cpu = adapter.adapter_type == "CPU"
    chosen, why = precision_choice(precision, "wgpu", cpu, cfg)
    if cpu and backend == "auto":
        why = "auto: the only WebGPU adapters here are CPUs; the NumPy engine and a CPU adapter both run fp32"
    return chosen, why


def _stage_estimates(args, cfg, length: int, lora, base: str, embed: str, precision: str, images=None) -> list:
    """Each pipeline stage's memory_report categories (with its layers and the micro-batches it holds at once),
    the stages balanced as finetune balances them; images (a vision model's StageImages): the image inputs each
    stage holds (image_inputs), counted, not balanced (finetune's split leaves them out)."""
    from wgpu_train.engines.resources import balanced_stages, stage_memory

    micro = args.pipeline_micro_batches
    if micro < 1:
        raise ConfigError(f"--pipeline-micro-batches must be at least 1, got {micro}")
    plan = balanced_stages(cfg, args.pipeline_stages or 0, args.stage_layers, args.batch_size, length, lora,
                           args.method, base, embed, args.gradient_checkpointing, precision, micro,
                           args.pipeline_schedule)
    return stage_memory(cfg, plan, args.batch_size, length, lora, args.method, base, embed,
                        args.gradient_checkpointing, None, precision, micro, args.pipeline_schedule, images)


def register(sub):
    from wgpu_train.engines.shared.quant import BASE_CHOICES, EMBED_CHOICES
    from wgpu_train.engines.backend_choice import BACKENDS
    from wgpu_train.engines.protocol import PRECISION_CHOICES
    from wgpu_train.training.config import TrainConfig

    d = TrainConfig()
    p = add_parser(sub, "memory", "estimate the GPU memory a fine-tuning run needs, from the model's config.json "
                                   "alone (no weights are read)")
    p.add_argument("--model", default=None, metavar="DIR", help="Hugging Face model folder (default: the embedded model)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"rows per micro-batch (default: {d.batch_size})")
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len,
                   help=f"tokens per row, at most the model's positions (default: {d.max_seq_len})")
    p.add_argument("--method", default=d.method, choices=("lora", "full"), help=f"(default: {d.method})")
    p.add_argument("--lora-rank", type=int, default=d.lora_rank, help=f"(default: {d.lora_rank})")
    p.add_argument("--lora-targets", default=d.lora_targets, help=f"(default: {d.lora_targets})")
    p.add_argument("--lora-target-parameters", default=None, help="a mixture of experts' expert tensors with a LoRA "
                   "pair per expert (PEFT's target_parameters; all-linear takes them)")
    p.add_argument("--lora-layers", default=None, help="the layers with LoRA, as in finetune (default: every layer)")
    p.add_argument("--lora-rank-pattern", default=None, help="per-module ranks, as in finetune")
    p.add_argument("--dora", action="store_true", help="plan for DoRA (its magnitudes and their buffers)")
    p.add_argument("--modules-to-save", default=None, help="modules trained in full beside LoRA, as in finetune")
    p.add_argument("--ensure-weight-tying", action="store_true", help="one tied copy, as in finetune")
    p.add_argument("--base-dtype", default=d.base_dtype, choices=BASE_CHOICES, help=f"(default: {d.base_dtype})")
    p.add_argument("--embed-dtype", default=d.embed_dtype, choices=EMBED_CHOICES, help=f"(default: {d.embed_dtype})")
    p.add_argument("--gradient-checkpointing", action="store_true", help="plan for gradient checkpointing")
    p.add_argument("--precision", default=d.precision, choices=PRECISION_CHOICES,
                   help=f"activations stored in fp32, bf16 or f16, as in finetune; auto: what the run takes on the "
                        f"engine --backend and --device choose here, found without timing: bf16 on a GPU (fp32 "
                        f"for odd widths), fp32 on the NumPy engine and on CPU adapters (default: {d.precision})")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="the engine the run will use, as finetune's --backend; it decides what --precision auto "
                        "means (default: auto)")
    p.add_argument("--device", default=None,
                   help="the WebGPU adapter the run will use, as finetune's --device (default: the one it picks)")
    p.add_argument("--pipeline-stages", type=whole(1), default=None, metavar="S",
                   help="also each of S pipeline stages' estimate, balanced as finetune balances them")
    p.add_argument("--stage-layers", default=None, help="the stages' layers by hand, as in finetune (0-11,12-23)")
    p.add_argument("--pipeline-micro-batches", type=int, default=1, metavar="M",
                   help="micro-batches per step through the stages (default: 1)")
    p.add_argument("--pipeline-schedule", default=d.pipeline_schedule, choices=("gpipe", "1f1b"),
                   help=f"how many micro-batches a stage holds at once: gpipe all, 1f1b at most the stages from it "
                        f"on (default: {d.pipeline_schedule})")
    p.add_argument("--images-per-row", type=whole(0), default=None, metavar="N",
                   help="a vision model's images in each row: the tower's activations over them and their tokens "
                        "within --max-seq-len (default: 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_memory)
