"""Batching: tokenized examples -> padded or packed batches (rows of similar lengths, a token budget per
micro-batch), and the resumable batch stream the trainer reads."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from wgpu_train.errors import ConfigError, DataError
from wgpu_train.data.images import image_bytes
from wgpu_train.data.qwen_videos import Video
from wgpu_train.data.records import IGNORE_INDEX


@dataclass(eq=False)
class Example:
    """One tokenized sample. Labels are not shifted: the model's logits at t are scored against labels[t + 1]."""

    input_ids: np.ndarray  # (T,) int32
    labels: np.ndarray  # (T,) int64, IGNORE_INDEX where no loss
    truncated: bool = False
    images: list = field(default_factory=list)  # a record with images: those its placeholders take, in order

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_trained(self) -> int:
        """Number of positions that carry loss after the shift."""
        return int((self.labels[1:] != IGNORE_INDEX).sum())


@dataclass(eq=False)
class Batch:
    """A padded (and possibly packed) batch. Attention is allowed only within one segment id; 0 is padding."""

    input_ids: np.ndarray  # (B, T) int32
    labels: np.ndarray  # (B, T) int64, IGNORE_INDEX where no loss; not shifted
    attention_mask: np.ndarray  # (B, T) int32, 1 for real tokens
    segment_ids: np.ndarray  # (B, T) int32, 0 for padding, 1..n for the samples packed in a row
    position_ids: np.ndarray  # (B, T) int32, restarting at 0 for each sample
    n_tokens: int  # positions that carry loss after the shift: (labels[:, 1:] != IGNORE_INDEX).sum()
    images: list | None = None  # records with images: each row's images, in the order of its placeholders

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def collate(rows: Sequence[Sequence[Example]], pad_id: int = 0, length: int | None = None,
            pad_to_multiple: int = 1) -> Batch:
    """Build a batch whose row r holds the examples rows[r] one after another, right-padded with `pad_id`
    to `length` (default: the longest row, rounded up to `pad_to_multiple`)."""
    used = [sum(len(e) for e in row) for row in rows]
    T = length if length is not None else _round_up(max(used), max(1, pad_to_multiple))
    if max(used) > T:
        raise ValueError(f"a row of {max(used)} tokens does not fit length {T}")
    B = len(rows)
    input_ids = np.full((B, T), pad_id, dtype=np.int32)
    labels = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
    segment_ids = np.zeros((B, T), dtype=np.int32)
    position_ids = np.zeros((B, T), dtype=np.int32)
    for r, row in enumerate(rows):
        at = 0
        for s, ex in enumerate(row):
            n = len(ex)
            input_ids[r, at:at + n] = ex.input_ids
            labels[r, at:at + n] = ex.labels
            if s > 0:
                labels[r, at] = IGNORE_INDEX  # logits at at-1 belong to the previous sample
            segment_ids[r, at:at + n] = s + 1
            position_ids[r, at:at + n] = np.arange(n, dtype=np.int32)
            at += n
    attention_mask = (segment_ids > 0).astype(np.int32)
    n_tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
    images = ([[im for ex in row for im in ex.images] for row in rows]
              if any(ex.images for row in rows for ex in row) else None)
    return Batch(input_ids, labels, attention_mask, segment_ids, position_ids, n_tokens, images)


def pack_examples(lengths: Sequence[int], max_seq_len: int, chunk: int = 4096) -> list[list[int]]:
    """First-fit packing of samples (in the given order) into rows of `max_seq_len` tokens; returns the sample
    indices of each row. Works on chunks of `chunk` samples so that the cost stays linear in the dataset."""
    rows: list[list[int]] = []
    for c0 in range(0, len(lengths), chunk):
        room = np.zeros(0, dtype=np.int64)  # free tokens of each row of this chunk
        chunk_rows: list[list[int]] = []
        for i in range(c0, min(c0 + chunk, len(lengths))):
            n = int(lengths[i])
            if n > max_seq_len:
                raise ValueError(f"sample {i} has {n} tokens, more than max_seq_len={max_seq_len}")
            fits = np.flatnonzero(room >= n)
            if fits.size:
                r = int(fits[0])
                room[r] -= n
                chunk_rows[r].append(i)
            else:
                room = np.append(room, max_seq_len - n)
                chunk_rows.append([i])
        rows += chunk_rows
    return rows


def token_groups(lengths: Sequence[int], max_tokens: int, multiple: int = 1) -> list[tuple[int, int]]:
    """(start, end) of consecutive runs of rows, in order, each as long as it stays within max_tokens once padded:
    rows x its longest length rounded up to `multiple` (a row longer than that alone makes its own run)."""
    out, start, width = [], 0, 0
    for i, n in enumerate(lengths):
        w = max(width, _round_up(int(n), max(1, multiple)))
        if i > start and (i - start + 1) * w > max_tokens:
            out.append((start, i))
            start, w = i, _round_up(int(n), max(1, multiple))
        width = w
    if len(lengths):
        out.append((start, len(lengths)))
    return out


def make_batches(examples: Sequence[Example], batch_size: int, rng: np.random.Generator, shuffle: bool = True,
                 pack: bool = False, max_seq_len: int | None = None, bucket: bool = True, pad_id: int = 0,
                 pad_to_multiple: int = 1, max_tokens: int | None = None, micro_batches: int = 1) -> list[Batch]:
    """One epoch of batches.

    Samples are shuffled with `rng` (when `shuffle`); with `bucket`, sorted by length within chunks of
    50 * batch_size so that a batch holds similar lengths, and the batch order is shuffled again. With `pack`,
    samples are first-fit packed into rows of `max_seq_len` tokens (segment ids and positions per sample).
    The last batch may hold fewer rows. With max_tokens, a batch is `micro_batches` consecutive token_groups
    of the (bucketed) rows instead of batch_size rows: split_batch(..., max_tokens=) cuts it back into them.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
    if not examples:
        return []
    n = len(examples)
    order = rng.permutation(n) if shuffle else np.arange(n)
    lengths = np.array([len(e) for e in examples], dtype=np.int64)

    if pack:
        if max_seq_len is None:
            raise ConfigError("packing needs max_seq_len")
        rows = [[int(order[i]) for i in row] for row in pack_examples(lengths[order], max_seq_len)]
        row_len = np.array([lengths[row].sum() for row in rows])
    else:
        rows = [[int(i)] for i in order]
        row_len = lengths[order]

    row_order = np.arange(len(rows))
    if bucket:
        chunk = 50 * batch_size
        for c0 in range(0, len(rows), chunk):
            part = row_order[c0:c0 + chunk]
            row_order[c0:c0 + chunk] = part[np.argsort(-row_len[part], kind="stable")]
    if max_tokens:
        runs = token_groups(row_len[row_order], max_tokens, pad_to_multiple)
        groups = [row_order[runs[g][0]:runs[min(g + micro_batches, len(runs)) - 1][1]]
                  for g in range(0, len(runs), micro_batches)]
    else:
        groups = [row_order[b:b + batch_size] for b in range(0, len(rows), batch_size)]
    if bucket and shuffle:
        groups = [groups[i] for i in rng.permutation(len(groups))]
    return [collate([[examples[i] for i in rows[r]] for r in g], pad_id=pad_id, pad_to_multiple=pad_to_multiple)
            for g in groups]


class BatchStream:
    """Endless, resumable stream of (epoch, index, Batch): epoch e's batches come from
    make_batches(..., rng=np.random.default_rng([seed, e])), so state_dict() fully describes the position."""

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int, pack: bool = False,
                 max_seq_len: int | None = None, shuffle: bool = True, bucket: bool = True, pad_id: int = 0,
                 pad_to_multiple: int = 1, max_tokens: int | None = None, micro_batches: int = 1) -> None:
        if not examples:
            raise DataError("no training examples left after tokenization")
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.pack = pack
        self.max_seq_len = max_seq_len
        self.shuffle = shuffle
        self.bucket = bucket
        self.pad_id = pad_id
        self.pad_to_multiple = pad_to_multiple
        self.max_tokens, self.micro_batches = max_tokens, micro_batches
        self.epoch = 0
        self.position = 0  # index of the next batch within the epoch
        self._cache: tuple[int, list[Batch]] | None = None
        self._fingerprint: str | None = None

    def epoch_batches(self, epoch: int) -> list[Batch]:
        """All batches of `epoch` (deterministic in seed and epoch)."""
        if self._cache is None or self._cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            batches = make_batches(self.examples, self.batch_size, rng, shuffle=self.shuffle, pack=self.pack,
                                   max_seq_len=self.max_seq_len, bucket=self.bucket, pad_id=self.pad_id,
                                   pad_to_multiple=self.pad_to_multiple, max_tokens=self.max_tokens,
                                   micro_batches=self.micro_batches)
            self._cache = (epoch, batches)
        return self._cache[1]

    def __len__(self) -> int:
        """Batches in the current epoch (with packing this can vary slightly between epochs)."""
        return len(self.epoch_batches(self.epoch))

    def __iter__(self) -> Iterator[tuple[int, int, Batch]]:
        while True:
            batches = self.epoch_batches(self.epoch)
            while self.position < len(batches):
                index = self.position
                self.position += 1  # advanced before yielding so a state_dict taken now resumes after this batch
                yield self.epoch, index, batches[index]
            self.epoch += 1
            self.position = 0

    def fingerprint(self) -> str:
        """A hash of every example's token ids and labels, and of its images' bytes (data/images.image_bytes; a
        video's frames'), in order: equal only for the same training data."""
        if self._fingerprint is None:
            h = hashlib.blake2b(digest_size=16)
            for i, ex in enumerate(self.examples):
                h.update(np.int64(len(ex)).tobytes())
                h.update(np.ascontiguousarray(ex.input_ids, dtype=np.int32).tobytes())
                h.update(np.ascontiguousarray(ex.labels, dtype=np.int64).tobytes())
                for j, image in enumerate(ex.images):   # a video's (data/qwen_videos.Video): its frames' and timing
                    if isinstance(image, Video):
                        h.update(repr((image.fps, image.indices)).encode())
                    for frame in image.frames if isinstance(image, Video) else (image,):
                        h.update(hashlib.blake2b(image_bytes(frame, f"example {i}: image {j}"),
                                                 digest_size=16).digest())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        """Position of the stream and the fingerprint of its data, JSON-serialisable."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "n_examples": len(self.examples), "batch_size": self.batch_size, "pack": self.pack,
                "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state_dict() of a stream over the same examples and settings; ConfigError when the
        data differ (states saved before fingerprints existed are checked by their number of examples)."""
        n, now = state.get("n_examples", len(self.examples)), len(self.examples)
        if n != now or state.get("fingerprint", self.fingerprint()) != self.fingerprint():
            detail = (f"{n} examples then, {now} now" if n != now else "other token ids, labels or image files: the "
                      "records, their images, tokenizer, chat template or max_seq_len differ")
            raise ConfigError(f"the training data changed since the checkpoint ({detail}); "
                              "resume with the data it was trained on")
        for key, now in (("batch_size", self.batch_size), ("pack", self.pack)):
            if key in state and state[key] != now:
                raise DataError(f"cannot resume the data stream: it was saved with {key}={state[key]}, now {now}")
        self.seed = int(state.get("seed", self.seed))
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def split_batch(batch: Batch, rows: int, multiple: int = 1, max_tokens: int | None = None) -> list:
    """Micro-batches of at most `rows` rows of `batch` (with max_tokens: the runs of rows token_groups
    forms, as make_batches formed them), each trimmed to its longest row rounded up to `multiple` (fewer
    distinct shapes for engines that cache buffers per shape; padding is masked)."""
    out = []
    width = batch.input_ids.shape[1]
    n_rows = batch.input_ids.shape[0]
    if max_tokens:
        mask = batch.attention_mask
        lengths = [int(np.flatnonzero(mask[r])[-1]) + 1 if mask[r].any() else 1 for r in range(n_rows)]
        spans = token_groups(lengths, max_tokens, multiple)
    else:
        spans = [(r0, min(n_rows, r0 + rows)) for r0 in range(0, n_rows, rows)]
    for r0, r1 in spans:
        sl = slice(r0, r1)
        used = np.flatnonzero(batch.attention_mask[sl].any(axis=0))
        t = min(width, -(-(int(used[-1]) + 1 if used.size else 1) // multiple) * multiple)
        labels = batch.labels[sl, :t]
        out.append(Batch(batch.input_ids[sl, :t], labels, batch.attention_mask[sl, :t], batch.segment_ids[sl, :t],
                         batch.position_ids[sl, :t], int((labels[:, 1:] != IGNORE_INDEX).sum()),
                         None if batch.images is None else batch.images[sl]))
    return out
