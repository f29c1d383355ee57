"""What the vision towers on the WebGPU engine share (vision_tower.py's SigLIP, qwen_vision_tower.py's Qwen,
siglip2_tower.py's LFM2-VL): scratch buffers kept between calls and grown as batches need, and the tower's LoRA
packed on the device (every A then every B, in the engine's optimizer's order), written and read back by name."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.webgpu.tensors import Packed


class DeviceTower:
    """A tower on runtime rt whose buffers are labelled `label`; set_lora packs its LoRA into `params` (and
    `grads`, their gradients), `_lora` the offsets each module's forward reads."""

    label = "tower"

    def __init__(self, rt):
        self.rt = rt
        self._scratch: dict = {}        # name -> (buffer, capacity in elements), grown as batches need
        self._lora: dict = {}           # path -> (A's offset, B's offset, r, scale, out, in) in the packed buffers
        self.params = self.grads = None     # the LoRA tensors and their gradients (Packed), or None

    def _buffer(self, name: str, elems: int):
        """A float32 scratch buffer of at least elems, the one kept under `name` unless it is too small."""
        have = self._scratch.get(name)
        if have is None or have[1] < elems:
            if have is not None:
                self.rt.release(have[0])
            have = self._scratch[name] = (self.rt.buffer(max(elems, 1) * 4, f"{self.label} {name}"), elems)
        return have[0]

    def set_lora(self, lora: dict):
        """LoRA ({module path: (A (r, in), B (out, r), scale)}, the NumPy tower's dict; empty: none) uploaded,
        every A then every B in `params` (the engine's optimizer's order), their gradients in `grads`."""
        if self.params is not None:
            self.rt.release(self.params.buf, self.grads.buf)
        self._lora, self.params, self.grads = {}, None, None
        if not lora:
            return
        order = sorted(lora)
        shapes = {p + ".lora_A": np.shape(lora[p][0]) for p in order}
        shapes.update({p + ".lora_B": np.shape(lora[p][1]) for p in order})
        self.params = Packed(self.rt, shapes, f"{self.label} lora_params")
        self.grads = Packed(self.rt, shapes, f"{self.label} lora_grads")
        for path in order:
            a, b, scale = lora[path]
            self.write_lora({path + ".lora_A": a, path + ".lora_B": b})
            self._lora[path] = (self.params.offsets[path + ".lora_A"], self.params.offsets[path + ".lora_B"],
                                a.shape[0], float(scale), b.shape[0], a.shape[1])

    def write_lora(self, arrays: dict):
        """LoRA tensors by name (path.lora_A / .lora_B) written over the device's."""
        for name, arr in arrays.items():
            self.rt.write(self.params.buf, np.ascontiguousarray(arr, np.float32).reshape(-1),
                          self.params.offsets[name] * 4)

    def lora_arrays(self) -> dict:
        """The LoRA tensors by name (path.lora_A / .lora_B), read back in one readback."""
        return self._unpack(self.rt.read(self.params.buf, np.float32, (self.params.n,))) if self.params else {}

    def _unpack(self, flat) -> dict:
        """Packed LoRA tensors (flat, params' layout) by name."""
        return {name: flat[off:off + int(np.prod(self.params.shapes[name]))].reshape(self.params.shapes[name]).copy()
                for name, off in self.params.offsets.items()}
