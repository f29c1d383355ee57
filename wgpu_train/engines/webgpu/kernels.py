"""Python wrappers for the WGSL op kernels: one function per op (same names and argument order as
engines/numpy/ops.py and engines/numpy/optim.py), recording dispatches into a Recorder; nothing is read back.
(Over 450 lines on purpose: the one catalogue of op wrappers, mirroring engines/numpy/ops.py, that every
recording imports as K; the tuned families' wrappers live in gemm.py, quant.py and attention.py.)

Conventions shared by every wrapper:
- The Recorder comes first, then the output buffers, then the inputs and weights, then the sizes.
- A tensor argument is a GPUBuffer (data from byte 0) or a tuple (buffer, element_offset), the offset
  counted in 4-byte elements (f32 or i32). Any offset works: the wrapper binds the smallest range
  that starts at an offset aligned to min-storage-buffer-offset-alignment and covers the tensor,
  and passes the remainder (< alignment / 4 elements) to the shader in the uniform. So a per-layer
  slice of a large buffer (over max-storage-buffer-binding-size in total) is fine as long as the
  tensor itself fits one binding.
- All data is fp32; ids, positions, targets and segment ids are i32 (u32 values below 2^31 read the same).
- An output may not share a buffer with an input of the same dispatch (WebGPU forbids a read-write
  binding next to a read-only one of the same buffer; the wrappers raise ValueError at record time),
  except where a wrapper documents in-place use: then pass the very same tensor (same buffer, same
  offset) as output and input. Outputs may share a buffer with each other (non-overlapping ranges).
- Sizes and offsets go into one 96-byte uniform per distinct content (rt.uniform caches them), and
  pipelines and bind groups are cached, so a recorded step creates nothing new after warm-up.
"""
from __future__ import annotations

import functools
import weakref

import numpy as np

from wgpu_train.errors import DeviceError
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.launch import Kernel, bind, flat_grid, launch
from wgpu_train.engines.webgpu.device.operands import split

WG = 256                 # workgroup size of the elementwise-style kernels
RMS_WG = 64              # rmsnorm row workgroup (shaders/rmsnorm.wgsl WG)
RMS_ROWS_PER_BLOCK = 32  # rows summed by one invocation of the dweight partial pass
RMS_ROW_MAX_C = 256      # GPUs: one invocation per rmsnorm row up to this C, a workgroup per row above
RMS_ROW_MAX_C_CPU = 1 << 30  # CPU adapters: always one invocation per row (barriers cost more there)
NORM_ELEMS_PER_WORKGROUP = 4096  # gradient elements per workgroup of the norm's partial sums
NORM_MAX_WORKGROUPS = 1024
HPARAM_ROWS = 16         # AdamW hyper-parameter sets that may be live between submits


# ---- plumbing --------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _kernel(shader: str, entry: str, bindings: str, constants: tuple = ()) -> Kernel:
    return Kernel(shader, entry, bindings, constants)


class _State:
    """Per-runtime constants: small constant buffers and the AdamW hyper-parameter ring (Runtime.memo)."""

    def __init__(self, rt):
        self.one = rt.upload(np.ones(1, np.float32), "kernels.one")                      # grad scale 1
        self.no_clip = rt.upload(np.array([0.0, 1.0, 1.0], np.float32), "kernels.no_clip")  # norm, clip, finite
        self.hp_stride = max(32, rt.offset_alignment)
        self.hp = rt.buffer(HPARAM_ROWS * self.hp_stride, "kernels.adamw_hparams")
        self.hp_rows: dict = {}              # content bytes -> row
        self.hp_owner = [None] * HPARAM_ROWS  # weak reference to the recorder that last used a row
        self.hp_next = 0
        self.hp_written = weakref.WeakKeyDictionary()  # recorder -> hyper-parameter sets it wrote


def _state(rt) -> _State:
    return rt.memo("kernels.state", _State)


def _run(rec, shader, entry, groups, tensors, sizes=(), floats=(), constants=None):
    """One dispatch of shader.entry, whose Params are the generic s0..s7 sizes, o1..o12 offsets and f0..f3
    scalars. tensors: (tensor, n_elements, name, writable) for bindings 1.. in order."""
    bindings = " ".join(name + ("!" if w else "") for _, _, name, w in tensors)
    k = _kernel(shader, entry, bindings, tuple(sorted((constants or {}).items())))
    params = {f"s{i}": int(v) for i, v in enumerate(sizes)}
    params.update({f"f{i}": float(v) for i, v in enumerate(floats)})
    launch(rec, k, groups, [(t, n) for t, n, _, _ in tensors], **params)


def _format(t) -> str:
    """The storage format of tensor t's buffer (device/storage.py)."""
    return storage.format_of(split(t)[0])


def _float32(what, **tensors):
    """Refuse a 16-bit tensor (ValueError) where a kernel keeps float32: a statistic, a weight's gradient, partial
    sums, a LoRA internal. Such a binding may share its number with a 16-bit one of another entry point of the
    shader, so launch() would not catch it."""
    bad = [name for name, t in tensors.items() if t is not None and _format(t) != "f32"]
    if bad:
        raise ValueError(f"{what}: {', '.join(bad)} must be float32 tensors, not 16-bit ones")


def _same(a, b) -> bool:
    ba, oa = split(a)
    bb, ob = split(b)
    return ba is bb and oa == ob


def _elems(rec, shader, entry, n, tensors, sizes=(), floats=()):
    if n > 0:
        _run(rec, shader, entry, flat_grid(-(-n // WG)), tensors, sizes, floats)


def _pairs(rec, entry, n, tensors, sizes=(), floats=(), shader="elementwise"):
    """One dispatch of shaders/<shader>.wgsl's entry: an invocation per pair of elements."""
    if n > 0:
        _run(rec, shader, entry, flat_grid(-(-n // (2 * WG))), tensors, sizes, floats)


# ---- elementwise ----------------------------------------------------------------------------

def add(rec, y, a, b, n):
    """y = a + b over n elements; in place (y += other) when y is a or b."""
    if _same(y, a):
        return add_inplace(rec, y, b, n)
    if _same(y, b):
        return add_inplace(rec, y, a, n)
    _pairs(rec, "add", n, [(y, n, "y", True), (a, n, "a", False), (b, n, "b", False)], (n,))


def add_inplace(rec, y, a, n, alpha=1.0):
    """y += alpha * a over n elements."""
    _pairs(rec, "add_inplace", n, [(y, n, "y", True), (a, n, "a", False)], (n,), (alpha,))


def scale(rec, y, x, s, n):
    """y = s * x over n elements; in place when y is x."""
    if _same(y, x):
        _pairs(rec, "scale_inplace", n, [(y, n, "y", True)], (n,), (s,))
    else:
        _pairs(rec, "scale", n, [(y, n, "y", True), (x, n, "x", False)], (n,), (s,))


def softcap_forward(rec, y, x, cap, n):
    """y = cap * tanh(x / cap) over n elements (logit soft-capping); in place when y is x. Its backward is
    cross_entropy_backward's softcap factor (and the attention kernels' own)."""
    if _same(y, x):
        _pairs(rec, "softcap_forward_inplace", n, [(y, n, "y", True)], (n,), (cap,))
    else:
        _pairs(rec, "softcap_forward", n, [(y, n, "y", True), (x, n, "x", False)], (n,), (cap,))


def copy(rec, y, x, n):
    """y = x over n elements, inside the compute pass (Recorder.copy would end it)."""
    _pairs(rec, "copy", n, [(y, n, "y", True), (x, n, "x", False)], (n,))


def fill(rec, y, value, n):
    """y = value over n elements."""
    _pairs(rec, "fill", n, [(y, n, "y", True)], (n,), (value,))


# ---- embedding ------------------------------------------------------------------------------

def embedding_forward(rec, out, ids, weight, N, C, vocab_rows, row_offset=0):
    """out (N, C) = weight[ids - row_offset] for ids in [row_offset, row_offset + vocab_rows).

    weight holds vocabulary rows row_offset.. (vocab_rows, C); rows of out whose id lies outside
    that range are left untouched, so a vocabulary split across buffers takes one call per chunk.
    out and weight may be in any storage format each (a row copy converts); one invocation per pair
    of row elements.
    """
    _elems(rec, "embedding", "embedding_forward", N * ((C + 1) // 2),
           [(out, N * C, "out", True), (ids, N, "ids", False), (weight, vocab_rows * C, "weight", False)],
           (N, C, row_offset, vocab_rows))


def embedding_scratch_size(N):
    """Elements (i32) of scratch embedding_backward needs."""
    return 2 * N


def embedding_backward(rec, dweight, dout, ids, N, C, vocab_rows, scratch, row_offset=0, accumulate=False):
    """dweight (vocab_rows, C) = scatter-add of dout (N, C) rows into their ids' rows, for the ids in
    [row_offset, row_offset + vocab_rows); deterministic, no atomics. dout in any storage format, dweight
    float32.

    Rows no token hits are zeroed, unless accumulate=True, which adds into dweight instead.
    scratch: at least embedding_scratch_size(N) elements (token links; finding them costs O(N^2)
    id comparisons, cheap for the N of one step).
    """
    if not accumulate:
        fill(rec, dweight, 0.0, vocab_rows * C)
    if N <= 0:
        return
    _elems(rec, "embedding", "embedding_backward_links", N,
           [(scratch, 2 * N, "scratch", True), (ids, N, "ids", False)], (N, C, row_offset, vocab_rows))
    _elems(rec, "embedding", "embedding_backward", N * C,
           [(dweight, vocab_rows * C, "dweight", True), (dout, N * C, "dout", False), (ids, N, "ids", False),
            (scratch, 2 * N, "scratch", False)],
           (N, C, row_offset, vocab_rows, 1))


def row_gather_forward(rec, out, x, rows, N, C, x_rows):
    """out (N, C) = x[rows] for rows (N,) i32 in [0, x_rows): embedding_forward's gather, over activations
    (out and x in any storage format each)."""
    embedding_forward(rec, out, rows, x, N, C, x_rows)


def row_gather_backward(rec, dx, dout, rows, N, C, x_rows, accumulate=False, keep=False):
    """dx (x_rows, C) = dout (N, C) rows written to rows (N,) i32, which must be distinct (a plain scatter,
    no links pass); rows no index names are zeroed, unless accumulate=True, which adds into dx instead (in
    float32, rounded once to dx's format), or keep=True, which leaves them as they are (Gemma 3's image
    embeddings over their tokens' rows). dx and dout in any storage format each."""
    if not (accumulate or keep):
        fill(rec, dx, 0.0, x_rows * C)
    _elems(rec, "embedding", "row_gather_backward", N * ((C + 1) // 2),
           [(dx, x_rows * C, "dx", True), (dout, N * C, "dout", False), (rows, N, "rows", False)],
           (N, C, 0, x_rows, int(bool(accumulate))))


# ---- rmsnorm --------------------------------------------------------------------------------

def rms_row_max_c(rt):
    """Largest C given one invocation per row (no barriers). On CPU adapters (llvmpipe) a row per
    invocation beats a workgroup per row at every C measured (8 to 8192: 4x to 200x); on GPUs it
    keeps small rows (Qwen3's per-head q/k norms, small hidden sizes) off the barrier path, while
    long rows keep a workgroup each for coalesced loads and enough parallelism."""
    return RMS_ROW_MAX_C_CPU if getattr(rt.info, "adapter_type", "") == "CPU" else RMS_ROW_MAX_C


def _rms_vec4(rt, C, tensors):
    """Whether the vec4 entry points may read these (tensor, n_elements, name) bindings: float32 ones, C % 4 == 0
    and offsets that allow."""
    return C % 4 == 0 and all(_format(t) == "f32" and bind(rt, t, n, name, True)[1] % 4 == 0 for t, n, name in tensors)


def rmsnorm_forward(rec, y, rstd, x, weight, N, C, eps, offset=0.0):
    """y (N, C) = x * rstd * (weight + offset), rstd (N,) = 1 / sqrt(mean(x^2) + eps). x and y in any storage
    format, rstd and weight float32.

    One invocation per row for C <= the row threshold (vec4 loads when the tensors are float32, C % 4 == 0 and
    the offsets allow), else one workgroup per row."""
    _float32("rmsnorm_forward", rstd=rstd)
    if N <= 0:
        return
    tensors = [(y, N * C, "y", True), (rstd, N, "rstd", True), (x, N * C, "x", False),
               (weight, C, "weight", False)]
    if C <= rms_row_max_c(rec.rt):
        vec = _rms_vec4(rec.rt, C, [(y, N * C, "y"), (x, N * C, "x"), (weight, C, "weight")])
        _run(rec, "rmsnorm", "rmsnorm_forward_row4" if vec else "rmsnorm_forward_row",
             flat_grid(-(-N // RMS_WG)), tensors, (N, C), (eps, offset))
    else:
        _run(rec, "rmsnorm", "rmsnorm_forward", flat_grid(N), tensors, (N, C), (eps, offset))


def rmsnorm_scratch_size(N, C):
    """Elements of scratch rmsnorm_backward needs for dweight's partial sums."""
    return -(-N // RMS_ROWS_PER_BLOCK) * C


def rmsnorm_backward(rec, dx, dweight, dy, x, weight, rstd, N, C, scratch, accumulate=False, offset=0.0,
                     accumulate_dx=False):
    """dx (N, C) and dweight (C,) of rmsnorm_forward (with its offset). dx, dy and x in any storage format;
    weight, rstd, dweight and scratch float32.

    dweight is summed in two passes (per 32-row block into scratch, each invocation taking 4
    consecutive columns of one block; then over blocks); pass dweight=None to skip it (scratch is
    then unused and may be None). accumulate=True adds into dweight; accumulate_dx=True adds the gradient into
    dx (one rounding of the sum in a 16-bit dx).
    scratch: at least rmsnorm_scratch_size(N, C) elements.
    """
    _float32("rmsnorm_backward", dweight=dweight, scratch=scratch)
    if N <= 0:
        return
    rt = rec.rt
    tensors = [(dx, N * C, "dx", True), (dy, N * C, "dy", False), (x, N * C, "x", False),
               (weight, C, "weight", False), (rstd, N, "rstd", False)]
    sizes = (N, C, 0, 0, 0, int(bool(accumulate_dx)))
    if C <= rms_row_max_c(rt):
        vec = _rms_vec4(rt, C, [(dx, N * C, "dx"), (dy, N * C, "dy"), (x, N * C, "x"), (weight, C, "weight")])
        _run(rec, "rmsnorm", "rmsnorm_backward_row4" if vec else "rmsnorm_backward_row",
             flat_grid(-(-N // RMS_WG)), tensors, sizes, (0.0, offset))
    else:
        _run(rec, "rmsnorm", "rmsnorm_backward", flat_grid(N), tensors, sizes, (0.0, offset))
    if dweight is None:
        return
    nblk = -(-N // RMS_ROWS_PER_BLOCK)
    nq = -(-C // 4)
    if nblk * nq > 65535 * 65535:
        raise DeviceError(f"rmsnorm_backward: {N} rows x {C} columns are too many for one dispatch")
    sizes = (N, C, RMS_ROWS_PER_BLOCK, nblk, int(bool(accumulate)))
    vec = _rms_vec4(rt, C, [(dy, N * C, "dy"), (x, N * C, "x")])
    _run(rec, "rmsnorm", "rmsnorm_backward_partial4v" if vec else "rmsnorm_backward_partial4",
         flat_grid(-(-nblk * nq // RMS_WG)),
         [(scratch, nblk * C, "scratch", True), (dy, N * C, "dy", False), (x, N * C, "x", False),
          (rstd, N, "rstd", False)], sizes)
    _run(rec, "rmsnorm", "rmsnorm_backward_weight", (-(-C // RMS_WG),),
         [(dweight, C, "dweight", True), (scratch, nblk * C, "scratch", False)], sizes)


# ---- rope -----------------------------------------------------------------------------------

def _rope(rec, y, x, positions, inv_freq, N, H, D, scale, rotary, direction, per_pair):
    rotary = rotary or D
    if rotary % 2 or not 0 < rotary <= D:
        raise ValueError(f"rope rotates an even number of dims up to the head dim {D}, got {rotary}")
    half = rotary // 2
    # an invocation per two adjacent pairs; 16-bit tensors with an odd half take a head per invocation (rope.wgsl)
    whole = half % 2 == 1 and (_format(y), _format(x)) != ("f32", "f32")
    per_head = 1 if whole else -(-half // 2)
    n = N * H * per_head
    if n <= 0:
        return
    sizes = (N, H, D, half, per_head, int(whole), int(per_pair))
    n_pos = N * half if per_pair else N
    if _same(y, x):
        _elems(rec, "rope", f"rope_{direction}_inplace", n,
               [(y, N * H * D, "x", True), (positions, n_pos, "positions", False),
                (inv_freq, half, "inv_freq", False)], sizes, (scale,))
    else:
        _elems(rec, "rope", f"rope_{direction}", n,
               [(y, N * H * D, "y", True), (x, N * H * D, "x", False), (positions, n_pos, "positions", False),
                (inv_freq, half, "inv_freq", False)], sizes, (scale,))


def rope_forward(rec, y, x, positions, inv_freq, N, H, D, scale=1.0, rotary=0, per_pair=False):
    """Half-rotation RoPE: x, y (N = B*T, H, D) in any storage format, positions (N,) i32 (per_pair: (N,
    rotary/2), each rotated pair's own, Qwen3-VL's M-RoPE), inv_freq (rotary/2,); the leading `rotary` dims of
    each head (0: all) rotate, times scale, the rest pass through. In place when y is x."""
    _rope(rec, y, x, positions, inv_freq, N, H, D, scale, rotary, "forward", per_pair)


def rope_backward(rec, dx, dy, positions, inv_freq, N, H, D, scale=1.0, rotary=0, per_pair=False):
    """The rotation by the opposite angle: dx, dy (N, H, D). In place when dx is dy."""
    _rope(rec, dx, dy, positions, inv_freq, N, H, D, scale, rotary, "backward", per_pair)


# ---- split (a fused projection's output) ---------------------------------------------------

def split_forward(rec, ys, x, N, widths):
    """ys[j] (N, widths[j]) = x's j-th block of columns; x (N, sum(widths))."""
    width = sum(widths)
    for y, col, w in zip(ys, np.cumsum([0, *widths[:-1]]), widths):
        _pairs(rec, "columns_get", N * w, [(y, N * w, "y", True), (x, N * width, "a", False)],
               (N * w, w, width, int(col)))


def split_backward(rec, dx, dys, N, widths):
    """dx (N, sum(widths)) = the blocks dys[j] (N, widths[j]) side by side."""
    width = sum(widths)
    for dy, col, w in zip(dys, np.cumsum([0, *widths[:-1]]), widths):
        _pairs(rec, "columns_put", N * w, [(dx, N * width, "y", True), (dy, N * w, "a", False)],
               (N * w, w, width, int(col)))


# ---- swiglu, geglu --------------------------------------------------------------------------
# Every tensor in any storage format: an invocation per pair of elements (shaders/swiglu.wgsl).

def swiglu_forward(rec, h, gate, up, n):
    """h = silu(gate) * up over n elements."""
    _pairs(rec, "swiglu_forward", n, [(h, n, "h", True), (gate, n, "gate", False), (up, n, "up", False)], (n,),
           shader="swiglu")


def swiglu_backward(rec, dgate, dup, dh, gate, up, n):
    """dgate, dup of swiglu_forward over n elements; in place when dgate is gate and dup is up."""
    if _same(dgate, gate) and _same(dup, up):
        _pairs(rec, "swiglu_backward_inplace", n, [(gate, n, "gate", True), (up, n, "up", True), (dh, n, "dh", False)],
               (n,), shader="swiglu")
    else:
        _pairs(rec, "swiglu_backward", n,
               [(dgate, n, "dgate", True), (dup, n, "dup", True), (dh, n, "dh", False), (gate, n, "gate", False),
                (up, n, "up", False)], (n,), shader="swiglu")


def mul_forward(rec, y, a, b, n):
    """y = a * b over n elements (LFM2's gates; shaders/swiglu.wgsl's product without an activation)."""
    _pairs(rec, "mul_forward", n, [(y, n, "h", True), (a, n, "gate", False), (b, n, "up", False)], (n,), shader="swiglu")


def mul_backward(rec, da, db, dy, a, b, n):
    """da = dy * b, db = dy * a over n elements, both written."""
    _pairs(rec, "mul_backward", n, [(da, n, "dgate", True), (db, n, "dup", True), (dy, n, "dh", False),
                                    (a, n, "gate", False), (b, n, "up", False)], (n,), shader="swiglu")


def sigmoid_gate_forward(rec, y, x, g, n, c, per_element=False, groups=1):
    """y (n, c) = x * sigmoid(g), g (n, 1): Qwen2-MoE's gated shared expert; g (n, groups), each gate over c /
    groups adjacent columns: LFM3's per-head gate (the per-row kernel over n groups rows); per_element, g (n, c):
    Qwen3.5's attention output gate, a pair of elements per invocation in any storage format
    (shaders/swiglu.wgsl)."""
    n, c = n * groups, c // groups
    if per_element:
        _pairs(rec, "sigmoid_gate_elems_forward", n * c, [(y, n * c, "h", True), (g, n * c, "gate", False),
                                                          (x, n * c, "up", False)], (n * c,), shader="swiglu")
        return
    _pairs(rec, "sigmoid_gate_forward", n * c, [(y, n * c, "y", True), (x, n * c, "x", False), (g, n, "g", False)],
           (n, c), shader="swiglu")


def sigmoid_gate_backward(rec, dx, dg, dy, x, g, n, c, per_element=False, groups=1):
    """dx (n, c), dg (n, groups) of sigmoid_gate_forward, both written; an invocation per two rows of a group
    (16-bit dx and dg stored by pairs; per_element: dg (n, c), a pair of elements per invocation)."""
    n, c = n * groups, c // groups
    if per_element:
        _pairs(rec, "sigmoid_gate_elems_backward", n * c,
               [(dg, n * c, "dgate", True), (dx, n * c, "dup", True), (dy, n * c, "dh", False),
                (g, n * c, "gate", False), (x, n * c, "up", False)], (n * c,), shader="swiglu")
        return
    if n > 0:
        _run(rec, "swiglu", "sigmoid_gate_backward", flat_grid(-(-n // 128)),
             [(dx, n * c, "dx", True), (dg, n, "dg", True), (dy, n * c, "dy", False), (x, n * c, "x", False),
              (g, n, "g", False)], (n, c))


def geglu_forward(rec, h, gate, up, n):
    """h = gelu_tanh(gate) * up over n elements."""
    _pairs(rec, "geglu_forward", n, [(h, n, "h", True), (gate, n, "gate", False), (up, n, "up", False)], (n,),
           shader="swiglu")


def geglu_backward(rec, dgate, dup, dh, gate, up, n):
    """dgate, dup of geglu_forward over n elements (not in place)."""
    _pairs(rec, "geglu_backward", n,
           [(dgate, n, "dgate", True), (dup, n, "dup", True), (dh, n, "dh", False), (gate, n, "gate", False),
            (up, n, "up", False)], (n,), shader="swiglu")


# ---- cross-entropy --------------------------------------------------------------------------

def _offset(t, k):
    buf, off = split(t)
    return (buf, off + int(k))


def cross_entropy_forward(rec, loss, lse, valid, logits, targets, n_rows, V, row_offset=0):
    """One chunk of rows: logits (n_rows, V) holds global rows [row_offset, row_offset + n_rows);
    loss, lse, valid (N,) and targets (N,) i32 are indexed by global row.

    Writes loss = lse - logit[target] (0 on ignored rows), lse, valid = 1.0 / 0.0. A target is
    counted when 0 <= target < V (IGNORE_INDEX -100 and anything out of range are ignored).
    """
    if n_rows <= 0:
        return
    _run(rec, "cross_entropy", "cross_entropy_forward", flat_grid(n_rows),
         [(_offset(loss, row_offset), n_rows, "loss", True), (_offset(lse, row_offset), n_rows, "lse", True),
          (_offset(valid, row_offset), n_rows, "valid", True), (logits, n_rows * V, "logits", False),
          (_offset(targets, row_offset), n_rows, "targets", False)], (n_rows, V))


def softmax_entropy_forward(rec, entropy, logits, lse, n_rows, V, row_offset=0):
    """entropy (N,) by global row = the entropy of each softmax row of the chunk logits (n_rows, V) (global rows
    [row_offset, row_offset + n_rows)), from cross_entropy_forward's lse."""
    if n_rows <= 0:
        return
    _run(rec, "cross_entropy", "softmax_entropy_forward", flat_grid(n_rows),
         [(_offset(entropy, row_offset), n_rows, "entropy", True), (logits, n_rows * V, "logits", False),
          (_offset(lse, row_offset), n_rows, "lse", False)], (n_rows, V))


def cross_entropy_reduce(rec, result, loss, valid, N):
    """result[0:2] = [sum of loss, number of counted rows] over N rows (one workgroup): 8 bytes to read."""
    _run(rec, "cross_entropy", "cross_entropy_reduce", (1,),
         [(result, 2, "result", True), (loss, max(1, N), "loss", False), (valid, max(1, N), "valid", False)],
         (0, 0, 0, N))


def cross_entropy_backward(rec, dlogits, logits, targets, lse, grad_scale, n_rows, V, row_offset=0, softcap=0.0,
                           row_weights=None, multiplier=1.0):
    """dlogits (n_rows, V) = grad_scale * (softmax - onehot) on counted rows, 0 on ignored rows, for
    the chunk of global rows [row_offset, row_offset + n_rows) (targets and lse by global row). softcap > 0:
    the logits are soft-capped ones (softcap_forward) and dlogits is with respect to the uncapped ones.

    grad_scale: a tensor whose first element is the scale (computed on the GPU, e.g. 1/count), or a
    Python float (baked into the uniform: prefer a buffer for values that change every step).
    row_weights: None, or a tensor (N,) by global row that multiplies each row's gradient too (a preference
    objective's per-token coefficients). multiplier: one more factor of every row's gradient (1 / temperature
    where the logits were divided by it). In place when dlogits is logits.
    """
    if n_rows <= 0:
        return
    if n_rows > 65535:
        raise ValueError(f"cross_entropy_backward: chunks of at most 65535 rows, got {n_rows}")
    if isinstance(grad_scale, (int, float, np.floating)):
        scale_t, mult = _state(rec.rt).one, float(grad_scale) * multiplier
    else:
        scale_t, mult = grad_scale, float(multiplier)
    weights, stride = (_state(rec.rt).one, 0) if row_weights is None else (_offset(row_weights, row_offset), 1)
    groups = (-(-V // WG), n_rows)
    tg, ls = _offset(targets, row_offset), _offset(lse, row_offset)
    wt = (weights, n_rows if stride else 1, "row_weights", False)
    if _same(dlogits, logits):
        _run(rec, "cross_entropy", "cross_entropy_backward_inplace", groups,
             [(logits, n_rows * V, "logits", True), (tg, n_rows, "targets", False), (ls, n_rows, "lse", False),
              (scale_t, 1, "grad_scale", False), wt], (n_rows, V, stride), (mult, softcap))
    else:
        _run(rec, "cross_entropy", "cross_entropy_backward", groups,
             [(dlogits, n_rows * V, "dlogits", True), (logits, n_rows * V, "logits", False),
              (tg, n_rows, "targets", False), (ls, n_rows, "lse", False), (scale_t, 1, "grad_scale", False), wt],
             (n_rows, V, stride), (mult, softcap))


# ---- a per-token objective's gradient weights (shaders/token_objective.wgsl) -------------------

TOKEN_LOSS_CODES = {"clipped": 0, "cispo": 1, "sapo": 2}      # the shader's s1, by TokenObjective.loss


def token_objective_backward(rec, weights, loss, terms, objective, n_rows, row_offset=0):
    """weights (N,) = -scale * d(token loss) / d logp of a TokenObjective (engines/protocol.py) for the chunk of
    global rows [row_offset, row_offset + n_rows), from the loss head's rows loss (N,) = -logp and terms (N, 4) =
    objective.terms() in the head's row order: cross_entropy_backward's row_weights. One invocation per row."""
    if n_rows <= 0:
        return
    o = objective
    if o.loss == "clipped":
        params = (1.0 - o.epsilon_low, 1.0 + o.epsilon_high)
    elif o.loss == "cispo":
        params = (o.epsilon_high, 0.0)
    else:
        params = (o.temperature_pos, o.temperature_neg)
    flags = (1 if o.old_logps is not None else 0) | (2 if o.bias_correction_kl else 0)
    _float32("token_objective_backward", weights=weights, loss=loss, terms=terms)
    _run(rec, "token_objective", "token_objective_backward", flat_grid(-(-n_rows // WG)),
         [(_offset(weights, row_offset), n_rows, "weights", True), (_offset(loss, row_offset), n_rows, "loss", False),
          (_offset(terms, 4 * row_offset), 4 * n_rows, "terms", False)],
         (n_rows, TOKEN_LOSS_CODES[o.loss], flags), (o.beta,) + params)


# ---- optimizer ------------------------------------------------------------------------------

def grad_norm_slots(n: int) -> int:
    """Partial-sum slots (workgroups) grad_norm_partial uses for n elements: one per 4096, 1 to 1024."""
    return max(1, min(NORM_MAX_WORKGROUPS, -(-int(n) // NORM_ELEMS_PER_WORKGROUP)))


def grad_norm_partial(rec, partials, slot, grad, n, accumulate=False):
    """partials[slot : slot + grad_norm_slots(n)] = sums of grad[:n]^2 over parts of it (one workgroup
    each); accumulate=True adds to the slots instead, e.g. for a tensor split across buffers."""
    slots = grad_norm_slots(n)
    _run(rec, "adamw", "grad_norm_partial", (slots,),
         [(partials, slot + slots, "partials", True), (grad, max(1, n), "grad", False)],
         (n, slot, int(bool(accumulate))))


def grad_norm_finalize(rec, result, partials, n_slots, max_norm):
    """result[0:3] = [norm, clip_scale, finite_flag] from partials[:n_slots]: clip_scale is
    min(1, max_norm / (norm + 1e-6)) (1 when max_norm <= 0); finite_flag is 0.0 (and clip_scale 0)
    when the norm is inf or nan, 1.0 otherwise."""
    _run(rec, "adamw", "grad_norm_finalize", (1,),
         [(result, 3, "result", True), (partials, max(1, n_slots), "partials", False)], (n_slots,),
         (max_norm if max_norm is not None else 0.0,))


def _hparams_row(rec, values):
    """The row of the AdamW hyper-parameter ring holding `values`.

    Per-step values live in a storage ring rather than in uniforms so that a changing lr or step
    does not create a uniform and a bind group per tensor per step. A set is written (32 bytes)
    the first time each recording uses it, so uploads per step do not depend on history; a row is
    overwritten only after HPARAM_ROWS newer sets: record and submit one step at a time.
    """
    st = _state(rec.rt)
    data = np.asarray(values, np.float32)
    key = data.tobytes()
    written = st.hp_written.setdefault(rec, set())
    row = st.hp_rows.get(key)
    if row is None:
        row = st.hp_next
        owner = st.hp_owner[row]
        if owner is not None and owner() is rec:
            raise RuntimeError(f"more than {HPARAM_ROWS} distinct AdamW hyper-parameter sets in one recording")
        st.hp_next = (row + 1) % HPARAM_ROWS
        st.hp_rows = {k: r for k, r in st.hp_rows.items() if r != row}
        st.hp_rows[key] = row
    if key not in written:
        rec.rt.write(st.hp, data, row * st.hp_stride)
        written.add(key)
    st.hp_owner[row] = weakref.ref(rec)
    return (st.hp, row * st.hp_stride // 4)


def adamw_update(rec, param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, scale_buf=None):
    """One AdamW step in place on param, m, v (n elements), as numpy.optim.adamw_update with
    grad_scale = scale_buf[1]; no change at all when scale_buf[2] (the finite flag) is 0.

    scale_buf: the [norm, clip_scale, finite_flag] tensor grad_norm_finalize writes, or None for
    scale 1 without the check. step counts from 1; bias corrections are formed in float64 here.
    """
    if n <= 0:
        return
    lr, b1, b2, wd = float(lr), float(beta1), float(beta2), float(weight_decay)
    hp = [1.0 - lr * wd, b1, 1.0 - b1, b2, 1.0 - b2, lr / (1.0 - b1 ** step), 1.0 / (1.0 - b2 ** step), float(eps)]
    row = _hparams_row(rec, hp)
    scale_t = scale_buf if scale_buf is not None else _state(rec.rt).no_clip
    _elems(rec, "adamw", "adamw_update", n,
           [(param, n, "param", True), (m, n, "m", True), (v, n, "v", True), (grad, n, "grad", False),
            (row, 8, "hparams", False), (scale_t, 3, "scale_buf", False)], (n,))


# ---- wrappers of the engine's helper shaders (lora_dropout, attention_cached, kv_cache) ---------
# Their Params have named fields and no offsets: each tensor must start on an aligned offset.

LORA_DROPOUT = {d: Kernel("lora_dropout", f"lora_dropout_{d}", "y! x seeds") for d in ("forward", "backward")}


def _lora_dropout(rec, direction, y, x, seeds, seed_slot, p, n):
    if n <= 0:
        return
    inv_keep = float(np.float32(1.0) / np.float32(1.0 - p))  # as numpy.ops.dropout_mask scales
    launch(rec, LORA_DROPOUT[direction], flat_grid(-(-n // (2 * WG))), [(y, n), (x, n), (seeds, seed_slot + 1)],
           n=int(n), seed_slot=int(seed_slot), threshold=int(p * (1 << 24)), inv_keep=inv_keep)


def lora_dropout_forward(rec, y, x, seeds, seed_slot, p, n):
    """y = x * dropout_mask(seeds[seed_slot], n, p) (numpy.ops.dropout_mask), over n elements; x and y in any
    storage format (the engine keeps y, the masked LoRA input, float32)."""
    _lora_dropout(rec, "forward", y, x, seeds, seed_slot, p, n)


def lora_dropout_backward(rec, dx, dy, seeds, seed_slot, p, n):
    """dx += dy * the same mask, over n elements; dx and dy in any storage format (a 16-bit dx rounded once)."""
    _lora_dropout(rec, "backward", dx, dy, seeds, seed_slot, p, n)


# ---- DoRA (shaders/dora.wgsl) ------------------------------------------------------------------

def dora_norm(rec, rnorm, weight_sq, pt, g, lora_b, scale, out_f, r):
    """rnorm (out,) = 1 / ||W + scale B A|| per row (numpy.ops.dora_norm) from weight_sq = ||W||^2 (out,),
    pt = A W^T (r, out), g = A A^T (r, r), lora_b (out, r), all float32. Forward only: the norm is detached."""
    _float32("dora_norm", rnorm=rnorm)
    _elems(rec, "dora", "dora_norm", out_f, [(rnorm, out_f, "rnorm", True), (weight_sq, out_f, "weight_sq", False),
                                             (pt, r * out_f, "pt", False), (g, r * r, "g", False),
                                             (lora_b, out_f * r, "lora_b", False)], (out_f, r), (scale,))


def dora_forward(rec, y, z, magnitude, rnorm, bias, N, out_f, offset=0.0, accumulate=False):
    """y (N, out) (+)= (magnitude * rnorm - offset) * z (N, out) + bias (out,) or None; y and z in any storage
    format (the engine keeps z, a LoRA internal, float32), the rest float32."""
    n = N * out_f
    bias_t = bias if bias is not None else _state(rec.rt).one
    _pairs(rec, "dora_forward", n,
           [(y, n, "y", True), (z, n, "z", False), (magnitude, out_f, "m", False), (rnorm, out_f, "rnorm", False),
            (bias_t, out_f if bias is not None else 1, "bias", False)],
           (n, out_f, int(accumulate), int(bias is not None)), (offset,), shader="dora")


def dora_backward(rec, dz, dmagnitude, dy, z, magnitude, rnorm, N, out_f, offset=0.0):
    """dz (N, out) = (magnitude * rnorm - offset) * dy; dmagnitude (out,) += rnorm * sum_rows(dy * z). dy in any
    storage format, the rest float32."""
    _float32("dora_backward", dz=dz)
    if N <= 0 or out_f <= 0:
        return
    n = N * out_f
    _run(rec, "dora", "dora_backward", (-(-out_f // 64), 1),
         [(dz, n, "dz", True), (dy, n, "dy", False), (z, n, "z", False), (magnitude, out_f, "m", False),
          (rnorm, out_f, "rnorm", False), (dmagnitude, out_f, "dm", True)], (N, out_f), (offset,))
