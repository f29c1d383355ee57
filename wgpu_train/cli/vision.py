"""`generate --image` / `--video`: an answer to a prompt about images (and Qwen3-VL's videos), from a vision-language model (Gemma 3, SmolVLM, Qwen3-VL;
the tower on the CPU, the language model on --backend's engine), with the adapter of a run if given; and the
VisionModel over a model `chat` and `serve` loaded."""
from __future__ import annotations

import sys

from wgpu_train.errors import ConfigError


def generate_with_images(args, model_dir, adapter) -> int:
    """Print the greedy answer to --prompt about the --image files and --video clips (in order, before the
    prompt's text)."""
    from wgpu_train.data.vision_records import vision_prompt_ids
    from wgpu_train.engines.vision_model import load_vision_model
    from wgpu_train.formats.tokenizer import load_tokenizer

    if args.temperature:
        raise ConfigError("--image generates greedily for now (--temperature 0)")
    vm = load_vision_model(model_dir, backend=args.backend, device=args.device)
    if adapter is not None:
        vm.load_adapter(adapter)
    tok = load_tokenizer(model_dir)
    images, span = args.image or [], vm.image_span(tok)
    if args.video and not hasattr(span, "as_video"):
        raise ConfigError("--video takes a Qwen3-VL or Qwen3.5 model")
    videos = [span.as_video(v, f"--video {v}") for v in args.video or ()]
    pixels = vm.pixel_values([*images, *videos], "--image")
    ids = vision_prompt_ids(tok, args.prompt, len(images), span, args.system, images, videos)
    room = vm.model.config.max_position_embeddings - len(ids)
    if room < 1:
        raise ConfigError(f"the prompt and its images take {len(ids)} tokens, more than the model's "
                          f"{vm.model.config.max_position_embeddings} positions")
    out = vm.generate(ids, pixels, min(args.max_new_tokens or 256, room), tuple(tok.stop_token_ids))
    answer = [t for t in out if t not in set(tok.stop_token_ids)]
    sys.stdout.write(tok.decode(answer) + "\n")
    return 0


def vision_of(model, model_dir):
    """The model's VisionModel (its vision tower and projector read from model_dir) where the folder is a
    vision-language model (Gemma 3, SmolVLM) loaded on an engine that takes images (set_images: both engines and
    their pipeline stages), else None (it takes no images)."""
    import json
    from pathlib import Path

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if not raw.get("vision_config") or not hasattr(model.engine, "set_images"):
        return None
    from wgpu_train.engines.vision_model import attach_vision

    return attach_vision(model, model_dir)
