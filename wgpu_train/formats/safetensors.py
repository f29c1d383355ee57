"""safetensors files: reading (sharded or not; f32 / f16 / bf16 as float32, lazily), writing atomically (floats
as they are, or stored as float16 / bfloat16); bfloat16's rounding."""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from wgpu_train.errors import ConfigError, ModelFileError

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
           "I64": np.int64, "I32": np.int32, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items() if k != "BF16"}     # a NumPy array's safetensors dtype


# what write_safetensors can store floating tensors as
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
_F16_MAX = float(np.finfo(np.float16).max)


def bfloat16_bits(w: np.ndarray) -> np.ndarray:
    """w (float32) rounded to bfloat16, as uint16 bits: the low half rounded to nearest, ties to even (NaN stays
    NaN, quietened; values past bfloat16's largest finite one become inf, as torch rounds them)."""
    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)


def bfloat16_values(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bits (uint16)."""
    return (np.asarray(bits, dtype=np.uint32) << np.uint32(16)).view(np.float32)


def _as_array(raw: np.ndarray, dtype: str) -> np.ndarray:
    """A tensor's stored values (a view of the file) as float32 (floats) or their own integer type (a copy)."""
    if dtype == "BF16":
        return bfloat16_values(raw)
    if raw.dtype.kind == "f":
        return raw.astype(np.float32)
    return np.array(raw)


class Derived:
    """A tensor made from stored ones when it is read: its shape, the file bytes it reads (nbytes) and
    values(dtype), float32 (dtype: the safetensors dtype of what it reads)."""

    shape: tuple
    nbytes: int

    def values(self, dtype: str) -> np.ndarray:
        raise NotImplementedError


class Transposed(Derived):
    """A stored tensor (a view of file bytes, or a Derived) with its last two axes swapped when it is read."""

    def __init__(self, raw):
        self.raw, self.nbytes = raw, raw.nbytes
        self.shape = (*raw.shape[:-2], raw.shape[-1], raw.shape[-2])

    def values(self, dtype: str) -> np.ndarray:
        x = self.raw.values(dtype) if isinstance(self.raw, Derived) else _as_array(self.raw, dtype)
        return np.ascontiguousarray(np.swapaxes(x, -1, -2))


class Stacked(Derived):
    """A tensor made of other stored tensors when it is read: parts[e] (views of file bytes, one safetensors
    dtype) joined along their first axis, the results stacked on a new first axis e. A checkpoint's MoE layer
    stores each expert's projections apart; the model reads them as one (E, out, in) tensor."""

    def __init__(self, parts):
        self.parts = tuple(tuple(p) for p in parts)
        first = self.parts[0]
        self.shape = (len(self.parts), sum(p.shape[0] for p in first), *first[0].shape[1:])
        self.nbytes = sum(p.nbytes for ps in self.parts for p in ps)

    def values(self, dtype: str) -> np.ndarray:
        return np.stack([np.concatenate([_as_array(p, dtype) for p in ps], axis=0) for ps in self.parts])


class LazyWeights(Mapping):
    """name -> array of a model's tensors, each converted from its memory-mapped file bytes when it is read
    (and not kept), so that an engine that stores tensors one at a time (the WebGPU one, quantising them
    as it goes) never holds the whole model as float32 in host memory."""

    def __init__(self, raw: dict):
        self._raw = raw                  # name -> (view of the file's bytes or a Derived, safetensors dtype)
        self.bytes_read = 0              # file bytes converted so far (a pipeline stage reads only its own)

    def __getitem__(self, name: str) -> np.ndarray:
        raw, dtype = self._raw[name]
        self.bytes_read += raw.nbytes
        return raw.values(dtype) if isinstance(raw, Derived) else _as_array(raw, dtype)

    def stored(self, name: str):
        """Tensor `name` as stored, unread: its Derived (e.g. formats/mxfp4.Mxfp4's blocks and scales), or None
        for a tensor stored as it is read."""
        raw = self._raw[name][0]
        return raw if isinstance(raw, Derived) else None

    def subset(self, names) -> "LazyWeights":
        """These tensors alone (nothing read), with a byte count of their own."""
        return LazyWeights({k: self._raw[k] for k in names})

    def __iter__(self):
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def shape(self, name: str) -> tuple:
        return tuple(self._raw[name][0].shape)


def read_safetensors(path, names=None) -> dict:
    """Tensors of one .safetensors file as float32 (floats) or their own integer type.

    Checks the header and every tensor's byte range against the file, so a file cut short
    or with a bad header gives a ModelFileError instead of garbage.
    """
    return {k: _as_array(*v) for k, v in _read_raw(path, names).items()}


def safetensors_names(path) -> list:
    """The tensor names in one .safetensors file's header (checked as read_safetensors checks it; nothing converted)."""
    return list(_read_raw(path))


def _read_raw(path, names=None) -> dict:
    """name -> (view of the tensor's bytes in a memory map of the file, safetensors dtype), checked."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFileError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                raise ModelFileError(f"{path}: safetensors header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise ModelFileError(f"weights file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelFileError(f"{path}: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    out = {}
    for name, meta in header.items():
        if names is not None and name not in names:
            continue
        try:
            dtype, shape, (start, end) = meta["dtype"], meta["shape"], meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(f"{path}: malformed header entry for tensor {name}") from None
        if dtype not in _DTYPES:
            raise ModelFileError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        np_dtype = np.dtype(_DTYPES[dtype])
        count = int(np.prod(shape)) if shape else 1
        if end > data.shape[0] or end - start != count * np_dtype.itemsize:
            raise ModelFileError(f"{path}: tensor {name} lies outside the file (file cut short?)")
        out[name] = (np.frombuffer(data[start:end], dtype=np_dtype).reshape(shape), dtype)
    return out


def _stored(name: str, arr: np.ndarray, dtype: str | None) -> tuple[np.ndarray, str]:
    """(the array to write, its safetensors dtype): a floating array in `dtype` (FLOAT_DTYPES; None: as it is),
    rounded to nearest even; ConfigError for values beyond float16's range."""
    if dtype is None or arr.dtype.kind != "f":
        return arr, _NAMES[arr.dtype]
    if dtype == "bfloat16":
        return bfloat16_bits(arr).reshape(arr.shape), "BF16"
    if dtype == "float16":
        largest = float(np.max(np.abs(arr))) if arr.size else 0.0
        if not largest <= _F16_MAX:
            raise ConfigError(f"{name} has values up to {largest:.6g}, beyond float16's range ({_F16_MAX:g}): save "
                              f"it as bfloat16 or float32")
    arr = arr.astype(dtype, copy=False)
    return arr, _NAMES[arr.dtype]


def write_safetensors(path, tensors: Mapping, metadata: dict | None = None, dtype: str | None = None):
    """Write NumPy arrays as a .safetensors file (atomically: temp file, then rename; nothing left behind when it
    fails), floating ones stored as `dtype` (one of FLOAT_DTYPES) when it is given. Each tensor is read from
    `tensors` once, in name order, and written at once, so a lazy mapping (TensorMap: tensors merged or fetched
    from other processes as they are read) is never whole in memory: the header's room is reserved from the
    names (a bound per entry) and written last, padded with spaces as the format allows."""
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(FLOAT_DTYPES)}")
    names = sorted(tensors)
    meta = {"__metadata__": {k: str(v) for k, v in metadata.items()}} if metadata else {}
    # an entry: its name, dtype, up to 8 dimensions and two offsets of up to 20 digits each, and JSON's marks
    room = len(json.dumps(meta)) + sum(len(json.dumps(name)) + 256 for name in names) + 2
    room += -room % 8
    header, offset = {}, 0
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.seek(8 + room)
            for name in names:
                arr, stored = _stored(name, np.ascontiguousarray(tensors[name]), dtype)
                header[name] = {"dtype": stored, "shape": list(arr.shape),
                                "data_offsets": [offset, offset + arr.nbytes]}
                f.write(arr.reshape(-1).view(np.uint8).data)
                offset += arr.nbytes
                del arr
            blob = json.dumps({**header, **meta}, separators=(",", ":")).encode()
            if len(blob) > room:
                raise ValueError(f"a safetensors header of {len(blob)} bytes over the {room} reserved")
            f.seek(0)
            f.write(struct.pack("<Q", room))
            f.write(blob + b" " * (room - len(blob)))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


class TensorMap(Mapping):
    """name -> array made by fetch(name) each time it is read, and not kept: a model's tensors for a writer that
    takes them one at a time (write_safetensors), so that no process holds them all at once."""

    def __init__(self, names, fetch):
        self._names, self._fetch = list(names), fetch
        self._known = set(self._names)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._known:
            raise KeyError(name)
        return self._fetch(name)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
