"""A training step at real scale, for a GPU check: Qwen2.5-0.5B's dimensions with random weights, nf4-dq
base, LoRA r=16 on all linear layers, gradient checkpointing; two optimizer steps (the loss must be
about ln(vocab) and finite) and a short batched generation, each timed.

    python tools/smoke_large.py [--device SPEC] [--batch 2] [--seq 128]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.models.config import ModelConfig
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.engines.generate import generate_batch
from wgpu_train.engines.webgpu.device import runtime
from wgpu_train.bench.suite import QWEN05
from wgpu_train.engines.webgpu.engine import WgpuEngine
from wgpu_train.engines.webgpu.memory import estimate_memory, weight_shapes
from wgpu_train.engines.model import Model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args(argv)
    cfg = ModelConfig(**QWEN05)
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    shapes = weight_shapes(cfg)
    values = {s: 0.02 * rng.standard_normal(s, dtype=np.float32) for s in set(shapes.values())}
    weights = {k: np.ones(s, np.float32) if k.endswith("norm.weight") else values[s] for k, s in shapes.items()}
    rt = runtime.get_runtime(args.device)
    engine = WgpuEngine(cfg, weights, rt, "nf4-dq")
    print(f"{rt.info.describe()}: base weights {engine.base_weight_bytes:,} bytes, built in "
          f"{time.perf_counter() - started:.1f} s")
    lora = LoraConfig(r=16, alpha=32, target_modules="all-linear")
    model = Model(cfg, engine, None)
    model.add_lora(lora, seed=0)
    model.set_gradient_checkpointing(True)
    b, t = args.batch, args.seq
    ids = rng.integers(0, cfg.vocab_size, (b, t))
    targets = np.roll(ids, -1, 1)
    targets[:, -1] = -100
    batch = (ids, targets, np.zeros((b, t), np.int64), np.tile(np.arange(t), (b, 1)))
    ok = True
    for step in (1, 2):
        started = time.perf_counter()
        loss_sum, count, norm, applied = engine.train_step([batch], OptimizerParams(lr=1e-4), step)
        mean = loss_sum / count
        print(f"step {step}: loss {mean:.4f} (ln vocab {math.log(cfg.vocab_size):.4f}), grad norm {norm:.4f}, "
              f"{time.perf_counter() - started:.2f} s, {b * t / (time.perf_counter() - started):.0f} tokens/s")
        ok &= applied and abs(mean - math.log(cfg.vocab_size)) < 1.0
    est = estimate_memory(cfg, b, t, lora=lora, base_dtype="nf4-dq", gradient_checkpointing=True)
    print("estimated GPU memory (MiB):", {k: round(v / 2**20) for k, v in est.items()})
    started = time.perf_counter()
    out = generate_batch(engine, [ids[0, :20], ids[1 % b, :7]], max_new_tokens=8)
    print(f"generate_batch: {[len(o) for o in out]} tokens in {time.perf_counter() - started:.2f} s")
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
