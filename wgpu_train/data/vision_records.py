"""Records with images -> tokens: TRL's vision format (messages whose content lists {"type": "image"} and
{"type": "text"} parts, plus an `images` column; Qwen3-VL's {"type": "video"} parts and a `videos` column too),
the chat template's image placeholders expanded as the processor expands them (Gemma 3's ImageSpan: boi, image
tokens x mm_tokens_per_image, eoi; SmolVLM's tiles: data/image_tiles.TiledImageSpan), the loss on the assistant's tokens only; tokenized records are
batching.Example rows that carry their images."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from wgpu_train.data.batching import Example
from wgpu_train.data.image_tiles import TiledImageSpan, TileSettings
from wgpu_train.data.images import ImageSettings
from wgpu_train.data.lfm2_images import Lfm2ImageSettings, Lfm2ImageSpan
from wgpu_train.data.qwen_images import QwenImageSettings, QwenImageSpan
from wgpu_train.data.records import IGNORE_INDEX, ROLES
from wgpu_train.data.sources import DataSplits, hold_out
from wgpu_train.data.tokenize import assistant_spans, in_span
from wgpu_train.errors import DataError
from wgpu_train.formats.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class ImageSpan:
    """How an image stands in the text: the chat template's placeholder (Gemma 3's boi token, as the processor
    reads it), and the run it becomes: boi, `count` image tokens, eoi, set off by blank lines; with pan-and-scan
    (`settings`, data/images.ImageSettings, turns it on) an image with crops becomes Gemma3Processor's sentences
    around the original's run and one run per crop."""

    boi: str
    image: str
    eoi: str
    count: int
    settings: ImageSettings | None = None

    @property
    def expanded(self) -> str:
        return f"\n\n{self.boi}{self.image * self.count}{self.eoi}\n\n"

    # the span protocol, which data/image_tiles.TiledImageSpan (SmolVLM's) follows too
    @property
    def placeholder(self) -> str:
        """What the chat template writes for an image."""
        return self.boi

    @property
    def token_names(self) -> tuple:
        """The tokens of an image's run (never trained)."""
        return self.boi, self.image, self.eoi

    def expansion(self, image=None) -> str:
        """The text one image takes (without pan-and-scan the same for every image; with it, the image's size
        gives its crops: None is refused then)."""
        if self.settings is None or not self.settings.pan_and_scan:
            return self.expanded
        if image is None:
            raise DataError("with pan-and-scan (do_pan_and_scan) each image's size gives its crops: pass the images")
        crops = self.settings.n_crops(image)
        if not crops:
            return self.expanded
        return (f"Here is the original image {self.expanded} and here are some crops to help you see better "
                + " ".join([self.expanded] * crops))

    @classmethod
    def from_ids(cls, tokenizer: Tokenizer, boi_id: int, image_id: int, eoi_id: int, count: int,
                 settings: ImageSettings | None = None) -> ImageSpan:
        """From the model's token ids, named as the tokenizer names them (settings: the image processor's, which
        may turn pan-and-scan on); a tokenizer without them refused."""
        if min(boi_id, image_id, eoi_id) < 0:
            raise DataError(f"the model's config.json gives no image token ids (boi {boi_id}, image {image_id}, "
                            f"eoi {eoi_id})")
        names = [tokenizer.backend.id_to_token(i) for i in (boi_id, image_id, eoi_id)]
        if None in names:
            raise DataError(f"the tokenizer has no token for the image ids {boi_id}, {image_id}, {eoi_id} of "
                            f"the model's config")
        return cls(*names, count, settings)


def is_vision_data(path) -> bool:
    """Whether --data is TRL's vision records: one local JSONL (or .json array) file whose first record has an
    `images` (or `image`, or `videos`) field (a folder, glob or hub dataset of them is refused where its records are
    read)."""
    path = Path(path) if isinstance(path, (str, Path)) else None
    if path is None or not path.is_file() or path.suffix not in (".jsonl", ".json"):
        return False
    with path.open(encoding="utf-8") as f:
        text = f.read(1 << 20).lstrip()
    first = text[1:] if text.startswith("[") else text
    try:
        record, _ = json.JSONDecoder().raw_decode(first.lstrip())
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and any(k in record for k in ("images", "image", "videos"))


def image_span(tokenizer: Tokenizer, vision, tiles=None) -> ImageSpan | TiledImageSpan | QwenImageSpan:
    """The span of a vision model's images in `tokenizer`'s text: vision its models/vision.VisionConfig; tiles
    SmolVLM's TileSettings, which its span expands each image by, Qwen3-VL's QwenImageSettings, or Gemma 3's
    ImageSettings (or None: no pan-and-scan)."""
    if isinstance(tiles, QwenImageSettings):       # Qwen3-VL's: <|image_pad|> once per merged patch
        return QwenImageSpan.from_tokenizer(tokenizer, vision, tiles)
    if isinstance(tiles, Lfm2ImageSettings):       # LFM2-VL's: each tile's tokens, then the thumbnail's
        return Lfm2ImageSpan.from_tokenizer(tokenizer, vision.image_token_id, tiles)
    if vision.scale_factor:
        return TiledImageSpan.from_tokenizer(tokenizer, vision.image_token_id, vision.mm_tokens_per_image, tiles)
    return ImageSpan.from_ids(tokenizer, vision.boi_token_id, vision.image_token_id, vision.eoi_token_id,
                              vision.mm_tokens_per_image, tiles if isinstance(tiles, ImageSettings) else None)


def model_image_span(tokenizer: Tokenizer, vision, folder) -> ImageSpan | TiledImageSpan:
    """image_span of the model in `folder` (its preprocessor_config.json gives SmolVLM's tiles, Gemma 3's
    pan-and-scan)."""
    if hasattr(vision, "mrope_section"):           # Qwen3-VL's (models/qwen3_vl.Qwen3VLVision)
        return image_span(tokenizer, vision, QwenImageSettings.from_folder(folder, vision))
    if hasattr(vision, "downsample_factor"):       # LFM2-VL's (models/lfm2_vl.Lfm2VlVision)
        return image_span(tokenizer, vision, Lfm2ImageSettings.from_folder(folder, vision.patch_size,
                                                                           vision.downsample_factor))
    return image_span(tokenizer, vision, (TileSettings if vision.scale_factor else ImageSettings).from_folder(
        folder, vision.image_size))


def read_vision_records(path) -> list[dict]:
    """The records of a vision JSONL (or JSON array) file, each image path (and video path, or frame path of a
    video) made relative to the file's folder."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        rows = json.loads(text) if text.lstrip().startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON: {e}") from None
    for row in rows:
        if isinstance(row, dict) and "images" not in row and "image" in row:
            row["images"] = [row.pop("image")]
        if isinstance(row, dict) and isinstance(row.get("images"), list):
            row["images"] = [str(path.parent / im) if isinstance(im, str) else im for im in row["images"]]
        if isinstance(row, dict) and isinstance(row.get("videos"), list):
            row["videos"] = [str(path.parent / v) if isinstance(v, str) else
                             [str(path.parent / f) if isinstance(f, str) else f for f in v] if isinstance(v, list)
                             else v for v in row["videos"]]
    return rows


def vision_splits(path, valid_split: float, seed: int) -> DataSplits:
    """A vision file's records as the run's splits: a fraction valid_split of them held out as valid, as
    sources.resolve_data holds out a file without a validation split (format "vision")."""
    records = read_vision_records(path)
    if not records:
        raise DataError(f"{path}: empty file")
    train, valid = hold_out(records, valid_split, seed)
    return DataSplits(train, valid, [], "vision", 0, {"train": str(path)}, bool(valid))


def vision_messages(obj: Any, where: str = "record", as_video=None) -> tuple[list[dict], list]:
    """A TRL vision record ({"messages": [...], "images": [...]}, or one "image"; "videos" too) -> (messages for
    the chat template, its images and videos in the order of their parts: each video through as_video(value,
    where), the span's (None: videos refused)): text-only assistant turns as strings, user turns keeping their
    parts; a count of image (video) parts that is not the images' (videos'), a tools column, tool calls and
    tool results refused in one line."""
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
        raise DataError(f'{where}: a vision record needs a non-empty "messages" list')
    images = obj.get("images", [obj["image"]] if obj.get("image") is not None else []) or []
    if not isinstance(images, list):       # TRL also reads a single `image` column
        images = [images]
    videos = obj.get("videos") or []
    if not isinstance(videos, list):
        raise DataError(f'{where}: "videos" must be a list of videos')
    if videos and as_video is None:
        raise DataError(f"{where}: videos are taken only by supervised records of Qwen3-VL and Qwen3.5 (not by "
                        f"this model or objective)")
    if obj.get("tools"):
        raise DataError(f'{where}: a "tools" column is not supported in records with images yet')
    out, n_parts, n_videos, media = [], 0, 0, []
    for k, m in enumerate(obj["messages"]):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if role not in ROLES:
            raise DataError(f"{where}: message {k} has role {role!r}; roles must be {', '.join(ROLES[:-1])} or "
                            f"{ROLES[-1]}")
        if role == "tool" or m.get("tool_calls"):
            raise DataError(f"{where}: message {k}: tool calls and tool results are not supported in records "
                            f"with images yet")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise DataError(f"{where}: message {k}'s content must be a string or a list of parts")
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("image", "video", "text") or (kind == "text" and not isinstance(part.get("text"), str)):
                raise DataError(f"{where}: message {k} has a content part {part!r}; parts are "
                                f'{{"type": "image"}}, {{"type": "video"}} or {{"type": "text", "text": ...}}')
            if kind == "image":
                media.append(images[n_parts] if n_parts < len(images) else None)
                n_parts += 1
            elif kind == "video":
                media.append(as_video(videos[n_videos], f"{where}: video {n_videos}")
                             if n_videos < len(videos) and as_video is not None else None)
                n_videos += 1
        if role == "assistant" and all(p["type"] == "text" for p in content):
            out.append({"role": role, "content": "".join(p["text"] for p in content)})
        else:
            out.append({"role": role, "content": [dict(p) for p in content]})
    if n_parts != len(images):
        raise DataError(f"{where}: {n_parts} image placeholders for {len(images)} images")
    if n_videos != len(videos):
        raise DataError(f"{where}: {n_videos} video placeholders for {len(videos)} videos")
    return out, media


def place_images(prompt: list, n_images: int) -> list:
    """A prompt's messages as TRL's prepare_multimodal_messages lays them out: a first user turn whose content
    is a string takes the images' placeholders before its text (records that place them in parts keep theirs)."""
    out, placed = [], False
    for m in prompt:
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str) and not placed:
            m = {**m, "content": [{"type": "image"}] * n_images + [{"type": "text", "text": m["content"]}]}
            placed = True
        out.append(m)
    return out


def _shifted(offset: int, at: Sequence[int], grow: Sequence[int]) -> int:
    """A character offset of the rendered text in the expanded text (the placeholder at at[i] grows by grow[i])."""
    return offset + sum(g for b, g in zip(at, grow) if b < offset)


def placeholders(text: str, span) -> list:
    """(offset, placeholder) of each image placeholder in the rendered text, and each video's where the span
    takes videos (Qwen3-VL's video_placeholder), in order."""
    marks = [span.placeholder, *([span.video_placeholder] if getattr(span, "video", "") else [])]
    return [(m.start(), m.group()) for m in re.finditer("|".join(map(re.escape, marks)), text)]


def expand_placeholders(text: str, span, expansions: Sequence[str]) -> str:
    """The rendered text with its i-th image (or video) placeholder replaced by expansions[i]; a count that
    differs from the placeholders' refused in one line."""
    at = placeholders(text, span)
    if len(at) != len(expansions):
        raise DataError(f"the chat template wrote {len(at)} image placeholders for {len(expansions)} images")
    out, last = [], 0
    for (pos, mark), e in zip(at, expansions):
        out += [text[last:pos], e]
        last = pos + len(mark)
    return "".join(out) + text[last:]


def tokenize_vision_example(tokenizer: Tokenizer, messages: list[dict], images: list, span,
                            max_seq_len: int) -> Example | str | None:
    """Tokenize one record's messages (vision_messages) with its images: the chat template's text, each
    placeholder expanded (`span`: an ImageSpan, or SmolVLM's image_tiles.TiledImageSpan, whose expansion depends
    on the image), the assistant turns trained. Longer than max_seq_len: truncated after its last image, or "cut"
    when the cut falls inside or before one (the row is dropped: an image is never split, nor a record's images
    parted from it); None when no trained token survives."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    spans = [(s, e) for _, s, e in assistant_spans(tokenizer, messages, text, None)]
    marks = placeholders(text, span)
    at = [pos for pos, _ in marks]
    expansions = [span.expansion(im) for im in images] if len(at) == len(images) else []
    expanded = expand_placeholders(text, span, expansions)
    grow = [len(e) - len(mark) for e, (_, mark) in zip(expansions, marks)]
    spans = [(_shifted(s, at, grow), _shifted(e, at, grow)) for s, e in spans]
    ids, offsets = tokenizer.encode_with_offsets(expanded)
    image_ids = {tokenizer.token_to_id(t) for t in span.token_names} - {None}
    labels = [t if t not in image_ids and any(in_span(a, b, s, e) for s, e in spans) else IGNORE_INDEX
              for t, (a, b) in zip(ids, offsets)]
    ids, labels = np.asarray(ids, np.int32), np.asarray(labels, np.int64)
    truncated = len(ids) > max_seq_len
    if truncated:
        in_image = np.flatnonzero(np.isin(ids, list(image_ids)))
        if len(in_image) and in_image[-1] >= max_seq_len:       # the last image's run cut, or left out
            return "cut"
        ids, labels = ids[:max_seq_len], labels[:max_seq_len]
    if not (labels[1:] != IGNORE_INDEX).any():
        return None
    return Example(ids, labels, truncated, list(images))


@dataclasses.dataclass
class VisionStats:
    """What tokenizing a vision dataset did: records, examples kept, rows dropped because the cut fell inside (or
    before) an image, rows with nothing left to train, rows truncated after a whole image."""

    n_records: int = 0
    n_examples: int = 0
    n_cut_in_image: int = 0
    n_dropped: int = 0
    n_truncated: int = 0


def tokenize_vision_dataset(tokenizer: Tokenizer, records: Sequence[dict], span,
                            max_seq_len: int) -> tuple[list[Example], VisionStats]:
    """Every TRL vision record tokenized (tokenize_vision_example); a bad record raises DataError naming it."""
    stats, out = VisionStats(n_records=len(records)), []
    for k, obj in enumerate(records):
        where = f"record {k}"
        try:
            ex = tokenize_vision_example(tokenizer, *vision_messages(obj, where, getattr(span, "as_video", None)),
                                         span, max_seq_len)
        except DataError as e:
            raise DataError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
        if ex == "cut":
            stats.n_cut_in_image += 1
        elif ex is None:
            stats.n_dropped += 1
        else:
            stats.n_truncated += int(ex.truncated)
            out.append(ex)
    stats.n_examples = len(out)
    if records and not out and stats.n_cut_in_image:
        raise DataError(f"every row's image tokens run past --max-seq-len {max_seq_len} "
                        f"({stats.n_cut_in_image} rows cut inside an image)")
    return out, stats


def vision_prompt_ids(tokenizer: Tokenizer, prompt: str, n_images: int, span, system: str | None = None,
                      images=None, videos=()) -> list[int]:
    """Token ids asking for the answer to a user turn of `n_images` images, then `videos` (Qwen3-VL's
    data/qwen_videos.Video), then the text `prompt` (as TRL's records and the processor lay it out): the chat
    template's generation prompt, each placeholder expanded (from the `images` themselves where the span needs
    them: SmolVLM's tiles)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "video"}] * len(videos) +
         [{"type": "text", "text": prompt}]}]
    media = [*(images if images is not None else [None] * n_images), *videos] if videos else images
    return vision_chat_ids(tokenizer, messages, n_images + len(videos), span, media)


def vision_chat_ids(tokenizer: Tokenizer, messages: list[dict], n_images: int, span, images=None) -> list[int]:
    """Token ids asking for the assistant's answer after chat `messages` whose contents may list {"type": "image"}
    parts (`n_images` in all): the chat template's generation prompt, each placeholder expanded (span.expansion
    of each of `images` where given, else of none: Gemma 3's, the same for every image)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expansions = [span.expansion(im) for im in images] if images is not None else [span.expansion()] * n_images
    return tokenizer.encode(expand_placeholders(text, span, expansions))
