"""A LoRA training step of the SmolLM2-135M-shaped configuration (random weights, r=16 on all linear layers)
on wgpu-train's WebGPU engine in each precision (fp32, bf16, f16 activations) next to PyTorch + PEFT eager
(float32, and bfloat16 autocast) on the same machine's torch device, timed in the same run; with the step's
model-FLOPs utilisation against the adapter's FMA peak.
For the lent GPU check (tools/device_check.sh); prints one JSON object.

    python tools/gpu_vs_torch.py [--device SPEC] [--torch-device cuda] [--batch 4] [--seq 256] [--steps 3]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.models.config import ModelConfig
from wgpu_train.bench.training import timed
from wgpu_train.engines.protocol import PRECISIONS
from wgpu_train.bench.pretune import SMOL135, lora_step_flops, training_mfu
from wgpu_train.engines.webgpu.device.runtime import get_runtime


def torch_step_s(device: str, dtype_name: str, batch: int, seq: int, steps: int) -> float | None:
    """Median seconds of a PEFT LoRA step (forward, loss, backward, clip, AdamW) in eager PyTorch: float32, or
    float32 weights under bfloat16 autocast (the peers' mixed precision, what --precision bf16 compares with)."""
    try:
        import peft
        import torch
        import transformers
    except ImportError:
        return None
    dtype = getattr(torch, dtype_name)
    cfg = transformers.LlamaConfig(**{k: v for k, v in SMOL135.items() if k != "architectures"})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device=device)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                       lora_dropout=0.0))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def step(_):
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return float(np.median(timed(step, steps)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="WebGPU adapter index or name (default: the preferred one)")
    ap.add_argument("--torch-device", default="cuda")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    rt = get_runtime(args.device)
    out = {"adapter": rt.info.describe()}
    for precision in PRECISIONS:
        out[f"wgpu_{precision}"] = training_mfu(rt, batch=args.batch, seq=args.seq, steps=args.steps,
                                                precision=precision)
    out["wgpu_bf16_speedup_over_fp32"] = out["wgpu_fp32"]["step_s"] / out["wgpu_bf16"]["step_s"]
    cfg = ModelConfig.from_dict(dict(SMOL135), "135M-shaped configuration")
    flops = lora_step_flops(cfg, LoraConfig(r=16, alpha=32, target_modules="all-linear"), args.batch, args.seq)
    for dtype in ("float32", "bfloat16"):
        s = torch_step_s(args.torch_device, dtype, args.batch, args.seq, args.steps)
        out[f"torch_peft_{dtype}"] = None if s is None else {
            "device": args.torch_device, "step_s": s, "tokens_per_s": args.batch * args.seq / s,
            "model_gflops_per_s": flops / s / 1e9,
            "wgpu_speedup": {p: s / out[f"wgpu_{p}"]["step_s"] for p in PRECISIONS}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
