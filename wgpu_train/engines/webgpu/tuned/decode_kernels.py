"""Attention of new queries against the KV cache (generation): one pass per (query, head) over its row, or
split over the cache (split-K, as flash-decoding does) so that a decoding step's few queries still fill a GPU:
each (query, head, chunk of positions) reduces its chunk to a partial softmax, and a second pass merges the
chunks. The tuner (tune.py) picks the pass, and the chunk, by measurement on the adapter at hand.

On CPU adapters a pass applies only while its loops fit llvmpipe's budget of iterations per invocation
(attention_kernels.CPU_LOOP_BUDGET; past it llvmpipe silently stops the loops): the single pass covers a
few hundred cached positions at head dim 128, the split ones up to MAX_SPLITS chunks of the largest chunk
that fits.

The cache stores float32 or bfloat16 (shared/kv_dtype.KvDtype): its dtype is its buffers' storage format
(device/storage.py, KvDtype.storage; bfloat16 packs two values per 4-byte word, head dims are even), and the queries
and outputs are tensors in any format too, so the cache write and every pass are specialised at launch by the
formats of what they bind, from one source each.

A prefill with Gemma 3's images (blocks) gives each query a reach after the positions, in the same binding: the
last position it sees (its image block's last), so an image's tokens see each other both ways."""
from __future__ import annotations

import math

import numpy as np

from wgpu_train.errors import DeviceError
from wgpu_train.engines.protocol import PREFILL_TOKENS
from wgpu_train.engines.shared.kv_dtype import KvDtype
from wgpu_train.engines.webgpu.tuned.attention_kernels import CPU_LOOP_BUDGET
from wgpu_train.engines.webgpu.tuned.adapter_traits import is_cpu
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.tuned.family import Family
from wgpu_train.engines.webgpu.device.launch import Kernel, flat_grid, prepare
from wgpu_train.engines.webgpu.device.operands import split

WG = 64                       # shaders/attention_cached.wgsl's workgroup size
MAX_SPLITS = 64               # chunks per row at most (the partials' scratch is sized for this many)
CHUNKS = (32, 64, 128, 256, 512, 1024)
LOOP_MARGIN = 16              # iterations kept free of llvmpipe's budget (it already fails at 65534)

SINGLE = Kernel("attention_cached", "attention_cached_forward", "out! q k_cache v_cache rows positions sinks")
PARTIAL = Kernel("attention_cached", "attention_cached_partial", "part! q k_cache v_cache rows positions")
COMBINE = Kernel("attention_cached", "attention_cached_combine",
                 "out! part_in _ _ rows positions sinks")   # reads no cache
CACHE_WRITE = Kernel("kv_cache", "kv_cache_write", "k_cache! v_cache! k_new v_new rows positions")


def cache_tensor(t, kv_dtype: KvDtype | str):
    """t, a cache's key or value tensor, its buffer marked as holding kv_dtype's storage format (a buffer the
    caller allocated unmarked, e.g. uploaded as bfloat16 words, takes it here). A buffer marked with another
    16-bit format is a bug: ValueError."""
    buf, fmt = split(t)[0], KvDtype.parse(kv_dtype).storage
    if storage.format_of(buf) not in ("f32", fmt):
        raise ValueError(f"a {kv_dtype} KV cache in a buffer of storage format {storage.format_of(buf)}")
    storage.set_format(buf, fmt)
    return t


def _for_cache(k: Kernel, slots, kv_dtype: KvDtype) -> Kernel:
    fmt = kv_dtype.storage
    return k.with_formats(tuple((slot, fmt) for slot in slots) if fmt != "f32" else ())


def scratch_elements(queries: int, hq: int, d: int, max_len: int = CHUNKS[0] * MAX_SPLITS) -> int:
    """float32 elements of the partials every split pass needs for calls of up to `queries` queries over rows
    of max_len positions."""
    return queries * hq * min(MAX_SPLITS, -(-max_len // CHUNKS[0])) * (d + 2)


def scratch_bytes(rt, batch: int, max_len: int, hq: int, d: int) -> int:
    """The bytes of a KV cache's scratch for the split passes: for a decoding step's `batch` queries on GPUs
    (padded to a power of two, as forward_rows pads them; a prefill's many queries fill a GPU with the single
    pass), a prefill call's too on CPU adapters (whose loop budget needs the split passes past a few hundred
    positions); at most one storage binding."""
    queries = max(batch, PREFILL_TOKENS) if is_cpu(rt) else 1 << (batch - 1).bit_length()   # forward_rows pads
    return min(scratch_elements(queries, hq, d, max_len) * 4, rt.max_binding // 4 * 4)


class DecodeProblem:
    """One attention_cached_forward call: n queries (q, out (n, hq, d)) against caches (batch, max_len, hkv, d)
    stored as kv_dtype, rows / positions (n,) i32 (with blocks, positions (2n,): the reaches after them), a
    scratch for the partials (None: the single pass only); sinks: whether tensors["sinks"] holds gpt-oss's sink
    logits (Hq,) f32 (else it is any buffer, unread)."""

    def __init__(self, rt, tensors: dict, n, batch, max_len, hq, hkv, d, window=0, softcap=0.0, scratch_elems=0,
                 kv_dtype=KvDtype.FLOAT32, sinks: bool = False, blocks=False):
        self.rt, self.t, self.sinks = rt, tensors, bool(sinks)
        self.n, self.batch, self.max_len, self.hq, self.hkv, self.d = n, batch, max_len, hq, hkv, d
        self.window, self.softcap, self.scratch_elems = int(window), float(softcap), int(scratch_elems)
        self.kv_dtype = KvDtype.parse(kv_dtype)
        self.blocks = bool(blocks)

    @property
    def flops(self) -> float:
        """QK^T and PV over every cached position (the longest case: rows full)."""
        return 4.0 * self.n * self.hq * self.d * self.max_len

    def describe(self) -> str:
        return (f"cached attention n{self.n} len{self.max_len} H{self.hq}/{self.hkv} D{self.d}"
                + (f" window {self.window}" if self.window else "") + (" softcap" if self.softcap else "")
                + (" sinks" if self.sinks else "") + (f" {self.kv_dtype} cache" if self.kv_dtype is not KvDtype.FLOAT32 else "")
                + (" image blocks" if self.blocks else ""))

    def signature(self) -> tuple:
        return ("decode", self.n, self.batch, self.max_len, self.hq, self.hkv, self.d, self.window, self.softcap,
                self.scratch_elems, self.kv_dtype, self.sinks, self.blocks)

    def key(self) -> str:
        """The tuner's key: queries and cache length (next powers of two), heads, D, window, soft-cap, the
        chunks the scratch holds (which decide the candidates), the cache's dtype where not float32, and `blocks`
        with image blocks."""
        def bucket(x):
            return 1 << max(0, (x - 1).bit_length())
        room = self.scratch_elems // max(1, self.n * self.hq * (self.d + 2))
        return (f"attention decode n{bucket(self.n)} len{bucket(self.max_len)} h{self.hq}/{self.hkv} d{self.d}"
                f"{' window' if self.window else ''}{' softcap' if self.softcap else ''}{' sinks' if self.sinks else ''}"
                f" s{min(room, MAX_SPLITS)}"
                f"{' ' + self.kv_dtype if self.kv_dtype is not KvDtype.FLOAT32 else ''}{' blocks' if self.blocks else ''}")

    def candidates(self) -> list:
        """The single pass and every chunk that splits the rows in 2..MAX_SPLITS parts with partials that fit the
        scratch, those within the loop budget on CPU adapters; the default (untuned) first: the most chunks
        (the most parallel work) on GPUs (a guess until the tuner measures) and on CPU adapters for a call of
        fewer (query, head) pairs than a workgroup holds (the single pass leaves llvmpipe's other cores idle);
        else on CPU adapters the single pass where it fits, then the largest chunk (the fewest partials). On
        llvmpipe these defaults are within 5% of the fastest pass of `wgpu-train bench --only decode`."""
        cpu = is_cpu(self.rt)
        cands = [c for c in [Single(), *(Split(k) for k in CHUNKS)] if c.applies(self)
                 and (not cpu or c.loop_iterations(self) <= CPU_LOOP_BUDGET - LOOP_MARGIN)]
        if not cands:
            raise DeviceError(f"no cached-attention pass runs {self.describe()} on {self.rt.info.name}: its rows are "
                              f"too long for this CPU adapter's loop limit (and for the split passes' scratch at "
                              f"this many queries); generate fewer tokens, fewer sequences at once, or use a GPU")
        if cpu and self.n * self.hq >= WG:
            return sorted(cands, key=lambda c: -getattr(c, "chunk", 1 << 30))
        return [*(c for c in cands if isinstance(c, Split)), *(c for c in cands if isinstance(c, Single))]

    def tolerance(self, want: np.ndarray, cand=None) -> float:
        """The largest error a correct candidate may make (each one's arithmetic is float32: cand is not read)."""
        return 1e-5 * math.sqrt(self.max_len) * 4 * (1 + float(np.max(np.abs(want))))

    def replica(self, rng):
        """(problem, output buffer, its initial values, its expected values, buffers to release): this shape on
        fresh random inputs (the caches' values as the cache's dtype stores them), every query's row full up
        to the cache's end (with blocks, the queries' positions spread over the row, each reaching its end)."""
        from wgpu_train.engines.shared import attention as ops

        n, b, L, hq, hkv, d = self.n, self.batch, self.max_len, self.hq, self.hkv, self.d
        fmt = self.kv_dtype.storage
        q = rng.standard_normal((n, hq, d)).astype(np.float32)
        kc, vc = (storage.from_words(storage.to_words(rng.standard_normal((b, L, hkv, d)), fmt), b * L * hkv * d, fmt)
                  .reshape(b, L, hkv, d) for _ in range(2))                  # as the cache stores them
        rows, pos = (np.arange(n) % b).astype(np.int32), np.full(n, L - 1, np.int32)
        sinks = rng.standard_normal(hq).astype(np.float32)
        blocks = None
        if self.blocks:     # a block per cache row: its queries at positions 0.., each reaching the last of them
            pos = np.minimum(np.arange(n) // b, L - 1).astype(np.int32)
            blocks = rows.copy()
        want = ops.attention_cached_forward(*(x.astype(np.float64) for x in (q, kc, vc)), rows, pos, self.window,
                                            self.softcap, sinks if self.sinks else None, blocks=blocks).ravel()
        if self.blocks:
            pos = with_reaches(pos, blocks, rows)
        bufs = [self.rt.upload(q, "tune operand"), *(storage.upload(self.rt, x, fmt, "tune operand") for x in (kc, vc)),
                *(self.rt.upload(x, "tune operand") for x in (rows, pos, sinks))]
        bufs.append(self.rt.buffer(max(1, self.scratch_elems) * 4, "tune scratch"))
        c0 = np.zeros(want.size, np.float32)
        res = self.rt.upload(c0, "tune result")
        bufs.append(res)
        tensors = dict(q=bufs[0], k_cache=bufs[1], v_cache=bufs[2], rows=bufs[3], positions=bufs[4], sinks=bufs[5],
                       part=bufs[6], part_in=bufs[6], out=res)
        rep = DecodeProblem(self.rt, tensors, n, b, L, hq, hkv, d, self.window, self.softcap, self.scratch_elems,
                            self.kv_dtype, self.sinks, self.blocks)
        return rep, res, c0, want, bufs


def with_reaches(positions, blocks, rows) -> np.ndarray:
    """The positions' binding of a prefill with image blocks: positions (n,), then each query's reach (the last
    position of its block in its cache row, blocks (n,) a block number per image token and -1 for text, rows (n,)
    the queries' cache rows; else its own position), (2n,) i32."""
    positions = np.asarray(positions, np.int32)
    reach = positions.copy()
    for r, n in {(r, n) for r, n in zip(rows, blocks) if n >= 0}:
        at = (rows == r) & (blocks == n)
        reach[at] = positions[at].max()
    return np.concatenate([positions, reach]).astype(np.int32)


def _dispatch(p: DecodeProblem, k: Kernel, groups, chunk=0, splits=0) -> tuple:
    cache = p.batch * p.max_len * p.hkv * p.d
    big, part = p.n * p.hq * p.d, p.n * p.hq * max(1, splits) * (p.d + 2)
    sizes = {"out": big, "q": big, "k_cache": cache, "v_cache": cache, "rows": p.n, "positions": (1 + p.blocks) * p.n,
             "part": part, "part_in": part, "sinks": p.hq if p.sinks else 1}
    pipeline, resources = prepare(p.rt, k, [(p.t[name], sizes[name]) for name in k.names], n=p.n, max_len=p.max_len,
                                  batch=p.batch, hq=p.hq, hkv=p.hkv, d=p.d, scale=1.0 / math.sqrt(p.d),
                                  window=p.window, softcap=p.softcap, chunk=chunk, splits=splits, sinks=int(p.sinks),
                                  blocks=int(p.blocks))
    return pipeline, resources, groups


class Single:
    """One invocation per (query, head): an online softmax over the query's whole row."""

    name, family = "decode/single", "single"

    def applies(self, p: DecodeProblem) -> bool:
        return True

    def loop_iterations(self, p: DecodeProblem) -> int:
        """Per invocation at most, as llvmpipe counts them (each loop its iterations and one more): zeroing the
        accumulator, the positions a query sees (each a dot product and an update over D), the write."""
        seen = min(p.max_len, p.window) if p.window and not p.blocks else p.max_len
        return seen * (2 * p.d + 3) + 2 * p.d + 3

    def dispatches(self, p: DecodeProblem) -> list:
        return [_dispatch(p, SINGLE, flat_grid(-(-(p.n * p.hq) // WG)))]


class Split:
    """One invocation per (query, head, chunk of `chunk` positions), then one per (query, head, dim) merging the
    chunks' partial softmaxes."""

    family = "split"

    def __init__(self, chunk: int):
        self.chunk, self.name = chunk, f"decode/split{chunk}"

    def splits(self, p: DecodeProblem) -> int:
        return -(-p.max_len // self.chunk)

    def applies(self, p: DecodeProblem) -> bool:
        s = self.splits(p)
        return 2 <= s <= MAX_SPLITS and p.n * p.hq * s * (p.d + 2) <= p.scratch_elems

    def loop_iterations(self, p: DecodeProblem) -> int:
        """Per invocation at most, as llvmpipe counts them (each loop its iterations and one more): a chunk's
        positions as in the single pass (the partial), or the two loops over the chunks (the combine)."""
        return max(self.chunk * (2 * p.d + 3) + 2 * p.d + 3, 2 * (self.splits(p) + 1))

    def dispatches(self, p: DecodeProblem) -> list:
        splits = self.splits(p)
        pairs = (p.d + 1) // 2          # the combine: an invocation per pair of output elements
        return [_dispatch(p, PARTIAL, flat_grid(-(-(p.n * p.hq * splits) // WG)), self.chunk, splits),
                _dispatch(p, COMBINE, flat_grid(-(-(p.n * p.hq * pairs) // WG)), self.chunk, splits)]


def all_kernels() -> list[Kernel]:
    """Every kernel descriptor of the cache write and the cached attention, for each cache dtype (the
    binding-limit and Tint checks go through them)."""
    return [_for_cache(k, slots, dtype) for dtype in KvDtype
            for k, slots in ((CACHE_WRITE, (1, 2)), (SINGLE, (3, 4)), (PARTIAL, (3, 4)))] + [COMBINE]


FAMILY = Family("decode", shaders=("attention_cached", "kv_cache"), modules=(__file__,), all_kernels=all_kernels,
                benches=("decode",))
