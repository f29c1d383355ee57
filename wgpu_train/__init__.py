"""wgpu-train: LoRA fine-tuning of Llama-family language models on any GPU through WebGPU."""
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.models.config import ModelConfig
from wgpu_train.errors import (AdapterError, ConfigError, DataError, DeviceError, ModelFileError, RewardError,
                               ShaderError, ToolError, WgpuTrainError)
from wgpu_train.engines.resources import devices, estimate_memory
from wgpu_train.engines.model import Model
from wgpu_train.engines.loading import load_model
from wgpu_train.engines.shared.quant import BASE_DTYPES, EMBED_CHOICES, EMBED_DTYPES
from wgpu_train.formats.tokenizer import load_tokenizer
from wgpu_train.training.trainer import Trainer
from wgpu_train.distributed.dispatch import finetune
from wgpu_train.training.config import TrainConfig, default_run_config

__version__ = "0.1.0"

__all__ = ["BASE_DTYPES", "EMBED_CHOICES", "EMBED_DTYPES", "AdapterError", "ConfigError", "DataError",
           "DeviceError", "LoraConfig", "Model", "ModelConfig", "ModelFileError", "RewardError", "ShaderError",
           "ToolError", "TrainConfig", "Trainer", "WgpuTrainError", "default_run_config", "devices", "estimate_memory",
           "finetune", "load_model", "load_tokenizer", "__version__"]
