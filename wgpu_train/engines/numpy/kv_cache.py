"""Generation with a KV cache on the NumPy engine (NumpyKvCache, a part of NumpyEngine): a key and a value
array per layer, rows of several sequences decoded together."""
from __future__ import annotations

import numpy as np

from wgpu_train.models.layer_plan import OUTPUT
from wgpu_train.engines.numpy import ops
from wgpu_train.engines.numpy.walk import Walk
from wgpu_train.engines.shared.kv_rows import check_adapters, check_rows, forward_cached


class NumpyKvCache:
    """NumpyEngine's KV-cache generation (a mixin: it walks the engine's layer plan), with rows of mixed adapters
    (a bank: engines/shared/mixed_lora.py, which the engine's _linear adds per row)."""

    adapter_bank: dict = {}         # module path -> BankModule (set_adapter_bank replaces it, never mutates it)
    bank_rows = None                # (n,) each token's adapter during a forward_rows call with adapters

    def set_adapter_bank(self, bank: dict | None):
        """The adapters that forward_rows(adapters=) picks per row ({module path: BankModule}), or None."""
        self.adapter_bank = dict(bank or {})

    def new_kv_cache(self, batch: int, max_len: int) -> dict:
        """A KV cache of `batch` rows (sequences) of up to max_len positions each; its keys and values are
        rounded to self.kv_dtype where they are written (held in arrays of self.dtype)."""
        cfg = self.cfg
        shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        return {"k": np.zeros(shape, self.dtype), "v": np.zeros(shape, self.dtype), "len": 0,
                "batch": batch, "max_len": max_len, "dtype": self.kv_dtype}

    def free_kv_cache(self, kv: dict):
        """Drop a KV cache's arrays (the engine protocol: the GPU engine frees its buffers)."""
        kv["k"] = kv["v"] = None

    def forward_cached(self, ids, kv: dict) -> np.ndarray:
        """New tokens ids (B, Tq) of every row after the kv["len"] cached ones -> logits (B, V) of each row's last."""
        return forward_cached(self, ids, kv)

    def forward_rows(self, ids, rows, positions, kv: dict, last, long_rope=None, adapters=None) -> np.ndarray:
        """n new tokens, each with its own cache row and position: ids, rows, positions (n,) int.

        Every token's key and value is written into kv first; then token i attends to keys 0..positions[i]
        of row rows[i], so one call prefills several ragged prompts packed together, or advances every row
        by one token. Returns logits (m, V) float32 of the tokens at indices last (m,): only those go
        through the final norm and lm_head. long_rope: whether RoPE takes longrope's long factors (None: as
        the call's largest position says, ModelConfig.rope_long). adapters: (n,) each token's adapter in the bank
        (set_adapter_bank; negative: none), or None.
        """
        ids, rows, positions, last = check_rows(ids, rows, positions, last, kv, self.cfg.vocab_size)
        self.bank_rows = check_adapters(adapters, ids.shape[0], self.adapter_bank)
        try:
            return self._forward_rows(ids, rows, positions, kv, last, long_rope)
        finally:
            self.bank_rows = None

    def _forward_rows(self, ids, rows, positions, kv, last, long_rope) -> np.ndarray:
        x = self._embed(ids)                                                      # (n, C)
        self.training = False
        if long_rope is None:
            long_rope = self.cfg.rope_long(int(positions.max(initial=0)))
        walk = Walk(1, ids.shape[0], positions[None], None, kv, rows, bool(long_rope))
        for i in range(self.cfg.num_hidden_layers):
            x = self._layer_forward(i, x, walk)[OUTPUT]
        xf, _ = ops.rmsnorm_forward(x[last], self.w["model.norm.weight"], self.cfg.rms_norm_eps,
                                    self.cfg.norm_offset)                        # (m, C)
        xf = self.rounding.activation(xf, "the final norm")
        return ops.softcap_forward(ops.linear_forward(xf, self.lm_head()), self.cfg.logit_softcap).astype(np.float32)
