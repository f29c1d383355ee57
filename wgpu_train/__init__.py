"""wgpu-train: LoRA fine-tuning of Llama-family language models on any GPU through WebGPU."""
from .config import LoraConfig, ModelConfig
from .errors import (AdapterError, ConfigError, DataError, DeviceError, ModelFileError, ShaderError,
                     WgpuTrainError)
from .gpu.runtime import devices
from .memory import estimate_memory
from .model import Model, load_model
from .reference.quant import BASE_DTYPES, EMBED_CHOICES, EMBED_DTYPES
from .tokenizer import load_tokenizer
from .train import Trainer, finetune
from .train_config import TrainConfig, default_run_config

__version__ = "0.1.0"

__all__ = ["BASE_DTYPES", "EMBED_CHOICES", "EMBED_DTYPES", "AdapterError", "ConfigError", "DataError",
           "DeviceError", "LoraConfig", "Model", "ModelConfig", "ModelFileError", "ShaderError", "TrainConfig",
           "Trainer", "WgpuTrainError", "default_run_config", "devices", "estimate_memory", "finetune", "load_model",
           "load_tokenizer", "__version__"]
