"""LoRA dropout's seeds on the WebGPU engine (DropoutSeeds, a part that WgpuEngine owns): the run's seed and the
micro-batches drawn so far, and a buffer of one seed per (micro-batch slot, module) that the dropout kernels hash
their masks from, as engines/numpy/engine.py draws them."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.shared.dropout import pcg_hash
from wgpu_train.engines.webgpu.device.runtime import Runtime
from wgpu_train.engines.webgpu.tensors import F32


class DropoutSeeds:
    """`seed` and `calls` (the protocol's dropout position: EngineState's dropout_seed and dropout_calls), `buffer`
    (n_modules u32 seeds per micro-batch slot) and `micro`, the slot being recorded."""

    def __init__(self, rt: Runtime, n_modules: int):
        self.rt, self.n_modules = rt, n_modules
        self.seed = self.calls = 0
        self.micro = 0
        self.buffer = rt.buffer(F32 * n_modules, "dropout_seeds")   # (micro-batch slot, module) -> u32

    def reserve(self, n_micro: int, keep: bool = False):
        """Room for the seeds of n_micro micro-batches (before anything of the step is recorded); keep: with the
        seeds written so far (a pipeline stage's micro-batches in flight), copied in a submission of its own."""
        if self.buffer.size < n_micro * self.n_modules * F32:
            old, self.buffer = self.buffer, self.rt.buffer(n_micro * self.n_modules * F32, "dropout_seeds")
            if keep:
                rec = self.rt.recorder()
                rec.copy(old, 0, self.buffer, 0, old.size)
                rec.submit()
            self.rt.release(old)

    def slot_of(self, module_id: int) -> int:
        """The buffer index of a module's seed in the micro-batch being recorded."""
        return self.micro * self.n_modules + module_id

    def write(self, slot: int, lora: dict):
        """Draw the next micro-batch's seeds of every module of lora (path -> GpuLora) into `slot`, and record
        into that slot from now on."""
        self.calls += 1
        self.micro = slot
        if not any(m.dropout > 0 for m in lora.values()):
            return
        seeds = np.zeros(self.n_modules, np.uint32)
        base = pcg_hash(np.uint32(self.seed) ^ np.uint32(self.calls))
        for m in lora.values():
            seeds[m.module_id] = pcg_hash(base ^ np.uint32(m.module_id))
        self.rt.write(self.buffer, seeds, slot * self.n_modules * F32)
