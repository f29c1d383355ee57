"""Layer 6, benchmarks through lm-evaluation-harness: the "wgpu-train" LM of lm_eval's model registry over either
engine, its log-likelihood scoring, and the task runs of `wgpu-train eval --tasks`."""
