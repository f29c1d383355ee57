"""`bench --only grpo`: the parts of a GRPO step (generation, rewards, reference / old-policy scoring, the
weighted optimizer step) on the embedded demo, and the generation's tokens/s next to `generate_batch`'s on the
same prompts and sampling, measured in the same run on one WebGPU adapter."""
from __future__ import annotations

import tempfile
import time

import numpy as np

from wgpu_train.training.config import default_run_config
from wgpu_train.training.grpo_trainer import GRPOTrainer

PARTS = ("generation", "rewards", "scoring", "train_step")


def bench_grpo(rt, steps: int = 4, beta: float = 0.04) -> dict:
    """`steps` GRPO steps of the embedded demo's recipe (with beta, so the reference is scored) on rt's adapter:
    each part's seconds per step and share of the step, then the same prompts generated again by the model's
    generate_batch with the same sampling, as tokens/s side by side."""
    with tempfile.TemporaryDirectory() as out:
        config = default_run_config(objective="grpo", backend="wgpu", device=str(rt.info.index), out=out,
                                    max_steps=steps, beta=beta, no_progress=True, eval_generate=False,
                                    log_every=steps)
        trainer = GRPOTrainer(config, log=lambda _: None)
        t0 = time.perf_counter()
        trainer.run()
        wall = time.perf_counter() - t0
        parts = {k: trainer.part_seconds.get(k, (0.0, 0)) for k in PARTS}
        gen_s, gen_tokens = parts["generation"]
        examples = [trainer.prompts["train"][i] for i in trainer.stream.epoch_batches(0)[0]
                    for _ in range(trainer.settings.num_generations)]
        s = trainer.settings
        t0 = time.perf_counter()
        out_ids = trainer.model.generate_batch([e.input_ids for e in examples], max_new_tokens=s.max_completion_length,
                                               temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                               seed=list(range(len(examples))),
                                               stop_token_ids=list(trainer.tokenizer.eos_token_ids))
        alone_s = time.perf_counter() - t0
    alone_tokens = sum(len(x) for x in out_ids)
    step_s = sum(v[0] for v in parts.values()) / steps
    return {"model": "the embedded demo (Llama, hidden 128, 4 layers), LoRA r=8 all-linear",
            "rows_per_step": config.batch_size, "num_generations": s.num_generations, "beta": beta,
            "steps": steps, "wall_s": round(wall, 3),
            "seconds_per_step": {k: round(v[0] / steps, 4) for k, v in parts.items()},
            "share_of_step": {k: round(v[0] / steps / step_s, 3) for k, v in parts.items()},
            "generation_tokens_per_s": gen_tokens / gen_s if gen_s else None,
            "generate_batch_tokens_per_s": alone_tokens / alone_s if alone_s else None,
            "in_loop_vs_generate_batch": (gen_tokens / gen_s) / (alone_tokens / alone_s)
            if gen_s and alone_s and alone_tokens else None,
            "mean_completion_tokens": float(np.mean([len(x) for x in out_ids]))}
