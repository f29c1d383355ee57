"""Models loaded onto an engine: load_model (a Hugging Face folder) and model_from_weights (tensors in memory), and
what backend and precision "auto" resolve to for them (engines/backend_choice.py; precision_choice)."""
from __future__ import annotations

import logging

import numpy as np

from wgpu_train.engines.backend_choice import choose_backend
from wgpu_train.engines.model import Model
from wgpu_train.engines.protocol import Precision, check_precision_widths
from wgpu_train.engines.shared.kv_dtype import KvDtype, check_kv_dtype
from wgpu_train.engines.shared.quant import check_dtypes, check_experts_dtype
from wgpu_train.errors import ConfigError
from wgpu_train.models.config import ModelConfig
from wgpu_train.models.stage_plan import StagePlan
from wgpu_train.models.weights import load_weights

log = logging.getLogger("wgpu_train")


def precision_choice(precision: Precision | str, engine: str, cpu_adapter: bool = False,
                     cfg=None) -> tuple[Precision, str]:
    """(the precision an engine runs, why) for a precision asked for (protocol.PRECISION_CHOICES) on the engine
    named ("numpy" or "wgpu"; cpu_adapter: a WebGPU adapter that is a CPU, lavapipe or llvmpipe). auto is bf16
    on GPUs (half the activation bytes and memory traffic, float32's range, no loss scaling) and fp32 elsewhere:
    the NumPy engine is the float32 reference, and a CPU adapter pays for 16-bit conversions without the
    bandwidth to gain; and for a model (cfg) with an odd width, which 16-bit kernels cannot store. ConfigError
    for a precision that is not one of PRECISION_CHOICES (both engines run all the others)."""
    precision = Precision.parse(precision)
    if precision.resolved:
        return precision, "as given"
    if engine == "numpy":
        return Precision.FP32, "auto: the NumPy engine is the float32 reference"
    if cpu_adapter:
        return Precision.FP32, "auto: a CPU adapter (lavapipe / llvmpipe) only pays for 16-bit conversions"
    try:
        check_precision_widths(Precision.BF16, cfg) if cfg is not None else None
    except ConfigError:
        return Precision.FP32, "auto: this model has an odd width, which 16-bit activations cannot store"
    return Precision.BF16, ("auto: a GPU (16-bit activations halve their memory and traffic; bf16 keeps float32's "
                            "range)")


def _make_engine(config, weights, backend: str, device=None, dtype=np.float32, base_dtype="float32",
                 embed_dtype="auto", precision="auto", kv_dtype=KvDtype.FLOAT32, stage: tuple | None = None):
    """The engine `backend` and `device` choose over weights; stage: (span, first, last), a pipeline stage's
    engine over the weights of those layers (a PipelineStage)."""
    base_dtype, embed_dtype = check_dtypes(base_dtype, embed_dtype, config.checkpoint_dtype)
    check_experts_dtype(base_dtype, config)
    precision = Precision.parse(precision)
    choice = choose_backend(backend, device, config, base_dtype, embed_dtype)
    if backend == "auto":
        log.info("backend: %s (%s)", choice.engine, choice.reason)
    if choice.engine == "wgpu":
        from wgpu_train.engines.webgpu.device import runtime
        from wgpu_train.engines.webgpu.engine import WgpuEngine

        check_precision_widths(precision, config)
        rt = runtime.get_runtime(choice.device)
        precision, reason = precision_choice(precision, "wgpu", rt.info.adapter_type == "CPU", config)
        if stage is None:
            engine = WgpuEngine(config, weights, rt, base_dtype, embed_dtype, kv_dtype, precision)
        else:
            from wgpu_train.engines.webgpu.stage import WgpuStage

            engine = WgpuStage(config, weights, rt, *stage, base_dtype=base_dtype, embed_dtype=embed_dtype,
                               kv_dtype=kv_dtype, precision=precision)
    elif stage is None:
        from wgpu_train.engines.numpy.engine import NumpyEngine

        precision, reason = precision_choice(precision, "numpy")
        engine = NumpyEngine(config, weights, dtype=dtype, base_dtype=base_dtype, embed_dtype=embed_dtype,
                             precision=precision, kv_dtype=kv_dtype)
    else:
        from wgpu_train.engines.numpy.stage import NumpyStage

        precision, reason = precision_choice(precision, "numpy")
        engine = NumpyStage(config, weights, *stage, dtype=dtype, base_dtype=base_dtype, embed_dtype=embed_dtype,
                            precision=precision, kv_dtype=kv_dtype)
    engine.precision_reason = reason
    engine.backend_reason = choice.reason
    return engine


def load_model(path, backend: str = "numpy", device=None, dtype=np.float32, base_dtype: str = "float32",
               embed_dtype: str = "auto", precision: Precision | str = "auto", kv_dtype: KvDtype | str = KvDtype.FLOAT32) -> Model:
    """Load a Hugging Face model folder (config.json + safetensors) onto the 'numpy', 'wgpu' or 'auto' backend
    (engines/backend_choice.choose_backend: a GPU's WebGPU engine, else the NumPy engine; model.backend_reason).

    base_dtype stores the frozen weights of the linear modules of every layer as "float32", "bfloat16",
    "float16", "nf4" (4-bit NormalFloat, blocks of 64, as bitsandbytes/QLoRA), "nf4-dq" (nf4 whose absmax
    values are double-quantised, bitsandbytes' bnb_4bit_use_double_quant) or "auto" (as the checkpoint stores
    them: config.json's torch_dtype bfloat16 or float16, else float32); embed_dtype stores the embedding and
    lm_head as "float32", "bfloat16" or "float16" ("auto": the base's own over a float32 or bfloat16 base,
    float16 over the others, as QLoRA keeps them in 16 bits).
    Norms, biases, LoRA tensors, gradients and optimizer state stay float32. The NumPy backend computes with
    the same rounded weights. Anything but float32 freezes the base (LoRA only).
    precision: where activations and their gradients are stored, "fp32", "bf16", "f16" or "auto"
    (precision_choice; engine.precision says which, engine.precision_reason why).
    kv_dtype: how generation's KV cache stores keys and values, "float32" or "bfloat16" (half the bytes; the
    attention over it computes in float32; needs an even head dim); engine.kv_dtype, a KvDtype."""
    precision = Precision.parse(precision)
    config = ModelConfig.from_folder(path)
    check_dtypes(base_dtype, embed_dtype, config.checkpoint_dtype)
    kv_dtype = check_kv_dtype(kv_dtype, config)
    return model_from_weights(config, load_weights(path, config), backend, device, dtype, base_dtype, embed_dtype,
                              precision, kv_dtype, path)


def model_from_weights(config: ModelConfig, weights: dict, backend: str = "numpy", device=None, dtype=np.float32,
                       base_dtype: str = "float32", embed_dtype: str = "auto", precision: Precision | str = "auto",
                       kv_dtype: KvDtype | str = KvDtype.FLOAT32, path=None) -> Model:
    """A Model of config over weights in memory (name -> float32 array, as load_weights reads them), with
    load_model's settings; path: the folder it came from, if any (merge copies its tokenizer files)."""
    kv_dtype = check_kv_dtype(kv_dtype, config)
    return Model(config, _make_engine(config, weights, backend, device, dtype, base_dtype, embed_dtype, precision,
                                      kv_dtype), path)


def load_stage(path, plan: StagePlan, stage: int, backend: str = "numpy", base_dtype: str = "float32",
               embed_dtype: str = "auto", precision: Precision | str = "auto", device=None, kv_dtype: str = "float32"):
    """Stage `stage` of `plan` (models/stage_plan.py) on the engine `backend` and `device` choose
    (choose_backend, as load_model): a PipelineStage (protocol.py; numpy/stage.py or webgpu/stage.py). Only the
    tensors it holds are read from the model folder's safetensors shards (engine.weights_bytes_read counts
    their file bytes); kv_dtype: the storage of its layers' part of generation's KV cache."""
    config = ModelConfig.from_folder(path)
    check_kv_dtype(kv_dtype, config)
    weights = load_weights(path, config)
    weights = weights.subset([k for k in weights if plan.holds(stage, k)])
    span = plan.stages[stage]
    engine = _make_engine(config, weights, backend, device, base_dtype=base_dtype, embed_dtype=embed_dtype,
                          precision=precision, kv_dtype=kv_dtype, stage=(span, stage == 0, stage == len(plan) - 1))
    engine.weights_bytes_read = weights.bytes_read
    return engine
