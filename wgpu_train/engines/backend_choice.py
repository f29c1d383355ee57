"""Which engine `backend="auto"` runs, and why: the WebGPU engine on a GPU or on an adapter the user names; where
the only WebGPU adapters are CPUs (lavapipe, llvmpipe), the NumPy engine for a model of small layers and the CPU
adapter for one of large layers, by a rule from `wgpu-train bench --only engines`' measurements (nothing is timed
at run time), unless the NumPy engine's float32 weights would not fit the machine's memory."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from wgpu_train.engines.webgpu.device import runtime
from wgpu_train.engines.webgpu.layers import LayerRecorder
from wgpu_train.engines.webgpu.memory import base_weight_bytes, weight_shapes
from wgpu_train.errors import ConfigError
from wgpu_train.models.config import ModelConfig

BACKENDS = ("auto", "wgpu", "numpy")
# The NumPy engine keeps every base weight as a float32 copy on the host: auto gives it at most this share of the
# memory the machine has available, so that activations, the optimizer and the rest of the process still fit.
NUMPY_MEMORY_SHARE = 0.6
# Weights in one layer's linear modules from which a CPU adapter trains faster than the NumPy engine (auto's rule
# where the only adapters are CPUs). Between the two shapes `wgpu-train bench --only engines` measures: the
# embedded default's layers (0.18M weights) ran faster on the NumPy engine, SmolLM2-135M's (3.5M) on lavapipe;
# the figures are in docs/guides/devices.md.
SMALL_LAYER_WEIGHTS = 1_000_000


@dataclass(frozen=True)
class BackendChoice:
    """The engine a run uses ("numpy" or "wgpu"), the adapter spec it opens (None: the preferred one), and why."""

    engine: str
    device: object
    reason: str


def available_memory() -> int:
    """Bytes this machine can still give a process: Linux's MemAvailable, else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def numpy_weight_bytes(cfg: ModelConfig) -> int:
    """Host bytes of the NumPy engine's float32 copies of every base weight."""
    return 4 * sum(int(np.prod(shape)) for shape in weight_shapes(cfg).values())


def layer_weights(cfg: ModelConfig) -> int:
    """Weights of a decoder layer's linear modules, on average over the layers (whose modules may differ): the
    work per token per layer, which separates the engines."""
    total = sum(int(np.prod(cfg.linear_shape(m))) for i in range(cfg.num_hidden_layers) for m in cfg.layer_modules(i))
    return total // max(1, cfg.num_hidden_layers)


def choose_backend(backend: str, device=None, cfg: ModelConfig | None = None, base_dtype: str = "float32",
                   embed_dtype: str = "auto", memory: int | None = None) -> BackendChoice:
    """Resolve `backend` ("auto", "wgpu" or "numpy") for a model (cfg) stored as base_dtype / embed_dtype; nothing
    is timed, so the choice is the same for training, generation, evaluation and serving, whatever the batch.

    auto: the WebGPU engine on the preferred adapter when it is a GPU (discrete, integrated, virtual or of an
    unknown type), or on the adapter `device` (or WGPU_TRAIN_DEVICE) names, whatever its type; the NumPy engine
    when there is no adapter. Where the preferred adapter is a CPU: the CPU adapter when the NumPy engine's
    float32 copies of the weights would exceed NUMPY_MEMORY_SHARE of `memory` (default: what the machine has
    available) and the adapter stores them in fewer bytes; else the NumPy engine for a model whose layers hold
    fewer than SMALL_LAYER_WEIGHTS weights (or without cfg), and the CPU adapter for one whose layers hold more.
    Models the WebGPU engine does not run yet (recurrent layers it cannot record) take the NumPy engine. ConfigError for an unknown backend."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "numpy":
        return BackendChoice("numpy", None, "as given")
    named = device is not None and str(device).strip() != ""
    if backend == "wgpu":
        return BackendChoice("wgpu", device, "as given")
    if not named and os.environ.get("WGPU_TRAIN_DEVICE", "").strip():
        device, named = os.environ["WGPU_TRAIN_DEVICE"], True
    if cfg is not None and cfg.recurrent and LayerRecorder.unrecorded_kinds(cfg):
        return BackendChoice("numpy", None, f"auto: the WebGPU engine does not run {cfg.recurrent_kind} layers yet")
    if named:                   # checked where it opens (a data-parallel run's list is split among its workers)
        return BackendChoice("wgpu", device, f"auto: --device names an adapter ({device})")
    if not runtime.has_adapter():
        return BackendChoice("numpy", None, "auto: no WebGPU adapter found")
    info = runtime.choose_adapter()
    if info.adapter_type != "CPU":
        return BackendChoice("wgpu", None, f"auto: a GPU, {info.describe()}")
    where = f"the only WebGPU adapters are CPUs ({info.name})"
    if cfg is None:
        return BackendChoice("numpy", None, f"auto: {where}")
    host = numpy_weight_bytes(cfg)
    stored = base_weight_bytes(cfg, base_dtype, embed_dtype)["total"]
    budget = NUMPY_MEMORY_SHARE * (available_memory() if memory is None else memory)
    if host > budget and stored < host:
        return BackendChoice("wgpu", None, f"auto: {where}, but the NumPy engine's float32 weights "
                             f"({host / 2**30:.1f} GiB) would not fit the {budget / 2**30:.1f} GiB it may use; "
                             f"{info.describe()} stores them in {stored / 2**30:.1f} GiB")
    per_layer, limit = layer_weights(cfg) / 1e6, SMALL_LAYER_WEIGHTS / 1e6
    if per_layer < limit:
        return BackendChoice("numpy", None, f"auto: {where}; this model's layers hold {per_layer:.2f}M weights "
                             f"each, under the {limit:g}M from which the adapter pays off")
    return BackendChoice("wgpu", None, f"auto: {where}; this model's layers hold {per_layer:.2f}M weights each, "
                         f"from {limit:g}M the adapter pays off")
