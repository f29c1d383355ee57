"""Generation with a KV cache on the WebGPU engine (KvCacheGeneration, a part that WgpuEngine owns): per layer a
key and a value buffer, rows of several sequences decoded together, each with its own adapter out of a bank
(mixed_lora.py, which the layers' linear adds per row)."""
from __future__ import annotations

import numpy as np

from wgpu_train.errors import DeviceError
from wgpu_train.models.config import ModelConfig
from wgpu_train.engines.shared.kv_dtype import KvDtype
from wgpu_train.engines.shared.kv_rows import check_adapters, check_rows
from wgpu_train.engines.webgpu import recurrent_state
from wgpu_train.engines.webgpu.mixed_lora import GpuBankModule
from wgpu_train.engines.webgpu.tuned import decode_kernels
from wgpu_train.engines.webgpu.buffers import BucketCache
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.operands import at
from wgpu_train.engines.webgpu.device.recorder import count_submissions
from wgpu_train.engines.webgpu.device.runtime import Runtime
from wgpu_train.engines.webgpu.layers import LayerRecorder


class KvCacheGeneration:
    """KV caches stored as kv_dtype, and forwards over them: a bucket from buckets, the layers recorded by
    layers, the submissions counted in counters."""

    def __init__(self, rt: Runtime, cfg: ModelConfig, kv_dtype: KvDtype, buckets: BucketCache, layers: LayerRecorder,
                 counters: dict):
        self.rt, self.cfg, self.kv_dtype = rt, cfg, kv_dtype
        self.buckets, self.layers, self.counters = buckets, layers, counters

    def set_adapter_bank(self, bank: dict | None):
        """The adapters that forward_rows(adapters=) picks per row ({module path: shared BankModule}, uploaded
        here as float32 into the layers' adapter_bank; the previous bank's buffers released), or None."""
        for module in self.layers.adapter_bank.values():
            self.rt.release(*module.buffers())
        self.layers.adapter_bank = {p: GpuBankModule.upload(self.rt, m) for p, m in (bank or {}).items()}

    def new_kv_cache(self, batch: int, max_len: int) -> dict:
        """A KV cache of `batch` rows (sequences) of up to max_len positions: per layer of the engine's span a key
        and a value buffer (batch, max_len, Hkv, D) by layer index, stored as self.kv_dtype, its storage format
        (bfloat16: two values per 4-byte word); the recurrent layers' state of each row beside them
        (recurrent_state.py)."""
        cfg = self.cfg
        fmt = self.kv_dtype.storage
        size = storage.nbytes(batch * max_len * cfg.kv_size, fmt)
        if size > self.rt.max_binding:
            raise DeviceError(f"a KV cache of {batch} x {max_len} positions needs {size / 2**20:.0f} MiB per layer, "
                              f"over the device's max storage binding of {self.rt.max_binding / 2**20:.0f} MiB: "
                              f"generate fewer sequences at once or fewer tokens")
        # the split passes' partials (decode_kernels), where they fit one binding
        scratch = decode_kernels.scratch_bytes(self.rt, batch, max_len, cfg.num_attention_heads, cfg.head_dim)
        span = self.layers.span        # the layers the engine holds (a pipeline stage's)
        return {"k": {i: storage.set_format(self.rt.buffer(size, "k_cache"), fmt) for i in span},
                "v": {i: storage.set_format(self.rt.buffer(size, "v_cache"), fmt) for i in span},
                "scratch": self.rt.buffer(scratch, "kv_scratch"),
                "len": 0, "batch": batch, "max_len": max_len, "dtype": self.kv_dtype,
                **recurrent_state.new_states(self.rt, self.layers.plans, span, batch)}

    def free_kv_cache(self, kv: dict):
        """Free a KV cache's buffers now (and the cached bind groups that hold them)."""
        self.rt.release(*kv["k"].values(), *kv["v"].values(), *([kv["scratch"]] if kv["scratch"] is not None else []))
        kv["k"] = kv["v"] = {}
        kv["scratch"] = None
        recurrent_state.free(self.rt, kv)

    def forward_rows(self, ids, rows, positions, kv: dict, last, long_rope=None, adapters=None) -> np.ndarray:
        """n new tokens, each with its own cache row and position (numpy.engine.NumpyEngine.forward_rows):
        keys and values written first, then causal attention within each row; logits (m, V) of the tokens
        at indices last (m,). One submission and one readback while the m rows of logits fit the head's
        chunk. The tokens are padded to a power of two (padding has row -1, which writes nothing) so that
        calls of varying sizes (decoding steps as rows finish, prefills) share a few activation buckets.
        adapters: (n,) each token's adapter in the bank (set_adapter_bank; negative: none), or None."""
        ids, rows, positions, last = check_rows(ids, rows, positions, last, kv, self.cfg.vocab_size)
        adapters = check_adapters(adapters, ids.shape[0], self.layers.adapter_bank)
        return self.rows_forward(ids, rows, positions, kv, last, long_rope, adapters)

    def rows_forward(self, inputs, rows, positions, kv: dict, last, long_rope=None, adapters=None) -> np.ndarray:
        """forward_rows with its arguments checked. inputs: the token ids (n,), or on a pipeline stage after the
        first the previous stage's packed activations (n, C); the logits (m, V), or on a stage before the last
        its output (n, C) float32."""
        n, m, c = rows.shape[0], last.shape[0], self.cfg.hidden_size
        if n == 0:
            return np.zeros((m, self.cfg.vocab_size) if self.layers.last else (0, c), np.float32)
        size = 1 << (n - 1).bit_length()
        pad = size - n
        before = dict(self.rt.counters)
        runs = recurrent_state.begin(self.rt, kv, rows, positions)
        acts = self.buckets.activations(1, size, train=False)
        padded = np.pad(inputs, [(0, pad)] + [(0, 0)] * (np.ndim(inputs) - 1))     # (size,) ids or (size, C)
        # the rows go where the segment ids go (which sequence each token belongs to), `last` where the targets go
        self.buckets.upload_batch(acts, padded[None] if padded.ndim == 1 else padded,
                                  np.pad(rows, (0, pad), constant_values=-1)[None], np.pad(positions, (0, pad))[None],
                                  last=np.pad(last, (0, size - m))[None])
        if long_rope is not None:
            acts.rope_long = bool(long_rope)
        self.layers.training = False
        if adapters is not None:        # one buffer per bucket size, rewritten each call (padding: no adapter)
            self.layers.bank_rows = self.rt.memo(("bank_rows", size), lambda rt: rt.buffer(size * 4, "bank_rows"))
            self.rt.write(self.layers.bank_rows, np.pad(adapters, (0, pad), constant_values=-1).astype(np.int32))
        rec = self.rt.recorder()
        try:
            self.layers.record_forward(rec, acts, kv, m)
        finally:
            self.layers.bank_rows = None
        recurrent_state.advance(kv, runs)
        if not self.layers.last:
            rec.submit()
            out = self.buckets.read_activations(acts.x_final, n)                  # (n, C)
            count_submissions(self.rt, self.counters, before)
            return out
        v = self.cfg.vocab_size
        out = np.empty((m, v), np.float32)
        if m == 0:   # keys and values only
            rec.submit()
        for r0 in range(0, m, acts.head_rows):
            if r0:
                rec = self.rt.recorder()
            count = min(acts.head_rows, m - r0)
            self.layers.head_logits(rec, acts, at(acts.x_final, r0 * c), count)
            rec.submit()
            out[r0:r0 + count] = self.rt.read(acts.logits, np.float32, (count, v))
        count_submissions(self.rt, self.counters, before)
        return out
