"""wgpu-train: LoRA fine-tuning of Llama-family language models on any GPU through WebGPU."""
from .config import LoraConfig, ModelConfig
from .errors import (AdapterError, ConfigError, DataError, DeviceError, ModelFileError, ShaderError,
                     WgpuTrainError)
from .gpu.runtime import devices
from .model import Model, load_model

__version__ = "0.1.0"

__all__ = ["AdapterError", "ConfigError", "DataError", "DeviceError", "LoraConfig", "Model", "ModelConfig",
           "ModelFileError", "ShaderError", "WgpuTrainError", "devices", "load_model", "__version__"]
