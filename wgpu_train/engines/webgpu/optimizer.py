"""The WebGPU engine's optimizer (Optimizer, a part that WgpuEngine owns): the trainable tensors' gradients and
AdamW moments (the vision tower's LoRA's too, set_tower), cut into pieces that each fit one binding, their zeroing,
the clipped gradient norm and AdamW."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.device.runtime import Runtime
from wgpu_train.engines.webgpu.tensors import F32, Matrix, Packed, read_tensor, write_tensor


def like(rt: Runtime, t, label: str):
    """A zeroed tensor of t's kind and size: a Matrix or a buffer."""
    if isinstance(t, Matrix):
        return Matrix(rt, t.rows, t.cols, label)
    return rt.buffer(t.size, label)


def parts(t) -> list:
    """(buffer, elements) pieces of a weight or its gradient."""
    if isinstance(t, Matrix):
        return [(b, n * t.cols) for b, _, n in t.chunks]
    return [(t, t.size // F32)]


class Optimizer:
    """The trainable tensors' state: `params`, `grads` and `moments` (name -> tensor, the same kind: Matrix,
    buffer or (buffer, offset) view), and `groups`, the (param, grad, m, v, n elements) pieces that zeroing, the
    gradient norm and AdamW take a dispatch each for; `b_groups` says per piece whether it holds LoRA B matrices
    (their learning rate: LoRA+)."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.params: dict = {}
        self.grads: dict = {}
        self.moments: dict = {}
        self.groups: list = []
        self.b_groups: list = []
        self.group_names: list = []     # per piece: the trained base weight it is part of (None: LoRA tensors)
        self.state_buffers: list = []
        self.norm_slots: list = []
        self.partials = None
        self._base: tuple = ([], [], [], [])   # the engine's pieces: groups, b_groups, group_names, state_buffers
        self._tower = None      # the vision tower's LoRA (set_tower): (params, grads, m, v) Packed, or None

    def reset(self, lora_packed, trained: tuple, w: dict):
        """Gradients and zeroed AdamW moments of the trainable tensors (lora_packed: the packed LoRA parameters
        and gradients, or None; trained: the names of trained base weights in w), and the pieces: each fits one
        binding and has one norm slot."""
        rt = self.rt
        if self._base[3]:
            rt.release(*self._base[3])
        self.params, self.grads, self.moments = {}, {}, {}
        self.groups, self.b_groups, self.group_names, self.state_buffers = [], [], [], []
        if lora_packed:                  # the LoRA tensors: packed, a few pieces (set_lora owns params, grads)
            params, grads = lora_packed
            m, v = Packed(rt, params.shapes, "lora_m"), Packed(rt, params.shapes, "lora_v")
            self.params = {k: params.view(k) for k in params.shapes}
            self.grads = {k: grads.view(k) for k in params.shapes}
            self.moments = {k: (m.view(k), v.view(k)) for k in params.shapes}
            step = max(1, (rt.max_binding - 256) // F32)
            # every A lies before every B (set_lora): pieces end at that boundary, so B's may take another lr
            b0 = min((params.view(k)[1] for k in params.shapes if k.endswith(".lora_B")), default=params.n)
            spans = [(o, min(step, end - o), start == b0) for start, end in ((0, b0), (b0, params.n))
                     for o in range(start, end, step)]
            self.groups = [((params.buf, o), (grads.buf, o), (m.buf, o), (v.buf, o), n) for o, n, _ in spans]
            self.b_groups = [is_b for _, _, is_b in spans]
            self.group_names = [None] * len(spans)
            self.state_buffers = [m.buf, v.buf]
        for k in trained:                 # trained base weights: a piece per row chunk, at lr (PEFT's LoRA+ too)
            p = self.params[k] = w[k]
            self.grads[k] = like(rt, p, k + ".grad")
            self.moments[k] = (like(rt, p, k + ".m"), like(rt, p, k + ".v"))
            pieces = [parts(t) for t in (p, self.grads[k], *self.moments[k])]
            self.groups += [(pp[0], gp[0], mp[0], vp[0], pp[1]) for pp, gp, mp, vp in zip(*pieces)]
            self.b_groups += [False] * len(pieces[0])
            self.group_names += [k] * len(pieces[0])
            self.state_buffers += [t for g in (self.grads[k], *self.moments[k]) for t, _ in parts(g)]
        self._base = (self.groups, self.b_groups, self.group_names, self.state_buffers)
        self._assemble()

    def set_tower(self, params: Packed | None, grads: Packed | None):
        """The vision tower's LoRA (its packed tensors and gradients, every A then every B: webgpu/vision_tower.py)
        trained with the engine's: its pieces after the engine's, in the same zeroing, unscaling, norm and AdamW,
        with zeroed moments; None: none."""
        if self._tower is not None:
            self.rt.release(self._tower[2].buf, self._tower[3].buf)
        self._tower = None
        if params is not None:
            self._tower = (params, grads, Packed(self.rt, params.shapes, "tower lora_m"),
                           Packed(self.rt, params.shapes, "tower lora_v"))
        self._assemble()

    def _assemble(self):
        """groups (and their lists) from the engine's pieces and the tower's, and the norm's partial sums."""
        groups, b_groups, names, _ = self._base
        self.groups, self.b_groups, self.group_names = list(groups), list(b_groups), list(names)
        if self._tower is not None:
            params, grads, m, v = self._tower
            step = max(1, (self.rt.max_binding - 256) // F32)
            b0 = min((o for k, o in params.offsets.items() if k.endswith(".lora_B")), default=params.n)
            for start, end in ((0, b0), (b0, params.n)):
                for o in range(start, end, step):
                    n = min(step, end - o)
                    self.groups.append(((params.buf, o), (grads.buf, o), (m.buf, o), (v.buf, o), n))
                    self.b_groups.append(start == b0)
                    self.group_names.append(None)
        if self.partials is not None:
            self.rt.release(self.partials)
        self.norm_slots = [K.grad_norm_slots(g[4]) for g in self.groups]
        self.partials = self.rt.buffer(F32 * max(1, sum(self.norm_slots)), "partials")

    def tower_state(self) -> dict:
        """The tower's LoRA AdamW moments by name (path.lora_A / .lora_B): (m, v) read back."""
        if self._tower is None:
            return {}
        params, _, m, v = self._tower
        ms, vs = (self.rt.read(t.buf, np.float32, (params.n,)) for t in (m, v))
        return {k: tuple(a[o:o + int(np.prod(params.shapes[k]))].reshape(params.shapes[k]).copy() for a in (ms, vs))
                for k, o in params.offsets.items()}

    def load_tower_state(self, state: dict):
        _, _, m, v = self._tower
        for k, (mk, vk) in state.items():
            write_tensor(self.rt, m.view(k), mk)
            write_tensor(self.rt, v.view(k), vk)

    def record_zero_grads(self, rec):
        for _, grad, _, _, n in self.groups:
            buf, off = grad if isinstance(grad, tuple) else (grad, 0)
            rec.clear(buf, off * F32, n * F32)

    def record_unscale(self, rec, scale: float):
        """Divide every gradient by f16's loss scale (exact: the scale is a power of two)."""
        for _, grad, _, _, n in self.groups:
            K.scale(rec, grad, grad, 1.0 / scale, n)

    def record_update(self, rec, hp, step: int, norm_at):
        """The gradient norm (clipped to hp.max_grad_norm, with its finite flag, written at norm_at) and AdamW."""
        rec.section("optimizer (grad norm, AdamW)")
        slots = self.record_norm_partials(rec)
        K.grad_norm_finalize(rec, norm_at, self.partials, slots, hp.max_grad_norm or 0.0)
        self.record_adamw(rec, hp, step, norm_at)

    def record_norm_partials(self, rec, leave_out=()) -> int:
        """Each piece's squared gradient summed into `partials`, a slot per workgroup, but the pieces of the
        trained weights named in leave_out; the slots written."""
        slot = 0
        for (_, grad, _, _, n), slots, name in zip(self.groups, self.norm_slots, self.group_names):
            if name is None or name not in leave_out:
                K.grad_norm_partial(rec, self.partials, slot, grad, n)
                slot += slots
        return slot

    def record_adamw(self, rec, hp, step: int, norm_at):
        """AdamW on every piece, its gradient times the clip scale at norm_at ([norm, clip scale, finite flag],
        as grad_norm_finalize writes it; a 0 flag skips the update)."""
        for (param, grad, m, v, n), is_b in zip(self.groups, self.b_groups):
            lr = hp.lr * hp.lora_b_lr_ratio if is_b else hp.lr
            K.adamw_update(rec, param, grad, m, v, n, lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, step,
                           scale_buf=norm_at)

    def record_given_norm(self, rec, norm: float, hp, step: int, norm_at):
        """AdamW on every piece clipped by a global norm gathered elsewhere (every pipeline stage's gradients, or
        the language model's with the vision tower's): [norm, clip scale, finite] written at norm_at (a buffer, an
        element offset), the values grad_norm_finalize computes from one process's gradients, then record_adamw."""
        clip = np.float32(1.0)          # as grad_norm_finalize computes it, in float32
        if hp.max_grad_norm and hp.max_grad_norm > 0:
            clip = min(clip, np.float32(hp.max_grad_norm) / (np.float32(norm) + np.float32(1e-6)))
        self.rt.write(norm_at[0], np.array([norm, clip, 1.0], np.float32), norm_at[1] * F32)
        self.record_adamw(rec, hp, step, norm_at)

    def grad_spans(self) -> list:
        """(buffer, element offset, elements) of the gradients, neighbouring pieces of one buffer merged: one
        span (the packed buffer) with LoRA, one per gradient buffer of a trained base weight (full fine-tuning,
        modules_to_save)."""
        spans: list = []
        for _, grad, _, _, n in self.groups:
            buf, off = grad if isinstance(grad, tuple) else (grad, 0)
            if spans and spans[-1][0] is buf and spans[-1][1] + spans[-1][2] == off:
                spans[-1][2] += n
            else:
                spans.append([buf, off, n])
        return spans

    def gradients(self, shape_of) -> dict:
        """Every gradient read back, name -> array of shape_of(name): the packed LoRA gradients in one readback."""
        packed, out = {}, {}
        for k, g in self.grads.items():
            if not isinstance(g, tuple):
                out[k] = read_tensor(self.rt, g, shape_of(k))
                continue
            buf, off = g
            if id(buf) not in packed:
                packed[id(buf)] = self.rt.read(buf, np.float32)
            shape = shape_of(k)
            out[k] = packed[id(buf)][off:off + int(np.prod(shape))].reshape(shape).copy()
        return out

    def state(self, shape_of) -> dict:
        """name -> (m, v) read back."""
        return {k: (read_tensor(self.rt, m, shape_of(k)), read_tensor(self.rt, v, shape_of(k)))
                for k, (m, v) in self.moments.items()}

    def load_state(self, state: dict):
        for k, (m, v) in state.items():
            write_tensor(self.rt, self.moments[k][0], m)
            write_tensor(self.rt, self.moments[k][1], v)
