"""The Gated DeltaNet layer's small op pairs on the WebGPU engine (tuned/gated_deltanet_kernels.py), with the
reference's names and argument order (engines/shared/gated_deltanet.py): outputs first, then inputs, then sizes.
They record into a Recorder. Activations and their gradients in any storage format; the weights' gradients float32
and added to (the micro-batches of a step)."""
from __future__ import annotations

from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.launch import flat_grid, launch
from wgpu_train.engines.webgpu.device.operands import split
from wgpu_train.engines.webgpu.tuned import gated_deltanet_kernels as GK


def _groups(n: int) -> tuple:
    return flat_grid(-(-n // GK.WG))


def silu_forward(rec, y, x, n: int):
    """y = x sigmoid(x) over n elements."""
    if n > 0:
        launch(rec, GK.kernel(GK.SILU_FORWARD), _groups(-(-n // 2)), [(y, n), (x, n)], n=n)


def silu_backward(rec, dx, dy, x, n: int):
    """dx of silu_forward over n elements (written)."""
    if n > 0:
        launch(rec, GK.kernel(GK.SILU_BACKWARD), _groups(-(-n // 2)), [(dx, n), (dy, n), (x, n)], n=n)


def decay_forward(rec, g, beta, a, b, a_log, dt_bias, N: int, H: int):
    """g (N, H) = -exp(A_log) softplus(a + dt_bias), beta (N, H) = sigmoid(b); a, b (N, H), a_log, dt_bias (H,)."""
    if N > 0:
        launch(rec, GK.kernel(GK.DECAY_FORWARD), _groups(-(-N * H // 2)),
               [(g, N * H), (beta, N * H), (a, N * H), (b, N * H), (a_log, H), (dt_bias, H)], n=N, h=H)


def decay_backward(rec, da, db, d_a_log, d_dt_bias, dg, dbeta, a, b, a_log, dt_bias, N: int, H: int):
    """da, db (N, H) of decay_forward (written); d_a_log, d_dt_bias (H,) float32, added to, unless None (only full
    fine-tuning trains them)."""
    if N <= 0:
        return
    launch(rec, GK.kernel(GK.DECAY_BACKWARD), _groups(-(-N * H // 2)),
           [(da, N * H), (db, N * H), (dg, N * H), (dbeta, N * H), (a, N * H), (b, N * H), (a_log, H),
            (dt_bias, H)], n=N, h=H)
    if d_a_log is None:
        return
    for r0 in range(0, N, GK.WEIGHT_PASS):
        launch(rec, GK.kernel(GK.DECAY_WEIGHT_BACKWARD), _groups(H),
               [(d_a_log, H), (d_dt_bias, H), (dg, N * H), (a, N * H), (a_log, H), (dt_bias, H)], n=N, h=H,
               r0=r0, r1=min(N, r0 + GK.WEIGHT_PASS))


def _even(what: str, D: int, *tensors):
    if D % 2 and any(storage.format_of(split(t)[0]) != "f32" for t in tensors):
        raise ValueError(f"{what}: 16-bit outputs need an even row width, got {D}")


def gated_rmsnorm_forward(rec, y, x, z, weight, N: int, D: int, eps: float):
    """y (N, D) = rmsnorm(x) weight silu(z) over each row; x, z (N, D) (N: tokens times value heads), weight (D,)."""
    _even("gated_rmsnorm_forward", D, y)
    if N > 0:
        launch(rec, GK.kernel(GK.GATED_RMSNORM_FORWARD), _groups(N),
               [(y, N * D), (x, N * D), (z, N * D), (weight, D)], n=N, d=D, eps=eps)


def gated_rmsnorm_backward(rec, dx, dz, dweight, dy, x, z, weight, N: int, D: int, eps: float):
    """dx, dz (N, D) of gated_rmsnorm_forward (written); dweight (D,) float32 added to, unless None."""
    _even("gated_rmsnorm_backward", D, dx, dz)
    if N <= 0:
        return
    launch(rec, GK.kernel(GK.GATED_RMSNORM_BACKWARD), _groups(N),
           [(dx, N * D), (dz, N * D), (dy, N * D), (x, N * D), (z, N * D), (weight, D)], n=N, d=D, eps=eps)
    if dweight is None:
        return
    step = GK.norm_weight_rows(D)
    for r0 in range(0, N, step):
        launch(rec, GK.kernel(GK.GATED_RMSNORM_WEIGHT_BACKWARD), _groups(D),
               [(dweight, D), (dy, N * D), (x, N * D), (z, N * D)], n=N, d=D, eps=eps, r0=r0, r1=min(N, r0 + step))
