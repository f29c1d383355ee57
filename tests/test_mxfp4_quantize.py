"""The MXFP4 quantiser (formats/mxfp4.quantize, --base-dtype mxfp4's) against a brute-force reference written here from
the OCP MX v1.0 spec: the scale, the nearest e2m1 value with ties to the even code, saturation, e8m0's clamp, zero
blocks; a packed checkpoint's blocks and scales survive dequantise-then-quantise; rows no multiple of 32 refused."""
from __future__ import annotations

import numpy as np
import pytest

from wgpu_train.errors import ConfigError
from wgpu_train.formats.mxfp4 import dequantize, quantize

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]      # codes 0..7; 8..15 the same, negated


def _reference(block: np.ndarray) -> list:
    """The float values the spec stores 32 values as: X the largest integer with 2^X <= amax, less 2 (clamped to
    [-127, 127]; 0 for a zero block), each value the nearest of the 16 e2m1 values times 2^X (a tie: the even
    code), which saturates by itself (nothing lies beyond +-6 * 2^X)."""
    amax = max(abs(float(v)) for v in block)
    x = 0
    if amax > 0:
        while 2.0 ** x > amax:
            x -= 1
        while 2.0 ** (x + 1) <= amax:
            x += 1
        x = min(max(x - 2, -127), 127)
    candidates = [(sign * m * 2.0 ** x, code) for sign in (1, -1) for code, m in enumerate(E2M1)]
    out = []
    for v in block:
        best = min(candidates, key=lambda c: (abs(float(v) - c[0]), c[1] % 2))
        out.append(best[0])
    return out


def _check_against_reference(values: np.ndarray):
    blocks, scales = quantize(values)
    assert blocks.shape == (*values.shape[:-1], values.shape[-1] // 32, 16) and blocks.dtype == np.uint8
    assert scales.shape == (*values.shape[:-1], values.shape[-1] // 32) and scales.dtype == np.uint8
    got = dequantize(blocks, scales).astype(np.float64).reshape(-1, 32)
    for row, ref in zip(values.reshape(-1, 32), got):
        assert ref.tolist() == _reference(row), row


def test_random_blocks_equal_the_brute_force_nearest_value():
    rng = np.random.default_rng(0)
    spread = np.exp2(rng.integers(-20, 20, (6, 1, 1)))          # blocks at many scales
    values = (rng.normal(0, 1, (6, 3, 64)) * spread).astype(np.float32)
    _check_against_reference(values)


def test_chunks_of_blocks_give_the_whole_tensors_result(monkeypatch):
    """quantize converts a few blocks at a time: chunk boundaries that cut rows change nothing."""
    import wgpu_train.formats.mxfp4 as mx

    values = np.random.default_rng(2).normal(0, 1, (3, 7, 96)).astype(np.float32)
    whole = quantize(values)
    monkeypatch.setattr(mx, "QUANT_CHUNK", 5)
    chunked = quantize(values)
    assert all(np.array_equal(a, b) for a, b in zip(whole, chunked))


def test_ties_round_to_the_even_code_and_large_values_saturate():
    """Each midpoint between e2m1 values (times a block scale of 2^-3, its amax 4 * 2^-3), values beyond 6 * 2^X, and
    the clamp of e8m0's range at both ends."""
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = [4.0] + mids + [-m for m in mids] + [0.1, -0.2, 7.9, -7.5]                  # 19 values, then zeros
    tie_block = np.array(row + [0.0] * (32 - len(row)), np.float32) * np.float32(2.0 ** -3)
    blocks, scales = quantize(tie_block)
    assert scales.tolist() == [127 - 3]            # amax 7.9 * 2^-3: X = 2 - 2 - 3
    values = dequantize(blocks, scales)[:16] * 8
    assert values.tolist() == [4.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, 0.0]
    assert (dequantize(blocks, scales)[17:19] * 8).tolist() == [6.0, -6.0]     # 7.9 and -7.5 saturate
    edges = np.zeros((3, 32), np.float32)
    edges[0, :2] = [3e38, -1e38]                   # X = floor(log2 3e38) - 2 = 125
    edges[1, :2] = [2.0 ** -140, -(2.0 ** -141)]   # X clamped to -127: 2^-140 / 2^-127 rounds to 0
    _check_against_reference(edges)
    assert quantize(edges)[1].tolist() == [[252], [0], [127]]     # the zero block: scale byte 127


def test_a_packed_checkpoint_survives_dequantise_then_quantise():
    """Blocks as a quantiser writes them (the largest magnitude code 4.0 or 6.0, any sign, zeros) with their
    scales come back unchanged."""
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (4, 5, 3, 32)).astype(np.uint8)
    codes[..., rng.integers(0, 32)] = rng.choice([6, 7, 14, 15], (4, 5, 3))     # the block's amax: 4 or 6
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    scales = rng.integers(100, 140, (4, 5, 3)).astype(np.uint8)
    again_b, again_s = quantize(dequantize(blocks, scales))
    assert np.array_equal(again_b, blocks) and np.array_equal(again_s, scales)


def test_rows_no_multiple_of_32_are_refused_naming_the_tensor():
    with pytest.raises(ConfigError, match=r"^model.layers.0.mlp.experts.down_proj \(2, 4, 48\): .*multiple of 32"):
        quantize(np.zeros((2, 4, 48), np.float32), "model.layers.0.mlp.experts.down_proj")
    with pytest.raises(ConfigError, match="non-finite"):
        quantize(np.full((1, 32), np.inf, np.float32), "w")
