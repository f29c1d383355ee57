"""GRPO's prompts with images, as TRL 1.16's GRPOTrainer takes them: a conversational `prompt` beside an `images`
column (a first user turn given as a string takes the images before its text), every other column kept for the
rewards; tokenized as the processor's apply_chat_template(add_generation_prompt=True) makes them, each image's
placeholder expanded. Qwen3-VL's videos too, in sft's record shape (TRL 1.16's GRPO takes none): {"type": "video"}
parts beside a `videos` column."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from wgpu_train.data.prompt_records import RESERVED_COLUMNS, PromptRecord
from wgpu_train.data.prompt_tokenize import PromptExample, PromptStats
from wgpu_train.data.vision_records import place_images, vision_chat_ids, vision_messages
from wgpu_train.errors import DataError
from wgpu_train.formats.tokenizer import Tokenizer


def vision_prompt_record(obj, where: str, as_video=None) -> PromptRecord:
    """One record with images -> a PromptRecord whose prompt lists the image parts and whose `images` are the
    record's (with its `videos` through as_video(value, where), the model's span's, in the order of their parts;
    None refuses them); its other columns (images too) go to the reward functions. A prompt that is no message
    list or ends in no user turn, and a placeholder / image count mismatch, refused in one line."""
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), list) or not obj["prompt"]:
        raise DataError(f'{where}: records with images need "prompt" as a non-empty list of messages (TRL\'s GRPO '
                        f"takes conversational prompts with images)")
    images = obj.get("images", [obj["image"]] if obj.get("image") is not None else []) or []
    images = images if isinstance(images, list) else [images]
    prompt = place_images(obj["prompt"], len(images))
    if not isinstance(prompt[-1], dict) or prompt[-1].get("role") != "user":
        raise DataError(f"{where}: the prompt must end with a user turn")
    prompt, images = vision_messages({"messages": prompt, "images": images, "videos": obj.get("videos") or []},
                                     where, as_video)
    columns = {k: v for k, v in obj.items() if k not in ("prompt", "image", "completion_ids")}
    clash = [k for k in RESERVED_COLUMNS if k in columns]
    if clash:
        raise DataError(f'{where}: column "{clash[0]}" is named as an argument reward functions get from the '
                        f"trainer; rename that column")
    return PromptRecord(prompt, columns, where, list(images))


def tokenize_vision_prompts(tokenizer: Tokenizer, records: Sequence[PromptRecord],
                            span) -> tuple[list[PromptExample], PromptStats]:
    """Each prompt's ids: the chat template's generation prompt, each placeholder expanded (span.expansion of its
    image)."""
    stats, out = PromptStats(n_records=len(records)), []
    for record in records:
        try:
            ids = vision_chat_ids(tokenizer, record.prompt, len(record.images), span, record.images)
        except DataError as e:
            raise DataError(f"{record.source}: {e}") from None
        out.append(PromptExample(np.asarray(ids, np.int32), record))
        stats.n_tokens += len(ids)
        stats.max_tokens = max(stats.max_tokens, len(ids))
    stats.n_examples = len(out)
    return out, stats
