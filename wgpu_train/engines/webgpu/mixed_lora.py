"""Mixed adapters in one batch on the WebGPU engine (serving): a bank of adapters per module held in float32
buffers, and the op that adds each row's own adapter's LoRA term to a module's output (the mixed_lora kernel
family, one dispatch per module)."""
from __future__ import annotations

from dataclasses import dataclass

from wgpu_train.engines.shared.mixed_lora import BankModule
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.tuned.mixed_lora_kernels import MixedLoraProblem


@dataclass(frozen=True)
class GpuBankModule:
    """One module's bank on the device: a (K, R, in), b (K, out, R), scales (K,) float32 buffers."""

    a: object
    b: object
    scales: object
    k: int
    rank: int
    in_f: int
    out_f: int

    @classmethod
    def upload(cls, rt, module: BankModule) -> GpuBankModule:
        k, rank, in_f = module.a.shape
        return cls(rt.upload(module.a, "lora_bank_a"), rt.upload(module.b, "lora_bank_b"),
                   rt.upload(module.scales, "lora_bank_scales"), k, rank, in_f, module.b.shape[1])

    def buffers(self) -> tuple:
        return self.a, self.b, self.scales


def mixed_lora_forward(rec, y, x, bank: GpuBankModule, adapters, n: int):
    """y (n, out) += scales[k] * (x A_k^T) B_k^T of each row's adapter k = adapters[n] (i32; negative: none);
    x (n, in); y and x in any storage format. The tuner's candidate (mixed_lora_kernels)."""
    if n <= 0:
        return
    p = MixedLoraProblem(rec.rt, dict(y=y, x=x, a_bank=bank.a, b_bank=bank.b, scales=bank.scales,
                                      adapters=adapters), n, bank.in_f, bank.out_f, bank.rank, bank.k)
    for dispatch in tune.choose(rec.rt, p).dispatches(p):
        rec.dispatch(*dispatch)
