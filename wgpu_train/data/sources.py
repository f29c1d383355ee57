"""Dataset files as users have them -> records (records.py) in splits: JSONL, JSON (an array of records, or an
object of record arrays), Parquet (read row group by row group), folders with train / validation / test files
(ours, or the hub's data/train-00000-of-00001.parquet layout), several sources mixed (repeated --data, globs),
dataset ids from the Hugging Face hub, and other column names mapped onto ours (--columns). Read as SFT records
(records.py), as preference pairs / unpaired KTO records (preference_records.py) or as GRPO's prompts
(prompt_records.py)."""

from __future__ import annotations

import glob
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from wgpu_train.errors import ConfigError, DataError
from wgpu_train.data.kinds import DataKind
from wgpu_train.data.preference_records import (PreferenceRecord, UnpairedRecord, check_labels, convert_preference,
                                                detect_preference_format, unpair_preferences)
from wgpu_train.data.prompt_records import PromptRecord, convert_prompt, detect_prompt_format
from wgpu_train.data.records import BadRecord, Conversation, Record, Text, convert, detect_format

SUFFIXES = (".jsonl", ".json", ".parquet")
VALID_NAMES = ("valid", "validation", "val", "dev")        # names of a folder's validation split
SPLIT_NAMES = {"train": ("train",), "valid": VALID_NAMES, "test": ("test",)}
FIELDS = ("messages", "conversations", "prompt", "completion", "instruction", "input", "output", "response",
          "context", "system", "text", "chosen", "rejected", "label",
          "answer", "solution", "tools")                   # the fields a column can be mapped onto
PARQUET_BATCH = 1024                                       # rows converted to Python objects at a time
_SHARD = re.compile(r"-\d+-of-\d+\.\w+")                      # the hub's shard names: train-00000-of-00002.parquet


# ---- column mapping ----------------------------------------------------------------------------------------

def parse_columns(spec: str | None) -> dict[str, str]:
    """'prompt=question,completion=answer' -> {"prompt": "question", "completion": "answer"} (our field -> the
    file's column); ConfigError naming the problem for anything else."""
    if not spec:
        return {}
    out: dict[str, str] = {}
    for item in spec.split(","):
        ours, eq, theirs = (part.strip() for part in item.partition("="))
        if not eq or not ours or not theirs:
            raise ConfigError(f"--columns: {item.strip()!r} is not FIELD=COLUMN (e.g. prompt=question)")
        if ours not in FIELDS:
            raise ConfigError(f"--columns: unknown field {ours!r}; the fields are {', '.join(FIELDS)}")
        if ours in out:
            raise ConfigError(f"--columns: field {ours!r} is mapped twice")
        out[ours] = theirs
    return out


def _mapped(obj: Any, columns: dict[str, str]) -> Any:
    """The record with the mapped columns renamed to our fields (BadRecord when one is missing)."""
    if not columns or not isinstance(obj, dict):
        return obj
    out = {k: v for k, v in obj.items() if k not in columns.values()}
    for ours, theirs in columns.items():
        if theirs not in obj:
            raise BadRecord(f"no column {theirs!r} (--columns {ours}={theirs}); it has "
                            f"{', '.join(sorted(map(str, obj))[:8]) or 'none'}")
        out[ours] = obj[theirs]
    return out


# ---- reading one file ----------------------------------------------------------------------------------------

def _is_utf16(raw: bytes) -> bool:
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        return True
    head = raw[:64]  # without a byte order mark: ASCII JSON has a zero byte before or after every character
    return len(head) >= 4 and (not head[0::2].strip(b"\x00") or not head[1::2].strip(b"\x00"))


def _read_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise DataError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    if raw.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte order mark
        raw = raw[3:]
    elif _is_utf16(raw):
        raise DataError(f"{path}: the file is UTF-16 encoded; save it as UTF-8")
    return raw


def _jsonl_objects(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, object or BadRecord) of each non-blank line."""
    for lineno, line in enumerate(_read_bytes(path).split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            yield lineno, BadRecord("not valid UTF-8")
        except json.JSONDecodeError as e:
            yield lineno, BadRecord(f"invalid JSON ({e.msg} at column {e.colno})")


def _json_document(path: Path) -> Any:
    """The parsed file, or None when it holds one JSON value per line (JSONL named .json)."""
    try:
        return json.loads(_read_bytes(path).decode("utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"{path}: not valid UTF-8") from None
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and e.colno == 1:
            return None
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None


def _json_arrays(path: Path, doc: Any) -> dict[str, list]:
    """An array -> {"": it}; an object whose values are all arrays -> itself; else DataError."""
    if isinstance(doc, list):
        return {"": doc}
    if isinstance(doc, dict) and doc and all(isinstance(v, list) for v in doc.values()):
        return doc
    raise DataError(f"{path}: a JSON data file must hold an array of records or an object of record arrays "
                    f"(e.g. {{\"train\": [...]}}), not {'an empty object' if doc == {} else type(doc).__name__}")


def _split_keys(path: Path, arrays: dict) -> dict[str, str]:
    """split -> the key of a JSON object's arrays that holds it (train / valid / test); DataError for two keys
    of one split, or for split keys without a train split (held-out records must not become training data)."""
    found: dict[str, str] = {}
    for split, names in SPLIT_NAMES.items():
        keys = [key for key in arrays if key in names]
        if len(keys) > 1:
            raise DataError(f"{path}: keys {' and '.join(map(repr, keys))} are both the {split} split; keep one")
        if keys:
            found[split] = keys[0]
    if found and "train" not in found:
        raise DataError(f"{path}: the object holds {', '.join(map(repr, found.values()))} but no \"train\" array")
    return found


def _parquet_objects(path: Path) -> Iterator[tuple[int, Any]]:
    """(row number, record dict) of a Parquet file, one batch of rows at a time (never the whole file)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow: pip install 'wgpu-train[parquet]'") from None
    try:
        reader = pq.ParquetFile(path)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    row = 0
    for batch in reader.iter_batches(batch_size=PARQUET_BATCH):
        for obj in batch.to_pylist():
            row += 1
            yield row, obj


def _objects(path: Path, split: str | None = None, arrays: dict | None = None) -> Iterator[tuple[str, Any]]:
    """("file:line", "file:row" or "file:split[row]", object or BadRecord) of every record of a file: of its
    JSON arrays when `arrays` gives them already parsed (of one of them when `split` names it)."""
    if arrays is None and path.suffix == ".json" and (whole := _json_document(path)) is not None:
        arrays = _json_arrays(path, whole)
        if _split_keys(path, arrays):
            raise DataError(f"{path}: holds train / validation / test arrays; give this file itself as --data "
                            "(not inside a folder's split files)")
    if arrays is not None and split is not None:
        for i, obj in enumerate(arrays[split], start=1):
            yield f"{path}:{split}[{i}]", obj
    elif arrays is not None:
        n = 0
        for items in arrays.values():
            for obj in items:
                n += 1
                yield f"{path}:{n}", obj
    elif path.suffix == ".parquet":
        for row, obj in _parquet_objects(path):
            yield f"{path}:{row}", obj
    else:
        for lineno, obj in _jsonl_objects(path):
            yield f"{path}:{lineno}", obj


def _detect(obj: Any, kind: DataKind) -> str:
    if kind is DataKind.PROMPTS:
        return detect_prompt_format(obj)
    return detect_format(obj) if kind is DataKind.SFT else detect_preference_format(obj, kind)


def _convert(obj: Any, fmt: str, where: str, kind: DataKind) -> Any:
    if kind is DataKind.PROMPTS:
        return convert_prompt(obj, fmt, where)
    if kind is not DataKind.SFT:
        return convert_preference(obj, fmt, where)
    record = convert(obj, fmt)
    return Text(record, where) if isinstance(record, str) else Conversation(record, where,
                                                                             getattr(record, "tools", None))


def load_records(path: str | Path, skip_invalid: bool = False, columns: dict[str, str] | None = None,
                 split: str | None = None, arrays: dict | None = None,
                 kind: DataKind | str = DataKind.SFT) -> tuple[list, str, int]:
    """Read one data file (JSONL, JSON or Parquet, by suffix): (records, format name, number skipped).

    The format is detected from the first valid record and every other record must match it. A bad record
    raises DataError "file:line: problem" ("file:row" for JSON and Parquet), or is skipped and counted when
    `skip_invalid`. Records remember in `source` where they were read; they are, by `kind` (a DataKind or its
    value): SFT ("sft"), Conversation or Text objects; PAIRS ("preference"), PreferenceRecord; UNPAIRED
    ("unpaired"), UnpairedRecord, or PreferenceRecord for a file of pairs (resolve_data unpairs them); PROMPTS
    ("prompts"), PromptRecord (a record without a prompt is a bad record).
    """
    path = Path(path)
    kind = DataKind.parse(kind)
    records: list[Record] = []
    fmt: str | None = None
    skipped = n = 0
    for where, obj in _objects(path, split, arrays):
        n += 1
        try:
            if isinstance(obj, BadRecord):
                raise obj
            obj = _mapped(obj, columns or {})
            line_fmt = fmt if fmt is not None else _detect(obj, kind)
            record = _convert(obj, line_fmt, where, kind)
        except BadRecord as e:
            if not skip_invalid:
                raise DataError(f"{where}: {e}") from None
            skipped += 1
            continue
        fmt = line_fmt
        records.append(record)
    if n == 0:
        raise DataError(f"{path}: split {split!r} is empty" if split else f"{path}: empty file")
    if not records:
        raise DataError(f"{path}: no valid {'lines' if path.suffix not in ('.json', '.parquet') else 'records'} "
                        f"({skipped} skipped)")
    assert fmt is not None
    return records, fmt, skipped


# ---- finding the splits --------------------------------------------------------------------------------------

@dataclass
class DataSplits:
    """Records of each split of a dataset and the format they were read in (SFT records, or PreferenceRecord /
    UnpairedRecord / PromptRecord by the kind read)."""

    train: list[Record]
    valid: list[Record]
    test: list[Record]
    format: str
    n_skipped: int = 0
    files: dict[str, str] = field(default_factory=dict)  # split -> the file(s) it came from
    valid_held_out: bool = False  # valid was carved out of train, not read from a validation file


def _split_files(folder: Path) -> dict[str, list[Path]]:
    """split -> its files in a folder: <split>.<suffix> or shards <split>-*.<suffix>, in the folder or its data/
    subfolder (the hub's layout); the first of the two that has a train split."""
    for base in (folder, folder / "data"):
        found: dict[str, list[Path]] = {}
        for split, names in SPLIT_NAMES.items():
            # one family per split: <name><suffix>, or shards <name>-NNNNN-of-NNNNN<suffix> (the hub's naming)
            families = {}
            for name in names:
                for suffix in SUFFIXES:
                    whole = base / f"{name}{suffix}"
                    shards = sorted(f for f in base.glob(f"{name}-*{suffix}") if _SHARD.fullmatch(f.name[len(name):]))
                    if whole.is_file():
                        families[whole.name] = [whole]
                    if shards:
                        families[f"{name}-*{suffix}"] = shards
            if len(families) > 1:
                what = "validation" if split == "valid" else split
                raise DataError(f"{base}: found {' and '.join(families)}; keep one {what} file")
            if families:
                found[split] = next(iter(families.values()))
        if "train" in found:
            return found
    raise DataError(f"{folder}: folder has no train.jsonl (nor train.json, train.parquet or "
                    "data/train-*.parquet)")


def _merge(parts: list[tuple[str, list, str, int]], what: str) -> tuple[list[Record], str, int, str]:
    """(records, format, skipped, files) of several files' records of one split; formats must mix."""
    records: list[Record] = []
    formats: list[str] = []
    for file, recs, fmt, _ in parts:
        if formats and (fmt == "text") != (formats[0] == "text"):
            raise DataError(f"{file}: {fmt} format does not mix with {what}'s {formats[0]} format")
        records += recs
        if fmt not in formats:
            formats.append(fmt)
    return records, "+".join(formats), sum(p[3] for p in parts), ", ".join(p[0] for p in parts)


def _sources(path) -> list[Path]:
    """The sources of --data: a list, or a string of comma-separated entries (an existing path is one entry);
    glob patterns expanded; hub dataset ids resolved to their snapshot folders."""
    from wgpu_train.formats import hub

    entries = list(path) if isinstance(path, (list, tuple)) else (
        [str(path)] if Path(str(path)).exists() else [e.strip() for e in str(path).split(",") if e.strip()])
    out: list[Path] = []
    for entry in entries:
        entry = str(entry)
        if any(ch in entry for ch in "*?[") and not Path(entry).exists():
            matches = sorted(glob.glob(entry, recursive=True))
            if not matches:
                raise DataError(f"{entry}: no file matches this pattern")
            out += [Path(m) for m in matches]
        elif hub.is_hub_id(entry):
            out.append(hub.resolve(entry, "dataset"))
        else:
            out.append(Path(entry))
    if not out:
        raise DataError(f"{path!r}: no data file given")
    return out


def _read_source(path: Path, skip_invalid: bool, columns: dict, kind: DataKind) -> dict[str, list]:
    """split -> [(file, records, format, skipped)] of one file or folder."""
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    if path.is_dir():
        return {split: [(str(f),) + load_records(f, skip_invalid, columns, kind=kind) for f in files]
                for split, files in _split_files(path).items()}
    if path.suffix == ".json" and (whole := _json_document(path)) is not None:     # parsed once
        arrays = _json_arrays(path, whole)
        keys = _split_keys(path, arrays)
        if keys:
            return {split: [(f"{path}:{split}",) + load_records(path, skip_invalid, columns, split,
                                                               {split: arrays[key]}, kind)]
                    for split, key in keys.items()}
        return {"train": [(str(path),) + load_records(path, skip_invalid, columns, arrays=arrays, kind=kind)]}
    return {"train": [(str(path),) + load_records(path, skip_invalid, columns, kind=kind)]}


def _unpaired(records: list, names: str) -> list[UnpairedRecord]:
    """A split read as DataKind.UNPAIRED: its pairs unpaired as TRL's KTOTrainer does; pairs and unpaired records
    do not mix."""
    n_pairs = sum(isinstance(r, PreferenceRecord) for r in records)
    if n_pairs and n_pairs < len(records):
        raise DataError(f"{names}: paired preference records do not mix with unpaired ones; give one kind")
    return unpair_preferences(records) if n_pairs else records


def _check_prompt_forms(splits: dict[str, list[PromptRecord]], files: dict[str, str]) -> None:
    """Prompts are all strings or all message lists: TRL's GRPOTrainer tokenizes a batch as its first prompt is."""
    forms = {split: {isinstance(r.prompt, list) for r in records} for split, records in splits.items() if records}
    if len({form for both in forms.values() for form in both}) > 1:
        names = ", ".join(files.get(split, split) for split in forms)
        raise DataError(f"{names}: string prompts do not mix with conversational (message list) prompts; give one "
                        "form")


def hold_out(records: list, valid_split: float, seed: int) -> tuple[list, list]:
    """(train, valid): a fraction valid_split of records (at least one, never all), chosen with
    np.random.default_rng(seed), held out as valid; both keep the records' order."""
    n = len(records)
    n_valid = min(max(1, int(round(n * valid_split))), n - 1) if valid_split > 0 else 0
    if n_valid <= 0:
        return records, []
    held = set(np.random.default_rng(seed).permutation(n)[:n_valid].tolist())
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]


def resolve_data(path, valid_split: float = 0.1, seed: int = 0, skip_invalid: bool = False,
                 columns: str | dict | None = None, kind: DataKind | str = DataKind.SFT) -> DataSplits:
    """Find the splits of a dataset. `path`: a data file (JSONL, JSON or Parquet); a folder with a train split
    and optionally one validation split (valid, validation, val or dev) and a test split, in any of those
    formats, at its top or under data/; a hub dataset id; several of these (a list, or comma-separated) or a
    glob, whose splits are concatenated. Without validation data a fraction `valid_split` of train, chosen with
    np.random.default_rng(seed), is held out as valid (train keeps its order). `columns` maps our field names
    to other column names (parse_columns). Every record keeps its source through the split.

    `kind` (a DataKind or its value) says what the records are (see load_records): SFT records (the default),
    PAIRS, UNPAIRED KTO records (pairs are unpaired as TRL does, after the held-out split, so a pair's halves stay
    together; the train split must hold both labels, else ConfigError), or GRPO's PROMPTS (all strings or all
    message lists, else DataError)."""
    if not 0.0 <= valid_split < 1.0:
        raise ConfigError(f"valid_split must be in [0, 1), got {valid_split}")
    kind = DataKind.parse(kind)
    columns = parse_columns(columns) if isinstance(columns, str) or columns is None else columns
    by_split: dict[str, list] = {"train": [], "valid": [], "test": []}
    for source in _sources(path):
        for split, parts in _read_source(source, skip_invalid, columns, kind).items():
            by_split[split] += parts
    train, fmt, skipped, train_files = _merge(by_split["train"], "train")
    files = {"train": train_files}
    splits = {"train": train, "valid": [], "test": []}
    for split in ("valid", "test"):
        if by_split[split]:
            recs, other, n, names = _merge(by_split[split], split)
            if (other == "text") != (fmt == "text"):
                raise DataError(f"{names}: {other} format does not mix with train's {fmt} format")
            splits[split], files[split] = recs, names
            skipped += n
    held_out = False
    if "valid" not in files:
        splits["train"], splits["valid"] = hold_out(train, valid_split, seed)
        held_out = bool(splits["valid"])
    if kind is DataKind.UNPAIRED:
        for split in splits:
            splits[split] = _unpaired(splits[split], files.get(split, ""))
        check_labels(splits["train"], files["train"])
    if kind is DataKind.PROMPTS:
        _check_prompt_forms(splits, files)
    return DataSplits(splits["train"], splits["valid"], splits["test"], fmt, skipped, files, held_out)
