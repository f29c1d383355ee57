"""Generation with a KV cache on the NumPy engine (KvCacheGeneration, a part of NumpyEngine): a key and a value
array per layer, and each recurrent layer's per-row state (shared/recurrent_state.py), rows of several sequences
decoded together."""
from __future__ import annotations

import numpy as np

from wgpu_train.models.config import ModelConfig
from wgpu_train.models.layer_plan import OUTPUT, layer_plans
from wgpu_train.engines.numpy.walk import Mode, Walk
from wgpu_train.engines.shared.kv_dtype import KvDtype
from wgpu_train.engines.shared.kv_rows import check_adapters, check_rows
from wgpu_train.engines.shared.recurrent_state import advance, new_states, row_runs


class KvCacheGeneration:
    """KV caches of kv_dtype held in arrays of dtype, and forwards over them through the engine's walk: embed
    (ids (n,) -> (n, C)), layer_forward (layer i's activations from its input), head (the final norm and head,
    (m, C) -> logits (m, V)); mode: the engine's (training off); images: the engine's images now (a
    shared/image_tokens.ImageTokens of a call's tokens, as (1, n), or None). Keeps the bank of mixed adapters
    (engines/shared/mixed_lora.py), which the engine's linear adds per row during forward_rows."""

    def __init__(self, cfg: ModelConfig, dtype, kv_dtype: KvDtype, mode: Mode, embed, layer_forward, head,
                 images=lambda: None):
        self.cfg, self.dtype, self.kv_dtype, self.mode = cfg, dtype, kv_dtype, mode
        self.embed, self.layer_forward, self.head, self.images = embed, layer_forward, head, images
        self.adapter_bank: dict = {}    # module path -> BankModule (set_adapter_bank replaces it, never mutates it)
        self.bank_rows = None           # (n,) each token's adapter during a forward_rows call with adapters

    def set_adapter_bank(self, bank: dict | None):
        """The adapters that forward_rows(adapters=) picks per row ({module path: BankModule}), or None."""
        self.adapter_bank = dict(bank or {})

    def new_kv_cache(self, batch: int, max_len: int) -> dict:
        """A KV cache of `batch` rows (sequences) of up to max_len positions each; its keys and values are
        rounded to self.kv_dtype where they are written (held in arrays of self.dtype); the recurrent layers' state
        of each row beside them (shared/recurrent_state.new_states)."""
        cfg = self.cfg
        shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        return {"k": np.zeros(shape, self.dtype), "v": np.zeros(shape, self.dtype), "len": 0,
                "batch": batch, "max_len": max_len, "dtype": self.kv_dtype,
                **new_states(layer_plans(cfg), range(cfg.num_hidden_layers), batch, self.dtype)}

    def forward_rows(self, ids, rows, positions, kv: dict, last, long_rope=None, adapters=None) -> np.ndarray:
        """See NumpyEngine.forward_rows."""
        ids, rows, positions, last = check_rows(ids, rows, positions, last, kv, self.cfg.vocab_size)
        self.bank_rows = check_adapters(adapters, ids.shape[0], self.adapter_bank)
        try:
            return self._forward_rows(ids, rows, positions, kv, last, long_rope)
        finally:
            self.bank_rows = None

    def _forward_rows(self, ids, rows, positions, kv, last, long_rope) -> np.ndarray:
        x = self.embed(ids)                                                       # (n, C)
        images = self.images()
        if images is not None:          # a prefill with whole images: their embeddings and blocks
            x[images.flat] = images.embeds
        self.mode.training = False
        if long_rope is None:
            long_rope = self.cfg.rope_long(int(positions.max(initial=0)))
        walk = Walk(1, ids.shape[0], positions[None], None, kv, rows, bool(long_rope),
                    runs=row_runs(kv, rows, positions), blocks=None if images is None else images.blocks,
                    rope_positions=None if images is None else images.positions)
        for i in range(self.cfg.num_hidden_layers):
            x = self.layer_forward(i, x, walk)[OUTPUT]
            if images is not None:          # Qwen3-VL's DeepStack features at the image tokens
                x = images.add_deepstack(x, i)
        advance(kv, walk.runs)
        return self.head(x[last])                                                 # (m, V)
