"""Several LoRA adapters in one batch (a server's rows, each with its own adapter, as Punica and S-LoRA run them):
the adapters' A and B of one module stacked into a bank, their ranks padded with zeros to the largest (a padded
row of A and column of B add exact zeros), and the reference of the per-row product both engines hold to: the
NumPy engine runs it, the WebGPU tuner checks the mixed_lora kernels against it on the device."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BankModule:
    """One module's adapters: a (K, R, in), b (K, out, R), scales (K,) float32, R the largest rank, ranks (K,)
    each adapter's own (0: it leaves the module out, zeros there and scale 0)."""

    a: np.ndarray
    b: np.ndarray
    scales: np.ndarray
    ranks: np.ndarray

    @property
    def rank(self) -> int:
        return self.a.shape[1]

    @property
    def k(self) -> int:
        """Adapters in the bank."""
        return self.a.shape[0]


def build_bank(adapters: list, shapes) -> dict:
    """adapters: one {module path: (A (r, in), B (out, r), scale)} per adapter, in bank order (row adapter
    index k is adapters[k]); shapes(path) -> (out, in). Returns {path: BankModule} over every path any adapter
    has, ranks padded to the largest of that path."""
    paths = sorted({p for modules in adapters for p in modules})
    bank = {}
    for path in paths:
        out_f, in_f = shapes(path)
        rank = max(modules[path][0].shape[0] for modules in adapters if path in modules)
        a = np.zeros((len(adapters), rank, in_f), np.float32)
        b = np.zeros((len(adapters), out_f, rank), np.float32)
        scales, ranks = np.zeros(len(adapters), np.float32), np.zeros(len(adapters), np.int64)
        for k, modules in enumerate(adapters):
            if path in modules:
                ak, bk, s = modules[path]
                a[k, :ak.shape[0]] = ak
                b[k, :, :bk.shape[1]] = bk
                scales[k], ranks[k] = s, ak.shape[0]
        bank[path] = BankModule(a, b, scales, ranks)
    return bank


def mixed_lora_forward(x: np.ndarray, module: BankModule, adapters: np.ndarray) -> np.ndarray:
    """The LoRA term of each row with its own adapter: x (N, in), adapters (N,) int (negative: no adapter, a
    zero row) -> (N, out) = scales[k] * (x A_k^T) B_k^T for k = adapters[n]. Rows are grouped by adapter, each
    group one product at the adapter's own rank in x's dtype, as a single adapter's lora_forward computes it."""
    out = np.zeros((x.shape[0], module.b.shape[1]), x.dtype)
    for k in np.unique(adapters[adapters >= 0]):
        rows, r = adapters == k, module.ranks[k]
        if r:
            a, b = module.a[k, :r].astype(x.dtype), module.b[k, :, :r].astype(x.dtype)
            out[rows] = module.scales[k] * ((x[rows] @ a.T) @ b.T)
    return out
