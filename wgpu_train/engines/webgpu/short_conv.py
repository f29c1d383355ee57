"""The short convolution's op wrappers on the WebGPU engine (the short_conv kernel family,
tuned/short_conv_kernels.py), with the reference's names and argument order (engines/shared/short_conv.py): outputs
first, then inputs, then sizes, then scratch. They record into a Recorder and neither submit nor read back.

Buffers: x, dy and the outputs y, dx in any storage format (device/storage.py; 16-bit outputs need an even C), the
weight (C, 1, K) in any, dw, the scratch and the step's state float32, segment ids int32 (B, T), 0 = padding.
activation: None, or "silu" applied to the convolution's output (Qwen3.5's conv1d), its gradient in the backward
(which recomputes the pre-activation from x: nothing is stored between the passes)."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.launch import flat_grid, launch
from wgpu_train.engines.webgpu.device.operands import split
from wgpu_train.engines.webgpu.tuned import short_conv_kernels as SK
from wgpu_train.engines.webgpu.tuned import tune

scratch_size = SK.scratch_size


def _check(C: int, K: int, activation, outputs=(), floats=()):
    if not 1 <= K <= SK.MAX_K:
        raise ValueError(f"the short convolution's kernels take kernel sizes 1..{SK.MAX_K}, got {K}")
    if activation not in SK.ACTIVATIONS:
        raise ValueError(f"the short convolution's activation is None or 'silu', got {activation!r}")
    for t in outputs:
        if t is not None and C % 2 and storage.format_of(split(t)[0]) != "f32":
            raise ValueError(f"16-bit outputs of the short convolution need an even channel count, got {C}")
    for t in floats:
        if t is not None and storage.format_of(split(t)[0]) != "f32":
            raise ValueError("the short convolution's weight gradient, scratch and state are float32 buffers")


def short_conv_forward(rec, y, x, weight, segment_ids, B: int, T: int, C: int, K: int, activation=None):
    """y (B, T, C) <- x (B, T, C), weight (C, 1, K), segment_ids (B, T) i32 or None (every position real, one
    sequence per row): y[t] = act(sum_k weight[:, 0, K-1-k] x[t-k]) over the lags k in t's sequence."""
    _check(C, K, activation, outputs=(y,))
    if B * T * C <= 0:
        return
    p = SK.ShortConvProblem(rec.rt, dict(y=y, x=x, weight=weight, segments=segment_ids), B, T, C, K, activation)
    for d in tune.choose(rec.rt, p).dispatches(p):
        rec.dispatch(*d)


def short_conv_backward(rec, dx, dw, dy, x, weight, segment_ids, B: int, T: int, C: int, K: int, scratch=None,
                        activation=None, accumulate_dw: bool = False):
    """Gradients of short_conv_forward (the same x, weight, segments and activation): dx (B, T, C) written and dw
    (C, 1, K) float32 (None: not computed, as when the weight does not train; accumulate_dw: added to what it holds)
    from dy (B, T, C). scratch: scratch_size(B, T, C, K) float32 elements, needed with a dw."""
    _check(C, K, activation, outputs=(dx,), floats=(dw, scratch))
    if dw is not None and scratch is None:
        raise ValueError("the short convolution's weight gradient needs its scratch (scratch_size elements)")
    if B * T * C <= 0:
        return
    t = dict(dx=dx, dw=dw, dy=dy, x=x, weight=weight, segments=segment_ids, scratch=scratch if dw is not None else None)
    # the candidate the tuner chose for this shape's forward (dx has y's shape and format)
    cand = tune.choose(rec.rt, SK.ShortConvProblem(rec.rt, dict(x=x, y=dx, weight=weight), B, T, C, K, activation))
    for d in cand.backward_dispatches(SK.ShortConvProblem(rec.rt, t, B, T, C, K, activation, accumulate_dw)):
        rec.dispatch(*d)


def step_table(runs) -> np.ndarray:
    """The step kernel's int32 table of generation's row runs [(slot, the tokens' indices in the call (n,),
    the first one's position)] (shared/recurrent_state.row_runs): (slot, first, count, fresh) per run, fresh when it
    starts at position 0, then every run's token indices in order."""
    head, order = [], []
    for slot, idx, start in runs:
        head += [int(slot), len(order), len(idx), int(start == 0)]
        order += [int(i) for i in idx]
    return np.asarray(head + order, np.int32)


def short_conv_step(rec, y, state, x, weight, table, runs: int, N: int, C: int, K: int, activation=None):
    """Generation's tokens through the recurrent form: y (N, C) <- x (N, C), weight (C, 1, K); state (slots,
    K-1, C) float32, each run's row (its last K-1 inputs, shared/short_conv.short_conv_cached_forward's state) read
    and replaced in place; table: step_table's int32 buffer of `runs` runs over the N tokens. One invocation per
    (run, channel pair) walks its run's tokens in order."""
    _check(C, K, activation, outputs=(y,), floats=(state,))
    if runs <= 0 or N <= 0:
        return
    launch(rec, SK.step_kernel(K), flat_grid(-(-runs * -(-C // 2) // SK.STEP_WG)),
           [(y, N * C), (state, C * max(1, K - 1)), (x, N * C), (weight, C * K), (table, 4 * runs + N)],
           b=1, t=N, c=C, act=SK.ACTIVATIONS[activation], runs=runs)
