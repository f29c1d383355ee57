"""Preference records with images -> tokens, as TRL 1.16's DPOTrainer takes them (DataCollatorForVisionPreference):
conversational `prompt` / `chosen` / `rejected` (or KTO's `completion` and `label`) beside an `images` column, the
prompt's image placeholders expanded as the processor expands them, each row (chosen, rejected) carrying the prompt's
images; the image tokens sit in the prompt, never in the loss. Qwen3-VL's videos too, in sft's record shape (TRL
1.16's collators take none): {"type": "video"} parts in the prompt beside a `videos` column, carried as images are."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from wgpu_train.data.preference_records import PreferenceRecord, UnpairedRecord, unpair_preferences
from wgpu_train.data.preference_tokenize import PreferenceExample, PreferenceStats, UnpairedExample
from wgpu_train.data.vision_records import expand_placeholders, place_images, vision_messages
from wgpu_train.errors import ConfigError, DataError
from wgpu_train.formats.tokenizer import Tokenizer


def _messages(value, key: str, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise DataError(f'{where}: records with images need "{key}" as a non-empty list of messages')
    return value


def vision_preference_record(obj, where: str, as_video=None) -> PreferenceRecord | UnpairedRecord:
    """One TRL vision preference record ({"images", "prompt", "chosen", "rejected"}, or KTO's {"images", "prompt",
    "completion", "label"}; a single `image` too; `videos`, each through as_video(value, where), the model's
    span's, None refusing them) -> a PreferenceRecord / UnpairedRecord with its images (and videos, in the order
    of their parts): the prompt's placeholders counted against them, the answers text only; an implicit prompt,
    string parts and a placeholder / image count mismatch refused in one line."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a record must be a JSON object")
    images = obj.get("images", [obj["image"]] if obj.get("image") is not None else []) or []
    images = images if isinstance(images, list) else [images]
    if "prompt" not in obj:
        raise DataError(f'{where}: records with images need an explicit "prompt" (as TRL\'s vision collator '
                        f"does)")
    prompt = place_images(_messages(obj["prompt"], "prompt", where), len(images))
    if prompt[-1].get("role") != "user":
        raise DataError(f"{where}: the prompt must end with a user turn with images")
    prompt, images = vision_messages({"messages": prompt, "images": images, "videos": obj.get("videos") or []},
                                     where, as_video)
    answers = ("completion",) if "label" in obj else ("chosen", "rejected")
    parts = []
    for key in answers:
        answer, _ = vision_messages({"messages": _messages(obj.get(key), key, where), "images": []},
                                    f"{where}: {key}")
        if any(m["role"] != "assistant" for m in answer):
            raise DataError(f'{where}: "{key}" must hold assistant messages only')
        parts.append(answer)
    if "label" in obj:
        if not isinstance(obj["label"], bool):
            raise DataError(f'{where}: field "label" must be true or false, got {obj["label"]!r}')
        return UnpairedRecord(prompt, parts[0], obj["label"], where, images=list(images))
    return PreferenceRecord(prompt, *parts, source=where, images=list(images))


def vision_preference_records(rows: Sequence, unpaired: bool, file: str, as_video=None) -> list:
    """A vision file's rows as preference records (unpaired: KTO's, pairs unpaired as TRL's KTO unpairs them);
    as_video: vision_preference_record's."""
    records = [vision_preference_record(r, f"{file}:{k + 1}", as_video) for k, r in enumerate(rows)]
    kinds = {isinstance(r, UnpairedRecord) for r in records}
    if len(kinds) > 1:
        raise DataError(f"{file}: records with and without a label mixed")
    if unpaired and kinds == {False}:
        return unpair_preferences(records)
    if not unpaired and kinds == {True}:
        raise DataError(f"{file}: unpaired records (with a label) are KTO's data, not pairs")
    return records


def _common_text(texts: Sequence[str]) -> str:
    n = min(len(t) for t in texts)
    for i in range(n):
        if any(t[i] != texts[0][i] for t in texts):
            return texts[0][:i]
    return texts[0][:n]


def _tokenize(tokenizer: Tokenizer, span, prompt: list, answers: Sequence[list], images: list) -> tuple:
    """(prompt ids, [answer ids]) as TRL's vision collator makes them: the prompt's text (the chat template with
    the generation prompt, cut to where it and every prompt + answer agree, as TRL's apply_chat_template cuts it)
    with each image placeholder expanded, and each answer's text after it, tokenized apart (the processor's
    add_special_tokens=False)."""
    prompt_text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    whole = [tokenizer.apply_chat_template(list(prompt) + list(a)) for a in answers]
    prompt_text = _common_text([prompt_text, *whole])
    if any(span.placeholder in w[len(prompt_text):] for w in whole):
        raise DataError("an answer holds an image placeholder: images go in the prompt")
    expanded = expand_placeholders(prompt_text, span, [span.expansion(im) for im in images])
    return tokenizer.encode(expanded), [tokenizer.encode(w[len(prompt_text):]) for w in whole]


def tokenize_vision_preferences(tokenizer: Tokenizer, records: Sequence, span, max_length: int | None,
                                image_ids: set, truncation_mode: str = "keep_start",
                                max_prompt_length: int | None = None) -> tuple[list, PreferenceStats, int]:
    """Preference records with images (vision_preference_records) -> (PreferenceExample or UnpairedExample each
    with its images, PreferenceStats, rows cut inside or before an image). A pair whose prompt fills max_length
    is dropped (as the text path drops it); one whose rows a keep_start cut would end inside or before an image
    is dropped and counted apart (an image is never split); keep_end and max_prompt_length, which cut the
    prompt's start (TRL refuses keep_end for vision), refused."""
    if truncation_mode != "keep_start":
        raise ConfigError("--truncation-mode keep_end is not supported with images (it cuts the prompt's images; "
                          "TRL refuses it too)")
    if max_prompt_length is not None:
        raise ConfigError("--max-prompt-length is not supported with images (it cuts the prompt's images)")
    unpaired = bool(records) and isinstance(records[0], UnpairedRecord)
    stats = PreferenceStats("records" if unpaired else "pairs", n_records=len(records))
    out, cut = [], 0
    for record in records:
        answers = (record.completion,) if unpaired else (record.chosen, record.rejected)
        try:
            prompt_ids, answer_ids = _tokenize(tokenizer, span, record.prompt, answers, record.images)
        except DataError as e:
            raise DataError(f"{record.source}: {e}") from None
        in_image = [i for i, t in enumerate(prompt_ids) if t in image_ids]
        if max_length is not None and in_image and in_image[-1] >= max_length:
            cut += 1
            continue
        if max_length is not None and len(prompt_ids) >= max_length:
            stats.n_dropped += 1
            continue
        truncated = max_length is not None and len(prompt_ids) + max(map(len, answer_ids)) > max_length
        stats.n_truncated += int(truncated)
        prompt_ids, ids = np.asarray(prompt_ids, np.int32), [np.asarray(a, np.int32) for a in answer_ids]
        if unpaired:
            stats.n_desirable += int(record.label)
            stats.n_undesirable += int(not record.label)
            out.append(UnpairedExample(prompt_ids, ids[0], bool(record.label), truncated, max_length,
                                       images=list(record.images)))
        else:
            out.append(PreferenceExample(prompt_ids, *ids, truncated, max_length, images=list(record.images)))
    stats.n_examples = len(out)
    return out, stats, cut


def with_images(record) -> dict | None:
    """A preference record with images as the vision record of its prompt and chosen (desirable) answer, for
    exact match (None for an undesirable KTO record)."""
    answer = getattr(record, "chosen", None)
    if answer is None:
        if not record.label:
            return None
        answer = record.completion
    return {"messages": list(record.prompt) + list(answer), "images": list(record.images)}

