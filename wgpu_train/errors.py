"""Errors a user can cause: each carries one clear line; the CLI prints it and exits 2. (And positive_field,
the config.json check that raises one.)"""


class WgpuTrainError(Exception):
    """Base class of every error caused by user input, files or device limits."""


class ConfigError(WgpuTrainError):
    """An unsupported or malformed model, LoRA or training configuration."""


class ModelFileError(WgpuTrainError):
    """A model folder or weights file that is missing, truncated or inconsistent."""


class AdapterError(WgpuTrainError):
    """A LoRA adapter whose files, names or shapes do not fit the model."""


class DataError(WgpuTrainError):
    """A dataset file or line that cannot be used."""


class RewardError(WgpuTrainError):
    """A reward function that failed at a step: it raised, or returned a wrong number of rewards or a value that is
    neither a number nor None (names the function and the step)."""


class ToolError(WgpuTrainError):
    """A tool that cannot be used: a function whose JSON schema cannot be made (no type hints or docstring), a tools
    list that is no list of JSON schemas, or tools given to a chat template that cannot render them."""


class DeviceError(WgpuTrainError):
    """No usable WebGPU adapter, a lost device, or a request beyond the device's limits."""


class ShaderError(WgpuTrainError):
    """A WGSL shader that failed to compile or validate (names the file and line)."""


def positive_field(raw: dict, key: str, source: str) -> float:
    """raw[key], a number > 0; else a ConfigError naming the field of `source` (a config.json)."""
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{source}: field '{key}' must be a positive number, got {value!r}")
    return value
