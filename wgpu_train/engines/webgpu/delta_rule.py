"""The gated delta rule's op wrappers on the WebGPU engine (the delta_rule kernel family,
tuned/delta_rule_kernels.py), with the reference's names and argument order (engines/shared/delta_rule.py):
outputs first, then inputs, then sizes, then scratch. They record into a Recorder and neither submit nor read back.

Buffers: q, k, v, g, beta and dout in any storage format (device/storage.py); every output, the states, the scratch
and the initial state float32; segment ids int32 (B, T), 0 = padding. The forward's states (B, Hv, N, Dk, Dv),
N = ceil(T / chunk), are what the backward reads, so both must run with the same chunk: delta_rule_chunk gives the
tuner's choice for a shape, and states_size / scratch_size the elements to allocate for it.

Passes: the wrappers record a batch in passes whose scratch and states each fit one storage binding (pass_shape):
whole rows at a time, or, where one row does not fit, one row at a time over ranges of whole key-head
groups (the rule is independent per (row, value head); a key head's dq and dk sum over its group). The results equal
the one-pass run's bit for bit: every sum runs in the same order, only the bindings' offsets differ."""
from __future__ import annotations

from wgpu_train.errors import DeviceError
from wgpu_train.engines.shared.delta_rule import L2NORM_EPS
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.launch import flat_grid, launch
from wgpu_train.engines.webgpu.device.operands import at, split
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.tuned import delta_rule_kernels as DK

WG = DK.WG


def _check(chunk, Hk, Hv, *outputs):
    if chunk not in DK.CHUNKS:
        raise ValueError(f"the gated delta rule's kernels take chunks {DK.CHUNKS}, got {chunk}")
    if Hk <= 0 or Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    for t in outputs:
        if t is not None and storage.format_of(split(t)[0]) != "f32":
            raise ValueError("the gated delta rule's outputs, states and scratch are float32 buffers")


def states_size(B: int, T: int, Hv: int, Dk: int, Dv: int, chunk: int) -> int:
    """Elements of the forward's states (B, Hv, N, Dk, Dv): the state entering each chunk."""
    return B * Hv * DK.n_chunks(T, chunk) * Dk * Dv


def scratch_size(B: int, T: int, Hv: int, Dk: int, Dv: int, chunk: int, backward: bool = True) -> int:
    """Elements (float32) of the scratch the forward (backward=False) or the backward needs; per value head and
    position 2 C + 2 Dv + Dk + 3 floats forward, 4 C + 3 Dv + 6 Dk + 5 backward plus (Dk Dv + Dk) / C for
    the state gradients, and a flag per row position. One binding: the wrappers record the batch in passes of
    pass_shape's (rows, heads), so the scratch needs only scratch_size(rows, T, heads, ...)."""
    return DK.scratch_layout(B, T, Hv, Dk, Dv, chunk, backward)["size"]


def pass_shape(rt, B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, chunk: int, backward: bool = True,
               max_binding: int | None = None) -> tuple:
    """(rows, value heads) of the forward's (backward=False) or the backward's passes over a batch, whose scratch and
    states each fit one storage binding of the adapter (rt's, or max_binding where rt is None) less the 256 bytes a
    view's binding may start before its first element: all Hv heads of up to B rows, else one row and whole key-head
    groups (a multiple of Hv / Hk heads, the passes as even as may be). DeviceError (one line) when one key head's
    group over T tokens is already too much."""
    limit, rep = (rt.max_binding if rt is not None else max_binding) - 256, Hv // Hk

    def need(rows, heads):
        return 4 * max(scratch_size(rows, T, heads, Dk, Dv, chunk, backward),
                       states_size(rows, T, heads, Dk, Dv, chunk))

    if need(1, Hv) <= limit:
        return min(B, limit // need(1, Hv)), Hv
    groups = max((n for n in range(1, Hk) if need(1, n * rep) <= limit), default=0)
    if groups < 1:
        raise DeviceError(f"the gated delta rule's {'backward' if backward else 'forward'} over one sequence of {T} "
                          f"tokens needs {need(1, rep) / 2**20:.3g} MiB of scratch for one key head in one binding, "
                          f"over the device's max storage binding of {(limit + 256) / 2**20:.3g} MiB: train on "
                          f"shorter sequences")
    return 1, -(-Hk // -(-Hk // groups)) * rep


def training_bytes(B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, layers: int, checkpoint: bool,
                   max_binding: int, sixteen_bit: bool = False) -> int:
    """The bytes a training step's linear-attention layers hold beside the layer plan's activations
    (webgpu/gated_deltanet_layers.py), the most over the chunks the tuner may choose: the states of each of
    `layers` (one set under gradient checkpointing), the scratch of the forward's or the backward's passes,
    the final state, the l2norm's normalised vectors and inverse norms; with 16-bit activations the float32
    buffers the l2norm and the rule write before their results are rounded into the layer's."""
    def at(chunk, shapes):
        scratch = max(scratch_size(rows, T, heads, Dk, Dv, chunk, back) for back, (rows, heads) in enumerate(shapes))
        states = states_size(B, T, Hv, Dk, Dv, chunk) * (1 if checkpoint else layers)
        return states + scratch

    temps = B * T * (4 * Hk * Dk + 2 * Hv * Dv + 2 * Hv) if sixteen_bit else 0
    most = max(at(c, shapes) for c, shapes in _shapes(None, B, T, Hk, Hv, Dk, Dv, True, max_binding).items())
    return 4 * (most + B * Hv * Dk * Dv + B * T * Hk * (Dk + 1) + temps)


def _shapes(rt, B, T, Hk, Hv, Dk, Dv, backward: bool, max_binding: int | None = None) -> dict:
    """{chunk: [the forward's pass_shape, and the backward's where backward]} at the chunks where they fit a
    binding (those the tuner may choose); pass_shape's DeviceError where none does."""
    shapes, refused = {}, None
    for c in DK.CHUNKS:
        try:
            shapes[c] = [pass_shape(rt, B, T, Hk, Hv, Dk, Dv, c, back, max_binding)
                         for back in (False, True)[:1 + backward]]
        except DeviceError as e:
            refused = e
    if not shapes:
        raise refused
    return shapes


def _passes(rt, t: dict, B, T, Hk, Hv, Dk, Dv, chunk, backward):
    """The problem of each pass of pass_shape's size: its rows and heads, the tensors as views at its first row and
    head (the scratch whole), the tensors' head strides."""
    rows, heads = pass_shape(rt, B, T, Hk, Hv, Dk, Dv, chunk, backward)
    rep, n = Hv // Hk, DK.n_chunks(T, chunk)
    for b0 in range(0, B, rows):
        for h0 in range(0, Hv, heads):
            keys, values, scalars = (b0 * T * Hk + h0 // rep) * Dk, (b0 * T * Hv + h0) * Dv, b0 * T * Hv + h0
            state = (b0 * Hv + h0) * Dk * Dv
            first = {"q": keys, "k": keys, "dq": keys, "dk": keys, "v": values, "dv": values, "out": values,
                     "dout": values, "g": scalars, "beta": scalars, "dg": scalars, "dbeta": scalars,
                     "segments": b0 * T, "states": state * n, "final_state": state, "initial_state": state,
                     "d_initial_state": state}
            views = {name: x if x is None or name == "scratch" else at(x, first[name]) for name, x in t.items()}
            nh = min(heads, Hv - h0)
            yield DK.DeltaRuleProblem(rt, views, min(rows, B - b0), T, nh // rep, nh, Dk, Dv, chunk, (Hk, Hv))


def delta_rule_chunk(rt, B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, backward: bool = False) -> int:
    """The chunk the tuner chooses for this shape (its fastest candidate at any chunk), to size the states with,
    tuned on the smallest of the passes at the chunks (pass_shape's; the backward's too where backward). Where one
    key head's scratch fits a binding at some chunks only, the one of those with the largest passes, untuned."""
    shapes = {c: min(s, key=lambda s: s[0] * s[1]) for c, s in _shapes(rt, B, T, Hk, Hv, Dk, Dv, backward).items()}
    if len(shapes) < len(DK.CHUNKS):
        return max(shapes, key=lambda c: shapes[c][0] * shapes[c][1])
    rows, heads = min(shapes.values(), key=lambda s: s[0] * s[1])
    return tune.choose(rt, DK.DeltaRuleProblem(rt, {}, rows, T, heads // (Hv // Hk), heads, Dk, Dv)).chunk


def gated_delta_rule_forward(rec, out, final_state, states, q, k, v, g, beta, chunk: int, B: int, T: int, Hk: int,
                             Hv: int, Dk: int, Dv: int, scratch, initial_state=None, segments=None):
    """out (B, T, Hv, Dv), final_state (B, Hv, Dk, Dv) and states (B, Hv, N, Dk, Dv) <- q, k (B, T, Hk, Dk)
    l2-normalised (q scaled by 1 / sqrt(Dk) here), v (B, T, Hv, Dv), g (B, T, Hv) the log-decay, beta (B, T, Hv),
    initial_state (B, Hv, Dk, Dv) or None (zeros), segments (B, T) i32 or None (all real); scratch: at least
    scratch_size(rows, T, heads, ..., backward=False) elements, (rows, heads) = pass_shape(..., backward=False).
    The scan spread is the tuner's choice for this chunk."""
    _check(chunk, Hk, Hv, out, final_state, states, scratch)
    if B * T <= 0:
        return
    t = dict(out=out, final_state=final_state, states=states, q=q, k=k, v=v, g=g, beta=beta, scratch=scratch,
             initial_state=initial_state, segments=segments)
    for p in _passes(rec.rt, t, B, T, Hk, Hv, Dk, Dv, chunk, backward=False):
        for d in tune.choose(rec.rt, p).dispatches(p):
            rec.dispatch(*d)


def gated_delta_rule_backward(rec, dq, dk, dv, dg, dbeta, d_initial_state, dout, q, k, v, g, beta, states,
                              chunk: int, B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, scratch,
                              segments=None):
    """Gradients of gated_delta_rule_forward (the same inputs, chunk and segments; states its third output): dq, dk
    (B, T, Hk, Dk) (a key head's the sum over its group of value heads), dv (B, T, Hv, Dv), dg, dbeta (B, T, Hv),
    and d_initial_state (B, Hv, Dk, Dv) where not None (the forward had an initial state), from dout (B, T, Hv, Dv);
    every one overwritten. scratch: at least scratch_size(rows, T, heads, ...) elements, (rows, heads) =
    pass_shape(...)."""
    _check(chunk, Hk, Hv, dq, dk, dv, dg, dbeta, d_initial_state, states, scratch)
    if B * T <= 0:
        return
    t = dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, d_initial_state=d_initial_state, dout=dout, q=q, k=k, v=v,
             g=g, beta=beta, states=states, scratch=scratch, segments=segments)
    for p in _passes(rec.rt, t, B, T, Hk, Hv, Dk, Dv, chunk, backward=True):
        for d in tune.choose(rec.rt, p).backward_dispatches(p):
            rec.dispatch(*d)


def gated_delta_rule_step(rec, out, state, q, k, v, g, beta, B: int, Hk: int, Hv: int, Dk: int, Dv: int):
    """One token per row (generation): out (B, Hv, Dv) <- q, k (B, Hk, Dk) l2-normalised, v (B, Hv, Dv), g, beta
    (B, Hv); state (B, Hv, Dk, Dv) float32 read and replaced by the new state in place (a row that starts passes a
    zeroed state). One invocation per (row, head, state column)."""
    _check(DK.CHUNKS[0], Hk, Hv, out, state)
    launch(rec, DK.plain_kernel(DK.STEP, Dk, Dv), flat_grid(-(-(B * Hv * Dv) // WG)),
           [(out, B * Hv * Dv), (state, B * Hv * Dk * Dv), (q, B * Hk * Dk), (k, B * Hk * Dk), (v, B * Hv * Dv),
            (g, B * Hv), (beta, B * Hv)], b=B, hk=Hk, hv=Hv, rep=Hv // Hk, scale=Dk ** -0.5)


def l2norm_forward(rec, y, inv_norm, x, N: int, D: int, eps: float = L2NORM_EPS):
    """y (N, D) = x / sqrt(sum(x^2) + eps), inv_norm (N,) float32 <- x (N, D) in any storage format."""
    _check(DK.CHUNKS[0], 1, 1, y, inv_norm)
    launch(rec, DK.plain_kernel(DK.L2NORM_FORWARD, D), flat_grid(-(-N // WG)),
           [(y, N * D), (inv_norm, N), (x, N * D)], b=N, eps=eps)


def l2norm_backward(rec, dx, dy, y, inv_norm, N: int, D: int):
    """dx (N, D) float32 <- dy, y (N, D), inv_norm (N,): the gradient of l2norm_forward."""
    _check(DK.CHUNKS[0], 1, 1, dx)
    launch(rec, DK.plain_kernel(DK.L2NORM_BACKWARD, D), flat_grid(-(-N // WG)),
           [(dx, N * D), (dy, N * D), (y, N * D), (inv_norm, N)], b=N)
