"""KvDtype: how generation's KV cache stores keys and values (--kv-dtype, engine.kv_dtype), parsed once where it
enters (load_model, the engines) and then carried with its traits. Attention over the cache computes in float32;
bfloat16 halves the cache, two values per 4-byte word on the GPU, so it needs an even head dim."""
from __future__ import annotations

from wgpu_train.engines.protocol import NamedValue
from wgpu_train.errors import ConfigError
from wgpu_train.models.config import ModelConfig


class KvDtype(NamedValue, option="kv_dtype"):
    """A KV cache's storage: float32 or bfloat16. A str, so it compares with, prints, hashes and serialises as
    its name."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    @property
    def storage(self) -> str:
        """The storage format of the cache's buffers on the GPU (engines/webgpu/device/storage.py): f32 or bf16."""
        return "f32" if self is KvDtype.FLOAT32 else "bf16"

    @property
    def bytes_per_value(self) -> int:
        """Bytes the cache spends on one key or value element: 4 or 2."""
        return 4 if self is KvDtype.FLOAT32 else 2

    @property
    def packed(self) -> bool:
        """Two values to a 4-byte word (bfloat16): a row's head dim must be even."""
        return self.bytes_per_value < 4


# the names --kv-dtype takes
KV_DTYPES = tuple(k.value for k in KvDtype)


def check_kv_dtype(kv_dtype, cfg: ModelConfig) -> KvDtype:
    """kv_dtype parsed (KvDtype.parse) for the model cfg; ConfigError (one line) for a packed cache where the
    model's head dim is odd."""
    kv = KvDtype.parse(kv_dtype)
    if kv.packed and cfg.head_dim % 2:
        raise ConfigError(f"a {kv} KV cache needs an even head dim (this model's is {cfg.head_dim}); "
                          f"use --kv-dtype {KvDtype.FLOAT32}")
    return kv
