"""What the layers above ask of the engines besides a Model: the WebGPU adapters found and the one a run picks,
the tuned kernels an adapter's limits leave out, the tuning mode, and the memory a run needs (the WebGPU
engine's buffer plan, which the engine allocates from). Above engines/, only this module, model.py,
generate.py, protocol.py and shared/ are imported; bench/ alone reaches the kernels it measures."""
from __future__ import annotations

import math

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.models.config import ModelConfig
from wgpu_train.engines.protocol import Precision
from wgpu_train.engines.webgpu.device.runtime import AdapterInfo, Runtime, choose_adapter, devices, get_runtime
from wgpu_train.engines.webgpu.stage_memory import StageImages, balanced_stages, image_input_bytes, stage_memory
from wgpu_train.engines.webgpu.memory import (activation_plan, activation_ranks, base_weight_bytes, count_trainable,
                                              estimate_memory, expert_rank, format_bytes, layer_ranks, lora_groups,
                                              weight_shapes)
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.tuned.catalogue import left_out, tuned_kernels

__all__ = ["AdapterInfo", "Runtime", "StageImages", "balanced_stages", "base_weight_bytes", "check_tune_mode",
           "choose_adapter", "count_trainable", "devices", "estimate_memory", "format_bytes", "get_runtime",
           "image_input_bytes", "kernels_left_out", "memory_report", "stage_memory"]


def check_tune_mode() -> str:
    """The tuning mode (WGPU_TRAIN_TUNE: off, fast or full), refused in one line when it is none of them."""
    return tune.mode()


def kernels_left_out(adapter: AdapterInfo) -> tuple[list, int]:
    """(the tuned kernels that need a limit or feature beyond this adapter's, how many tuned kernels there are):
    the tuner runs their twins within its limits."""
    return left_out(dict(adapter.limits), adapter.features), len(tuned_kernels())


def memory_report(cfg: ModelConfig, batch_size: int, seq_len: int, lora: LoraConfig | None, method: str,
                  base_dtype: str, embed_dtype: str, gradient_checkpointing: bool,
                  precision: Precision | str) -> dict:
    """`wgpu-train memory`'s figures: estimate_memory's in this precision, the model's parameters, the
    activations against float32's, and the largest activation buffer (it must fit one storage binding)."""
    precision = Precision.parse(precision)
    est = estimate_memory(cfg, batch_size, seq_len, lora, method, base_dtype, embed_dtype, gradient_checkpointing,
                          precision=precision)
    fp32_activations = estimate_memory(cfg, batch_size, seq_len, lora, method, base_dtype, embed_dtype,
                                       gradient_checkpointing)["activations"]
    module_ranks = {p: r for p, (r, _) in lora.as_saved(cfg).modules(cfg).items()} if lora else {}
    ranks = layer_ranks(module_ranks)
    dora = {m: cfg.linear_shape(m)[0] for m in lora.targets_in(cfg)} if lora and lora.use_dora else {}
    ranks = activation_ranks(ranks, lora_groups(cfg, ranks, bool(dora) or precision.sixteen_bit))
    layers, shared = activation_plan(cfg, batch_size, seq_len, ranks, {}, True, gradient_checkpointing,
                                     dora_outputs=dora, expert_rank=expert_rank(module_ranks))
    return {"parameters": sum(math.prod(s) for s in weight_shapes(cfg).values()), **est,
            "activations_vs_fp32": round(est["activations"] / fp32_activations, 4),
            "largest_activation_buffer": max(e for part in (*layers.values(), shared) for e in part.values()) * 4}
