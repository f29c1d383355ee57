"""The reference gated delta rule both engines hold to (Gated DeltaNet: Qwen3.5's and Qwen3-Next's linear attention):
the chunked forward and its exact backward over a batch, the recurrent single-token step for generation, and the
l2-normalisation of q and k as an op pair of its own. The NumPy engine runs them; the WGSL kernels are checked
against them.

The rule, per row and value head, with a state S (Dk, Dv), alpha_t = exp(g_t) (g_t <= 0: the log-decay) and
q already scaled by 1 / sqrt(Dk):

    S_t = alpha_t S_{t-1} + k_t beta_t (v_t - alpha_t S_{t-1}^T k_t)^T,        o_t = S_t^T q_t

**The chunked form.** The sequence is cut into chunks of C positions (the last one padded). Inside a chunk, with
gamma the chunk-local cumulative sum of g, a_t = exp(gamma_t) (the decay from the chunk's start to t),
E[t, j] = exp(gamma_t - gamma_j) for j <= t (and 0 above the diagonal) and S0 the state entering the chunk, the
deltas u_t (Dv) that the recurrence writes solve the unit lower-triangular system (the WY / UT form)

    (I + L) U = diag(beta) (V - diag(a) K S0),    L = strictly lower part of (diag(beta) K K^T) o E

so U = W_v - W_k S0 with W_v = P diag(beta) V, W_k = P diag(beta a) K and P = (I + L)^-1, found by forward
substitution. Then the chunk's output and the state it hands on are

    O = diag(a) Q S0 + ((Q K^T) o E) U,             S_C = a_C S0 + (diag(e) K)^T U,   e_j = exp(gamma_C - gamma_j)

Everything but the products with S0 is independent of the state, so it runs in parallel over every chunk; only
S0 -> S_C is a sequential scan over chunks. Cost per row and head: O(T C (Dk + Dv)) for the intra-chunk
products, O(T C^2) for the substitution (C <= Dk + Dv), and O(T Dk Dv) for the state's products: linear in T.

**Segments** (packed or padded batches, ids (B, T) with 0 = padding): a real token whose id differs from the previous
real token's in its row starts a new run, whose state starts from zero (the row's first run starts from
initial_state); padding tokens neither read nor write the state, their output is 0 and their gradients are 0, and
the state passes through them unchanged, so the final state is the one after the row's last real token (a
right-padded prefill hands it to generation). Inside a chunk this is a mask on E, a and e (terms between runs
vanish), so a reset never needs exp(-inf) and costs nothing extra.

**Grouped heads.** q and k have Hk heads, v, g and beta Hv (a multiple): value head h reads query/key head
h // (Hv / Hk), as transformers' repeat_interleave does; the backward sums the gradients of a group into its key
head. The repeat happens here, inside the op, so no kernel ever materialises repeated q / k.

**l2norm and the scale.** The l2-normalisation of q and k is the `l2norm_forward` / `l2norm_backward` pair below,
one op of the layer plan each for q and k (transformers' use_qk_l2norm_in_kernel, eps 1e-6 inside the rsqrt): it
is the same small op for both, its backward needs only the normalised vector and its inverse norm, and the delta
rule's kernels stay one job. The 1 / sqrt(Dk) scale of q is the rule's own (transformers always applies it) and
lives inside the op, as attention's scale does.

**The backward** is exact and hand-derived in the same chunked form. The forward stores every chunk's entering
state S0 (B, Hv, N, Dk, Dv): the backward needs them in reverse order, and recomputing them is a second sequential
scan over the chunks, the one part of the algorithm that does not parallelise over T. The backward recomputes
the intra-chunk quantities (P, W_v, W_k, U = W_v - W_k S0) in parallel over chunks, runs the reverse scan of the
state's gradient (dS0 = a_C dS_C + (diag(a) Q)^T dO - W_k^T dU with dU = ((Q K^T) o E)^T dO + diag(e) K dS_C),
then every other gradient per chunk, in parallel again. Under gradient checkpointing the layer's forward is rerun,
which brings the states with it; without it they cost B Hv ceil(T / C) Dk Dv floats per layer (Hv Dk Dv / C a
token: 8,192 floats for Qwen3-Next's 32 value heads of 128 x 128 at C = 64, as many as its conv output).

**The WGSL kernels** will need: (1) a per-chunk kernel for gamma, E, P (forward substitution over C rows), W_v, W_k,
(Q K^T) o E; (2) the scan over chunks writing each chunk's S0 to a state buffer and its output; (3) for the backward
the same per-chunk recomputation, a reverse scan writing dS_C per chunk, and a per-chunk gradient kernel; (4) the
single-token step reading and writing a row's state in place.

**float32.** The state, its gradient and every sum are float32 (float64 when the inputs are: the reference runs in
the inputs' precision, at least float32). The log-decay is summed only inside a chunk, so |gamma| <= C max|g| and
exp(gamma_t - gamma_j) keeps about |gamma| 2^-24 relative error; a cumulative sum over all of T would grow with T,
and so would that error (and exp(gamma) would underflow). With l2-normalised k and beta in (0, 1), |L| <= 1, but P = (I + L)^-1 can still grow with C,
which is one reason C stays at 64 or less.
"""
from __future__ import annotations

import numpy as np

L2NORM_EPS = 1e-6  # transformers' (and flash-linear-attention's) eps inside the rsqrt of the q / k l2norm


def l2norm_forward(x, eps: float = L2NORM_EPS):
    """x (..., D) -> y (..., D) = x / sqrt(sum(x^2) + eps), inv_norm (...): the normalisation of each vector."""
    inv_norm = 1.0 / np.sqrt(np.sum(x * x, axis=-1) + eps)
    return x * inv_norm[..., None], inv_norm


def l2norm_backward(dy, y, inv_norm):
    """Gradient of l2norm_forward from its output y (..., D) and inv_norm (...): dx (..., D)."""
    return inv_norm[..., None] * (dy - y * np.sum(dy * y, axis=-1, keepdims=True))


def _compute_dtype(*arrays):
    """The precision the rule runs in: float32 at least, float64 when an input is."""
    return np.result_type(np.float32, *[a.dtype for a in arrays if a is not None])


def _runs(segments, b: int, t: int, n_chunks: int, chunk: int):
    """Run labels: runs (B, N * C) int (-1 for padding and the chunks' padded tail), carried (B, N + 1): the run
    of the state entering chunk c (the run of the last real token before it; 0, the initial state's, if none)."""
    tp = n_chunks * chunk
    real = np.zeros((b, tp), dtype=bool)
    ids = np.zeros((b, tp), dtype=np.int64)
    if segments is None:
        real[:, :t] = True
    else:
        real[:, :t] = segments != 0
        ids[:, :t] = segments
    pos = np.where(real, np.arange(tp), -1)
    last = np.maximum.accumulate(pos, axis=1)                       # (B, Tp) last real position <= t
    before = np.concatenate([np.full((b, 1), -1), last[:, :-1]], axis=1)  # last real position < t
    prev_id = np.take_along_axis(ids, np.maximum(before, 0), axis=1)
    starts = real & (before >= 0) & (prev_id != ids)
    runs = np.where(real, np.cumsum(starts, axis=1), -1)           # (B, Tp)
    edges = last[:, chunk - 1::chunk]                               # (B, N) last real position <= chunk end
    carried = np.take_along_axis(runs, np.maximum(edges, 0), axis=1)
    carried = np.concatenate([np.zeros((b, 1), dtype=np.int64), np.where(edges >= 0, carried, 0)], axis=1)
    return runs, carried


def _chunked(x, n_chunks: int, chunk: int, ft):
    """(B, T, H, ...) -> (B, H, N, C, ...) in ft, zero-padded along T to N * C."""
    pad = n_chunks * chunk - x.shape[1]
    x = np.pad(x.astype(ft, copy=False), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = np.moveaxis(x, 2, 1)
    return x.reshape(x.shape[:2] + (n_chunks, chunk) + x.shape[3:])


def _unchunked(x, t: int):
    """(B, H, N, C, ...) -> (B, T, H, ...), dropping the padded tail."""
    x = x.reshape(x.shape[:2] + (-1,) + x.shape[4:])[:, :, :t]
    return np.moveaxis(x, 1, 2)


def _unit_lower_inverse(a):
    """(..., C, C) strictly lower a -> P = (I + a)^-1 by forward substitution, row by row (what the kernels do)."""
    c = a.shape[-1]
    inv = np.zeros_like(a)
    inv[..., 0, 0] = 1.0
    for i in range(1, c):
        # row i of (I + a) P = I: P[i] = e_i - a[i, :i] P[:i]
        inv[..., i, :] = -np.einsum("...j,...jk->...k", a[..., i, :i], inv[..., :i, :])
        inv[..., i, i] = 1.0
    return inv


class _Chunks:
    """A batch cut into chunks, and every intra-chunk quantity that does not depend on the state (the forward
    computes it once; the backward recomputes it). Shapes: (B, H, N, C, ...), H = Hv."""

    def __init__(self, q, k, v, g, beta, chunk: int, segments):
        b, t, hk, dk = k.shape
        hv = v.shape[2]
        self.shape = (b, t, hk, hv, dk, v.shape[3])
        self.ft = ft = _compute_dtype(q, k, v, g, beta)
        self.n = n = -(-t // chunk)
        rep = hv // hk
        runs, carried = _runs(segments, b, t, n, chunk)
        real = (runs >= 0).reshape(b, 1, n, chunk)
        runs = runs.reshape(b, 1, n, chunk)
        run_in, run_out = carried[:, None, :-1, None], carried[:, None, 1:, None]   # (B, 1, N, 1)
        self.real = real
        self.q = _chunked(np.repeat(q, rep, axis=2), n, chunk, ft) * ft.type(dk ** -0.5)  # (B, H, N, C, Dk)
        self.k = _chunked(np.repeat(k, rep, axis=2), n, chunk, ft)                      # (B, H, N, C, Dk)
        self.v = _chunked(v, n, chunk, ft)                                              # (B, H, N, C, Dv)
        self.beta = _chunked(beta, n, chunk, ft) * real                                 # (B, H, N, C)
        gamma = np.cumsum(_chunked(g, n, chunk, ft) * real, axis=-1)                    # (B, H, N, C)
        same = (runs[..., :, None] == runs[..., None, :]) & real[..., :, None]          # (B, 1, N, C, C)
        causal = np.tril(np.ones((chunk, chunk), dtype=bool))
        diff = gamma[..., :, None] - gamma[..., None, :]
        self.decay = np.where(same & causal, np.exp(np.where(causal, diff, 0.0)), 0.0)  # E (B, H, N, C, C)
        self.a = np.exp(gamma) * (runs == run_in)                                       # (B, H, N, C)
        self.e = np.exp(gamma[..., -1:] - gamma) * (runs == run_out)                   # (B, H, N, C)
        self.a_last = np.exp(gamma[..., -1]) * (run_in == run_out)[..., 0]              # (B, H, N)
        kk = self.k @ np.swapaxes(self.k, -1, -2)                                       # (B, H, N, C, C)
        self.kk = kk
        self.lower = np.tril(self.beta[..., :, None] * kk * self.decay, -1)           # L
        self.inv = _unit_lower_inverse(self.lower)                                      # P = (I + L)^-1
        self.kba = self.k * (self.beta * self.a)[..., None]                             # diag(beta a) K
        self.w_v = self.inv @ (self.v * self.beta[..., None])                           # (B, H, N, C, Dv)
        self.w_k = self.inv @ self.kba                                                  # (B, H, N, C, Dk)
        self.qk = (self.q @ np.swapaxes(self.k, -1, -2)) * self.decay                 # (Q K^T) o E
        self.qa = self.q * self.a[..., None]
        self.ke = self.k * self.e[..., None]


def gated_delta_rule_forward(q, k, v, g, beta, chunk: int, initial_state=None, segments=None):
    """The gated delta rule over a batch, in chunks of `chunk` positions (any T).

    q, k (B, T, Hk, Dk) (already l2-normalised; q is scaled by 1 / sqrt(Dk) here), v (B, T, Hv, Dv), g (B, T, Hv)
    the log-decay (<= 0), beta (B, T, Hv), initial_state (B, Hv, Dk, Dv) or None (zeros), segments (B, T) or None
    (all real) -> out (B, T, Hv, Dv), final_state (B, Hv, Dk, Dv), states (B, Hv, N, Dk, Dv): the state entering
    each chunk, which the backward reads.
    """
    ch = _Chunks(q, k, v, g, beta, chunk, segments)
    b, t, _, hv, dk, dv = ch.shape
    s = np.zeros((b, hv, dk, dv), dtype=ch.ft) if initial_state is None else initial_state.astype(ch.ft)
    states = np.empty((b, hv, ch.n, dk, dv), dtype=ch.ft)
    out = np.empty(ch.v.shape, dtype=ch.ft)                                            # (B, H, N, C, Dv)
    for c in range(ch.n):
        states[:, :, c] = s
        u = ch.w_v[:, :, c] - ch.w_k[:, :, c] @ s                                       # (B, H, C, Dv)
        out[:, :, c] = ch.qa[:, :, c] @ s + ch.qk[:, :, c] @ u
        s = ch.a_last[:, :, c, None, None] * s + np.swapaxes(ch.ke[:, :, c], -1, -2) @ u
    return _unchunked(out, t), s, states


def gated_delta_rule_backward(dout, q, k, v, g, beta, states, chunk: int, initial_state=None, segments=None):
    """Gradients of gated_delta_rule_forward (same arguments; states its third output) given dout (B, T, Hv, Dv):
    dq, dk (B, T, Hk, Dk), dv (B, T, Hv, Dv), dg, dbeta (B, T, Hv), and d initial_state (B, Hv, Dk, Dv) when an
    initial state was given. The final state is for generation and carries no gradient."""
    ch = _Chunks(q, k, v, g, beta, chunk, segments)
    b, t, hk, hv, d_k, d_v = ch.shape
    rep = hv // hk
    do = _chunked(dout, ch.n, chunk, ch.ft)                                             # (B, H, N, C, Dv)
    u = ch.w_v - ch.w_k @ states                                                        # (B, H, N, C, Dv)
    tr = np.swapaxes
    # the reverse scan: ds_end[:, :, c] is the gradient of the state leaving chunk c
    ds_end = np.empty_like(states)
    ds = np.zeros((b, hv, d_k, d_v), dtype=ch.ft)
    for c in range(ch.n - 1, -1, -1):
        ds_end[:, :, c] = ds
        du = tr(ch.qk[:, :, c], -1, -2) @ do[:, :, c] + ch.ke[:, :, c] @ ds
        ds = (ch.a_last[:, :, c, None, None] * ds + tr(ch.qa[:, :, c], -1, -2) @ do[:, :, c]
              - tr(ch.w_k[:, :, c], -1, -2) @ du)
    # every other gradient, per chunk
    du = tr(ch.qk, -1, -2) @ do + ch.ke @ ds_end                                         # (B, H, N, C, Dv)
    dr = tr(ch.inv, -1, -2) @ du                                                        # d(diag(beta)(V - aKS0))
    d_lower = -np.tril(dr @ tr(u, -1, -2), -1)                                          # (B, H, N, C, C)
    d_bqk = np.tril(do @ tr(u, -1, -2))                                                 # d((Q K^T) o E)
    d_qk = d_bqk * ch.decay                                                             # d(Q K^T)
    d_kk = ch.beta[..., :, None] * d_lower * ch.decay                                  # d(K K^T)
    d_kba = -dr @ tr(states, -1, -2)                                                    # (B, H, N, C, Dk)
    d_ke = u @ tr(ds_end, -1, -2)                                                       # (B, H, N, C, Dk)
    d_qa = do @ tr(states, -1, -2)                                                      # (B, H, N, C, Dk)
    dq = d_qa * ch.a[..., None] + d_qk @ ch.k
    dk = (tr(d_qk, -1, -2) @ ch.q + (d_kk + tr(d_kk, -1, -2)) @ ch.k + d_ke * ch.e[..., None]
          + d_kba * (ch.beta * ch.a)[..., None])
    # beta enters three times: in L's rows, in diag(beta) V and in diag(beta a) K
    s_kba = np.sum(d_kba * ch.k, axis=-1)                                              # (B, H, N, C)
    dbeta = np.sum(d_lower * ch.kk * ch.decay, axis=-1) + np.sum(dr * ch.v, axis=-1) + s_kba * ch.a
    dv = dr * ch.beta[..., None]
    # the log-decay: every factor above is exp of a difference of gamma (chunk-local cumsum of g)
    da = np.sum(d_qa * ch.q, axis=-1) + s_kba * ch.beta                                 # (B, H, N, C)
    de = np.sum(d_ke * ch.k, axis=-1)
    d_a_last = np.sum(states * ds_end, axis=(-2, -1))                                   # (B, H, N)
    x = d_bqk * ch.qk + d_lower * ch.lower                                              # dE o E
    d_gamma = da * ch.a + np.sum(x, axis=-1) - np.sum(x, axis=-2) - de * ch.e
    d_gamma[..., -1] += np.sum(de * ch.e, axis=-1) + d_a_last * ch.a_last
    dg = np.cumsum(d_gamma[..., ::-1], axis=-1)[..., ::-1] * ch.real                  # gamma is a cumsum of g

    def grouped(x):  # a key head's gradient sums its group of value heads
        x = _unchunked(x, t)
        return x.reshape(b, t, hk, rep, -1).sum(axis=3)

    grads = (grouped(dq * ch.ft.type(d_k ** -0.5)), grouped(dk), _unchunked(dv, t), _unchunked(dg, t),
             _unchunked(dbeta, t))
    return grads if initial_state is None else (*grads, ds)


def gated_delta_rule_step(q, k, v, g, beta, state):
    """One token of the rule per row (generation): q, k (B, Hk, Dk) l2-normalised, v (B, Hv, Dv), g, beta (B, Hv),
    state (B, Hv, Dk, Dv) -> out (B, Hv, Dv), new_state (B, Hv, Dk, Dv). A row that starts passes a zero state."""
    ft = _compute_dtype(q, k, v, g, beta, state)
    rep = v.shape[1] // k.shape[1]
    q = np.repeat(q, rep, axis=1).astype(ft) * ft.type(q.shape[-1] ** -0.5)            # (B, H, Dk)
    k = np.repeat(k, rep, axis=1).astype(ft)                                            # (B, H, Dk)
    s = state.astype(ft) * np.exp(g.astype(ft))[..., None, None]
    delta = beta.astype(ft)[..., None] * (v.astype(ft) - np.einsum("bhkv,bhk->bhv", s, k))  # (B, H, Dv)
    s = s + k[..., :, None] * delta[..., None, :]
    return np.einsum("bhkv,bhk->bhv", s, q), s
