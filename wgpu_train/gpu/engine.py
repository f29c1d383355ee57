"""The WebGPU engine: persistent weights, activations per (batch, length) bucket, and a whole
optimizer step (forward, loss, backward, clipping, AdamW) recorded into one command encoder."""
from __future__ import annotations

import os
import time

import numpy as np

from ..config import LINEAR_MODULES, ModelConfig
from ..errors import ConfigError, DeviceError
from ..hf import module_path
from ..memory import SHARED_LAYER, activation_plan, activation_ranks, bucket_tokens, check_fits, head_rows, lora_groups
from ..reference import ops as ref_ops
from ..reference.model import check_rows, forward_cached
from ..reference.quant import check_dtypes
from . import attention_kernels
from . import kernels as K
from . import quant
from .lora import lora_a_forward, lora_backward, lora_group_backward, linear_lora_forward
from .quant import QuantMatrix
from .runtime import Runtime
from .operands import at
from .tensors import F32, Matrix, Packed, linear_backward, linear_forward, store_weight, weight_buffers


class GpuLora:
    """A LoRA pair on the GPU: views of A (r, in) and B (out, r) and of their gradients."""

    def __init__(self, path, a, b, ga, gb, shape_a, shape_b, scale, dropout, module_id):
        self.path, self.scale, self.dropout, self.module_id = path, float(scale), float(dropout), module_id
        self.a, self.b, self.ga, self.gb = a, b, ga, gb
        self.r, self.in_f = shape_a
        self.out_f = shape_b[0]


def loss_head_size(m: int, n: int) -> int:
    """Rows the loss head computes for m trained rows out of n: m rounded up to a multiple of 8, or of
    1/8 of m's power of two beyond 64 (at most 1/8 more rows), capped at n. The sizes of the head's
    dispatches follow it, and their uniforms are cached by value: a run then meets a few dozen of them,
    where every trained-token count would each add its own."""
    if m <= 0:
        return 0
    unit = max(8, 1 << max(0, m.bit_length() - 4))
    return min(n, -(-m // unit) * unit)


class Inputs:
    """The uploaded batch of one micro-batch slot, all i32 (B*T,): ids, segment ids, positions, targets
    (those of the loss head's rows, or generation's row indices) and head_index (the loss head's rows)."""

    def __init__(self, rt: Runtime, n: int):
        self.ids, self.segments, self.positions, self.targets, self.head_index = (
            rt.buffer(n * F32, name) for name in ("ids", "segment_ids", "positions", "targets", "head_index"))


class Activations:
    """Every buffer a bucket of `capacity` tokens needs for forward and backward, allocated once and reused by
    every batch of up to that many tokens: the kernels take each batch's sizes (use(b, t)), and each buffer
    holds its tensor for `capacity` rows.

    layers[i] maps a name to layer i's buffer. With checkpoint (gradient checkpointing, training only)
    only "x_in" is layer i's own: the other names map to one set of buffers shared by every layer, which
    the backward refills by recomputing each layer's forward. A forward-only bucket (train=False) has
    one set for all layers, x_in included (memory.activation_plan)."""

    def __init__(self, rt: Runtime, cfg: ModelConfig, capacity: int, lora_ranks: dict, dropout_inputs: dict,
                 train: bool, checkpoint: bool = False, batch: tuple = (1, 0)):
        self.capacity, self.train = capacity, train
        self.checkpoint = checkpoint and train
        self.head_rows = head_rows(cfg, capacity, rt.max_binding)    # logits rows per chunk of the loss head
        layer, shared = activation_plan(cfg, 1, capacity, lora_ranks, dropout_inputs, train, self.checkpoint,
                                        rt.max_binding)
        check_fits(cfg, batch[0], batch[1], rt.max_binding, layer, shared)    # named after the batch that asked
        # set per use: the batch's shape, its Inputs, n_head (rows of the loss head, gathered by head_index)
        self.b = self.t = self.n = self.n_head = 0
        self.ids = self.segments = self.positions = self.targets = self.head_index = None
        try:
            one_set = {name[len(SHARED_LAYER):]: rt.buffer(max(1, e) * F32, name) for name, e in shared.items()
                       if name.startswith(SHARED_LAYER)}
            self.layers = [{**{name: rt.buffer(max(1, e) * F32, name) for name, e in layer.items()}, **one_set}
                           for _ in range(cfg.num_hidden_layers)]
            for name, e in shared.items():
                if not name.startswith(SHARED_LAYER):
                    setattr(self, name, rt.buffer(max(1, e) * F32, name))
        except DeviceError as e:
            hint = "" if self.checkpoint or not train else ", or pass --gradient-checkpointing"
            raise DeviceError(f"{e}, for the activations of batch {batch[0]} x {batch[1]} tokens: reduce the batch "
                              f"size or --max-seq-len{hint}") from None

    @property
    def key(self) -> tuple:
        return self.capacity, self.train, self.checkpoint

    def use(self, b: int, t: int):
        """Run the next recording with a batch of b rows of t tokens (b * t <= capacity); _upload_batch then
        points the bucket at the batch's inputs and sets n_head."""
        self.b, self.t, self.n = b, t, b * t


class WgpuEngine:
    """The engine protocol of reference.model.NumpyEngine, on a WebGPU device."""

    name = "wgpu"
    MAX_BUCKETS = 4             # training activation buckets kept allocated at once
    MAX_FORWARD_BUCKETS = 8     # forward-only ones (one set of layer buffers each): generation uses several

    def __init__(self, cfg: ModelConfig, weights: dict, rt: Runtime, base_dtype: str = "float32",
                 embed_dtype: str = "auto"):
        if not attention_kernels.supported_head_dim(cfg.head_dim):
            raise ConfigError(f"config.json: field 'head_dim' ({cfg.head_dim}) is not one the WebGPU attention "
                              f"kernels support (up to {attention_kernels.MAX_HEAD_DIM}, a multiple of 4 above "
                              f"{attention_kernels.ROWS_DMAX}); use backend='numpy'")
        self.cfg, self.rt = cfg, rt
        self.dtype = np.dtype(np.float32)
        self.base_dtype, self.embed_dtype = base_dtype, embed_dtype = check_dtypes(base_dtype, embed_dtype)
        self.w: dict = {}          # HF name -> Matrix or QuantMatrix (2-D) or buffer (1-D)
        self.shapes: dict = {}
        for name in weights:       # one tensor at a time: `weights` may convert each as it is read
            arr = weights[name]
            self.shapes[name] = tuple(arr.shape)
            self.w[name] = store_weight(rt, name, arr, base_dtype, embed_dtype)
        # GPU bytes of the base weights as allocated (memory.base_weight_bytes predicts the same)
        self.base_weight_bytes = sum(b.size for t in self.w.values() for b in weight_buffers(t))
        self.inv_freq = rt.upload(cfg.inv_freq().astype(np.float32), "inv_freq")
        self.lora: dict[str, GpuLora] = {}
        self._group_of: dict = {}  # module name -> its LoRA group (set_lora)
        self._pending: dict = {}   # member -> dy of a group whose LoRA backward waits for the others
        self.full = False
        self.params: dict = {}     # trainable name -> tensor: Matrix, buffer or (buffer, offset) view
        self.grads: dict = {}      # trainable name -> its gradient, the same kind
        self.moments: dict = {}    # trainable name -> (m, v), the same kind
        self._groups: list = []    # optimizer pieces: (param, grad, m, v, n elements)
        self._state_buffers: list = []
        self._lora_packed = None
        self.dropout_seed, self.dropout_calls = 0, 0
        self.gradient_checkpointing = False
        self._acts: dict = {}      # (capacity in tokens, train, checkpointed) -> Activations
        self._inputs: dict = {}    # (bucket capacity, micro-batch slot) -> Inputs
        self._micro = 0            # micro-batch slot being recorded (selects dropout seeds)
        self.step_buf = rt.buffer(64, "step_scalars")       # [grad_scale]
        self.results = rt.buffer(4 * F32, "results")       # loss_sum, count, (norm, clip, finite)
        self.partials = None
        self.n_modules = cfg.num_hidden_layers * len(LINEAR_MODULES)
        self.seeds = rt.buffer(F32 * self.n_modules, "dropout_seeds")   # (micro-batch slot, module) -> u32
        self.counters = {"submits": 0, "readbacks": 0, "bytes_uploaded": 0, "bytes_read": 0, "nonfinite_skipped": 0,
                         "buckets_allocated": 0}
        self.last_step: dict = {}
        # GPU seconds one submission may hold (WGPU_TRAIN_MAX_SUBMIT_S), and the dispatches per submission
        # that keep a step under it (0: the whole step in one), measured from the previous step
        self.max_submit_s = float(os.environ.get("WGPU_TRAIN_MAX_SUBMIT_S", "1.0"))
        self._dispatch_budget = 0
        self.last_profile: dict = {}
        self.last_timing: dict = {}

    # ---- parameters ---------------------------------------------------------------------------
    def _head(self) -> Matrix:
        return self.w["model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"]

    def set_lora(self, modules: dict):
        """modules: path -> (A, B, scale, dropout); replaces every LoRA module and resets the optimizer.

        All LoRA tensors live in one packed buffer (their gradients and AdamW moments in three more),
        so zeroing, the gradient norm and AdamW take a dispatch per buffer rather than per tensor."""
        self._release_acts()
        # every A first, layer by layer in module order, so that the A matrices of a group lie back to back
        order = sorted(modules, key=lambda p: (int(p.split(".")[2]), LINEAR_MODULES.index(p.rsplit(".", 1)[1])))
        shapes = {p + ".lora_A": modules[p][0].shape for p in order}
        shapes.update({p + ".lora_B": modules[p][1].shape for p in order})
        self.lora = {}
        self._lora_packed = Packed(self.rt, shapes, "lora_params"), Packed(self.rt, shapes, "lora_grads")
        params, grads = self._lora_packed
        for path, (a, b, s, d) in modules.items():
            layer, module = int(path.split(".")[2]), path.rsplit(".", 1)[1]
            na, nb = path + ".lora_A", path + ".lora_B"
            self._write(params.view(na), a)
            self._write(params.view(nb), b)
            self.lora[path] = GpuLora(path, params.view(na), params.view(nb), grads.view(na), grads.view(nb),
                                      a.shape, b.shape, s, d, layer * len(LINEAR_MODULES) + LINEAR_MODULES.index(module))
        self._group_of = self._lora_groups()
        self._reset_training_state()

    def _lora_groups(self) -> dict:
        """module name -> the modules that run their LoRA as one (memory.lora_groups' rule: the same for
        the memory estimate), each group with LoRA in every layer that has any of it, A matrices back to back."""
        ranks = {p.rsplit(".", 1)[1]: m.r for p, m in self.lora.items()}
        dropout = any(m.dropout > 0 for m in self.lora.values())
        out = {}
        for module, members in lora_groups(self.cfg, ranks, dropout).items():
            layers = {int(p.split(".")[2]) for p in self.lora if p.rsplit(".", 1)[1] in members}
            mods = [[self.lora.get(module_path(i, m)) for m in members] for i in sorted(layers)]
            if any(x is None for row in mods for x in row):
                continue
            if any(row[j + 1].a[1] != row[j].a[1] + row[j].r * row[j].in_f for row in mods for j in range(len(row) - 1)):
                continue     # not back to back (set_lora's packing order puts them so)
            out[module] = members
        return out

    def seed_dropout(self, seed: int):
        self.dropout_seed, self.dropout_calls = int(seed) & 0xFFFFFFFF, 0

    def state_dict(self) -> dict:
        return {"dropout_seed": int(self.dropout_seed), "dropout_calls": int(self.dropout_calls)}

    def load_state_dict(self, state: dict):
        self.dropout_seed = int(state.get("dropout_seed", self.dropout_seed))
        self.dropout_calls = int(state.get("dropout_calls", 0))

    @property
    def max_binding(self) -> int:
        return self.rt.max_binding

    @property
    def device_description(self) -> str:
        return self.rt.info.describe()

    def set_full_finetune(self, enabled: bool = True):
        frozen = sorted(k for k, t in self.w.items() if isinstance(t, QuantMatrix))
        if enabled and frozen:
            raise ConfigError(f"full fine-tuning needs float32 weights, but {frozen[0]} is stored as "
                              f"{self.w[frozen[0]].dtype}; use LoRA or load the model with float32")
        self.full = bool(enabled)
        self._release_acts()
        self._reset_training_state()

    def set_gradient_checkpointing(self, on: bool = True):
        """Gradient (activation) checkpointing of training steps: each layer keeps only its input, and the
        backward recomputes the layer's forward (the same kernels on the same inputs, LoRA dropout masks
        included, so the gradients are bit-identical) before its backward. Activation memory drops from
        every layer's buffers to one layer's plus every layer's input, for about one more forward per step.
        Evaluation and generation are unaffected."""
        if bool(on) != self.gradient_checkpointing:
            self.gradient_checkpointing = bool(on)
            self._release_acts()

    def _reset_training_state(self):
        """Gradients and zeroed AdamW moments of the trainable tensors, and the optimizer's groups:
        (param, grad, m, v, n) pieces that each fit one binding, one norm slot each."""
        rt = self.rt
        if self._state_buffers:
            rt.release(*self._state_buffers)
        if self.full:
            self.params = dict(self.w)
            self.grads = {k: self._like(p, k + ".grad") for k, p in self.params.items()}
            self.moments = {k: (self._like(p, k + ".m"), self._like(p, k + ".v")) for k, p in self.params.items()}
            self._groups = []
            for k, p in self.params.items():
                parts = [self._parts(t) for t in (p, self.grads[k], *self.moments[k])]
                self._groups += [(pp[0], gp[0], mp[0], vp[0], pp[1]) for pp, gp, mp, vp in zip(*parts)]
            self._state_buffers = [t for g in self.grads.values() for t, _ in self._parts(g)]
            self._state_buffers += [t for mv in self.moments.values() for m in mv for t, _ in self._parts(m)]
        else:
            params, grads = self._lora_packed or (Packed(rt, {}, "lora_params"), Packed(rt, {}, "lora_grads"))
            m, v = Packed(rt, params.shapes, "lora_m"), Packed(rt, params.shapes, "lora_v")
            self.params = {k: params.view(k) for k in params.shapes}
            self.grads = {k: grads.view(k) for k in params.shapes}
            self.moments = {k: (m.view(k), v.view(k)) for k in params.shapes}
            step = max(1, (rt.max_binding - 256) // F32)
            self._groups = [((params.buf, o), (grads.buf, o), (m.buf, o), (v.buf, o), min(step, params.n - o))
                            for o in range(0, params.n, step)]
            self._state_buffers = [params.buf, grads.buf, m.buf, v.buf]
        self._norm_slots = [K.grad_norm_slots(g[4]) for g in self._groups]
        self.partials = rt.buffer(F32 * max(1, sum(self._norm_slots)), "partials")
        self._state_buffers.append(self.partials)

    def _like(self, t, label):
        if isinstance(t, Matrix):
            return Matrix(self.rt, t.rows, t.cols, label)
        return self.rt.buffer(t.size, label)

    @staticmethod
    def _parts(t):
        """(buffer, elements) pieces of a weight or its gradient."""
        if isinstance(t, Matrix):
            return [(b, n * t.cols) for b, _, n in t.chunks]
        return [(t, t.size // F32)]

    def _read(self, t, shape):
        """A tensor (Matrix, buffer, or (buffer, element offset) view) back as an array of `shape`."""
        if isinstance(t, Matrix):
            return t.read(self.rt)
        if isinstance(t, tuple):
            return self.rt.read(t[0], np.float32, shape, offset=t[1] * F32)
        return self.rt.read(t, np.float32, shape)

    def _write(self, t, arr):
        if isinstance(t, Matrix):
            t.write(self.rt, arr)
        elif isinstance(t, tuple):
            self.rt.write(t[0], np.ascontiguousarray(arr, dtype=np.float32).reshape(-1), t[1] * F32)
        else:
            self.rt.write(t, np.ascontiguousarray(arr, dtype=np.float32))

    def _shape_of(self, name):
        return self.shapes[name] if self.full else self._lora_packed[0].shapes[name]

    def trainable(self) -> dict:
        """Trainable arrays by name ('path.lora_A' / 'path.lora_B', or weight names), read back (copies)."""
        return {k: self._read(t, self._shape_of(k)) for k, t in self.params.items()}

    def set_trainable(self, arrays: dict):
        for k, arr in arrays.items():
            self._write(self.params[k], arr)

    def lora_tensors(self) -> dict:
        return {p: (self._read(m.a, (m.r, m.in_f)), self._read(m.b, (m.out_f, m.r))) for p, m in self.lora.items()}

    def weights(self) -> dict:
        """Base weights as float32 (float16 / NF4 ones dequantised)."""
        return {k: t.read(self.rt) if isinstance(t, QuantMatrix) else self._read(t, self.shapes[k])
                for k, t in self.w.items()}

    def zero_grads(self):
        rec = self.rt.recorder()
        self._record_zero_grads(rec)
        self._submit(rec)

    def _record_zero_grads(self, rec):
        for _, grad, _, _, n in self._groups:
            buf, off = grad if isinstance(grad, tuple) else (grad, 0)
            rec.clear(buf, off * F32, n * F32)

    def gradients(self) -> dict:
        return {k: self._read(g, self._shape_of(k)) for k, g in self.grads.items()}

    def optimizer_state(self) -> dict:
        return {k: (self._read(m, self._shape_of(k)), self._read(v, self._shape_of(k)))
                for k, (m, v) in self.moments.items()}

    def load_optimizer_state(self, state: dict):
        for k, (m, v) in state.items():
            self._write(self.moments[k][0], m)
            self._write(self.moments[k][1], v)

    # ---- buffers per bucket -------------------------------------------------------------------
    def _activations(self, b, t, train=True, keep=()) -> Activations:
        """A bucket that holds b x t tokens, set to that shape: the smallest allocated one of its kind (training
        or not, checkpointed or not) that is big enough, else a new one of memory.bucket_tokens(b * t) tokens
        (the exact size when that one would not fit the device). Allocating one frees the smaller buckets of
        its kind and, beyond MAX_BUCKETS, the least recently used; never those in `keep` (keys of buckets
        already recorded into the open encoder)."""
        n, checkpoint = b * t, train and self.gradient_checkpointing
        fits = [k for k in self._acts if k[1:] == (train, checkpoint) and k[0] >= n]
        if fits:
            key = min(fits)
            acts = self._acts.pop(key)
        else:
            for old in [k for k in self._acts if k[1:] == (train, checkpoint) and k not in keep]:
                self._free_bucket(old)
            limit = self.MAX_BUCKETS if train else self.MAX_FORWARD_BUCKETS
            while sum(k[1] == train for k in self._acts) >= limit:
                old = next((k for k in self._acts if k[1] == train and k not in keep), None)
                if old is None:
                    break
                self._free_bucket(old)
            groups = self._group_of
            ranks = activation_ranks({p.rsplit(".", 1)[1]: m.r for p, m in self.lora.items()}, groups)
            drop = {p.rsplit(".", 1)[1]: m.in_f for p, m in self.lora.items() if m.dropout > 0 and train}
            try:
                acts = Activations(self.rt, self.cfg, bucket_tokens(n), ranks, drop, train, checkpoint, (b, t))
            except DeviceError:     # the rounded-up bucket does not fit: one of the batch's own size
                acts = Activations(self.rt, self.cfg, n, ranks, drop, train, checkpoint, (b, t))
            self.counters["buckets_allocated"] += 1
        self._acts[acts.key] = acts          # most recently used last
        acts.use(b, t)
        return acts

    def _free_bucket(self, key):
        """Free one bucket, and its batch inputs when no other bucket of its capacity remains."""
        self._free(self._acts.pop(key))
        if not any(k[0] == key[0] for k in self._acts):
            for stale in [k for k in self._inputs if k[0] == key[0]]:
                self.rt.release(*vars(self._inputs.pop(stale)).values())

    def _free(self, acts: Activations):
        # buffers shared by all layers (forward-only and checkpointed buckets) are released once
        bufs = list({id(b): b for layer in acts.layers for b in layer.values()}.values())
        bufs += [v for k, v in vars(acts).items() if hasattr(v, "destroy") and k not in
                 ("ids", "segments", "positions", "targets", "head_index")]
        self.rt.release(*bufs)

    def _release_acts(self):
        for acts in self._acts.values():
            self._free(acts)
        self.rt.release(*[b for inp in self._inputs.values() for b in vars(inp).values()])
        self._acts.clear()
        self._inputs.clear()

    def _upload_batch(self, acts, ids, segment_ids, position_ids, targets=None, slot=0, last=None):
        """Write one micro-batch into the input buffers of its slot and point acts at them.

        targets (B, T) (training, evaluation): only the rows with a target (not IGNORE_INDEX) go through
        the loss head. Their indices, padded with untrained rows to loss_head_size, go to head_index and
        their targets, in that order, to targets; acts.n_head counts them. When that is every row, the
        targets go as they are and head_index is unused (acts.head_index None).
        last (generation, forward_rows): row indices, written to targets as they are."""
        rt = self.rt
        b, t = ids.shape
        n = b * t
        inp = self._inputs.get((acts.capacity, slot))
        if inp is None:
            inp = self._inputs[(acts.capacity, slot)] = Inputs(rt, acts.capacity)
        acts.ids, acts.segments, acts.positions, acts.targets = inp.ids, inp.segments, inp.positions, inp.targets
        rt.write(acts.ids, ids.astype(np.int32).reshape(-1))
        rt.write(acts.segments, segment_ids.astype(np.int32).reshape(-1))
        rt.write(acts.positions, position_ids.astype(np.int32).reshape(-1))
        acts.head_index, acts.n_head = None, n
        if last is not None:
            rt.write(acts.targets, last.astype(np.int32).reshape(-1))
        if targets is None:
            return
        tg = targets.astype(np.int32).reshape(-1)                    # (B*T,)
        trained = tg != ref_ops.IGNORE_INDEX
        m = loss_head_size(int(trained.sum()), n)
        if m == n:
            rt.write(acts.targets, tg)
            return
        # padding rows are untrained ones (ignored targets: no loss, zero gradient), so indices stay distinct
        rows = np.concatenate([np.flatnonzero(trained), np.flatnonzero(~trained)])[:m].astype(np.int32)  # (m,)
        acts.head_index, acts.n_head = inp.head_index, m
        rt.write(acts.head_index, rows)
        rt.write(acts.targets, tg[rows])

    # ---- forward ------------------------------------------------------------------------------
    def _embed(self, rec, out, ids, n):
        emb = self.w["model.embed_tokens.weight"]
        if isinstance(emb, QuantMatrix):
            return quant.embedding_forward(rec, out, ids, emb, n)
        for buf, r0, rows in emb.chunks:
            K.embedding_forward(rec, out, ids, buf, n, emb.cols, rows, r0)

    def _linear(self, rec, y, x, layer, module, acts, a, accumulate=False):
        """Base linear (+ LoRA, with dropout on its input while training) of one module. With LoRA, h = x A^T
        comes first, so that the base GEMM can add the B term in the same dispatch (linear_lora_forward)."""
        path = module_path(layer, module)
        w, bias = self.w[path + ".weight"], self.w.get(path + ".bias")
        n = acts.n
        rec.section(self._where + " gemm")
        lora = self.lora.get(path)
        if lora is None:
            linear_forward(rec, y, x, w, bias, n, accumulate)
            return
        group = self._group_of.get(module)
        if group is None:
            xl = self._lora_input(rec, x, lora, module, a, n)
            h, ldh = a["lora_h." + module], lora.r
            lora_a_forward(rec, h, xl, lora.a, n, lora.in_f, lora.r)
        else:
            # a group: its first module computes h of all of them in one GEMM; each adds its own columns' term
            mods = [self.lora[module_path(layer, m)] for m in group]
            h, ldh = a["lora_h." + "+".join(group)], sum(m.r for m in mods)
            if module == group[0]:
                lora_a_forward(rec, h, x, lora.a, n, lora.in_f, ldh)
            h = at(h, sum(m.r for m in mods[:group.index(module)]))
        linear_lora_forward(rec, y, x, w, bias, n, h, ldh, lora.b, lora.scale, lora.r, accumulate)

    def _lora_input(self, rec, x, lora: GpuLora, module, a, n):
        """The LoRA module's input: x, or while training with dropout x times the micro-batch's mask
        (saved in the layer's lora_x buffer; the mask is a hash of the seed slot, so recomputing it repeats it)."""
        if lora.dropout > 0 and self._training:
            xl = a["lora_x." + module]
            K.lora_dropout_forward(rec, xl, x, self.seeds, self._seed_slot(lora), lora.dropout, n * lora.in_f)
            return xl
        return x

    def _record_forward(self, rec, acts: Activations, kv: dict | None = None, n_last: int = 0):
        """The layers and the final norm. With a KV cache `kv` (generation, forward_rows), acts.segments
        holds each token's cache row: keys and values are written into the cache, attention reads it, and
        only the n_last tokens whose indices acts.targets holds are normed, into x_final's first rows."""
        n, c, eps = acts.n, self.cfg.hidden_size, self.cfg.rms_norm_eps
        self._where = "embedding forward"
        rec.section(self._where)
        self._embed(rec, acts.layers[0]["x_in"] if acts.layers else acts.x_final, acts.ids, n)
        for i in range(len(acts.layers)):
            rec.split_point()
            self._record_layer_forward(rec, acts, i, kv)
        rec.section("final norm forward")
        if kv is None:
            K.rmsnorm_forward(rec, acts.xf, acts.rstd_f, acts.x_final, self.w["model.norm.weight"], n, c, eps)
        else:   # gather the wanted rows into xf, then norm them back into x_final, whose rows are all read by then
            K.embedding_forward(rec, acts.xf, acts.targets, acts.x_final, n_last, c, n)
            K.rmsnorm_forward(rec, acts.x_final, acts.rstd_f, acts.xf, self.w["model.norm.weight"], n_last, c, eps)

    def _record_layer_forward(self, rec, acts: Activations, i: int, kv: dict | None = None, recompute=False):
        """Layer i's forward from its input x_in, writing the next layer's input (x_final after the last).
        recompute=True (gradient checkpointing, in the backward) refills the layer's buffers for its backward
        and leaves the next layer's input alone: of down_proj only the LoRA input and h are recomputed, since
        its backward needs its input m (and those) but not its output."""
        cfg = self.cfg
        b, t, n = acts.b, acts.t, acts.n
        c, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        eps = cfg.rms_norm_eps
        a = acts.layers[i]
        p = f"model.layers.{i}."
        self._where = f"layer {i} {'recompute' if recompute else 'forward'}"
        rec.section(self._where + " norm")
        K.rmsnorm_forward(rec, a["h1"], a["rstd1"], a["x_in"], self.w[p + "input_layernorm.weight"], n, c, eps)
        q_out = a["q_pre"] if cfg.qk_norm else a["q"]
        k_out = a["k_pre"] if cfg.qk_norm else a["k"]
        self._linear(rec, q_out, a["h1"], i, "q_proj", acts, a)
        self._linear(rec, k_out, a["h1"], i, "k_proj", acts, a)
        self._linear(rec, a["v"], a["h1"], i, "v_proj", acts, a)
        rec.section(self._where + " attention")
        if cfg.qk_norm:
            K.rmsnorm_forward(rec, a["q"], a["rstd_q"], a["q_pre"], self.w[p + "self_attn.q_norm.weight"], n * hq, d, eps)
            K.rmsnorm_forward(rec, a["k"], a["rstd_k"], a["k_pre"], self.w[p + "self_attn.k_norm.weight"], n * hkv, d, eps)
        K.rope_forward(rec, a["q"], a["q"], acts.positions, self.inv_freq, n, hq, d)
        K.rope_forward(rec, a["k"], a["k"], acts.positions, self.inv_freq, n, hkv, d)
        if kv is None:
            K.attention_forward(rec, a["att"], a["lse"], a["q"], a["k"], a["v"], acts.segments, b, t, hq, hkv, d,
                                cfg.window(i))
        else:
            K.kv_cache_write(rec, kv["k"][i], kv["v"][i], a["k"], a["v"], acts.segments, acts.positions, n,
                             kv["batch"], kv["max_len"], hkv, d)
            K.attention_cached_forward(rec, a["att"], a["q"], kv["k"][i], kv["v"][i], acts.segments, acts.positions,
                                       n, kv["batch"], kv["max_len"], hq, hkv, d, cfg.window(i))
        K.copy(rec, a["x_mid"], a["x_in"], n * c)
        self._linear(rec, a["x_mid"], a["att"], i, "o_proj", acts, a, accumulate=True)
        rec.section(self._where + " norm")
        K.rmsnorm_forward(rec, a["h2"], a["rstd2"], a["x_mid"], self.w[p + "post_attention_layernorm.weight"], n, c, eps)
        self._linear(rec, a["gate"], a["h2"], i, "gate_proj", acts, a)
        self._linear(rec, a["up"], a["h2"], i, "up_proj", acts, a)
        rec.section(self._where + " swiglu")
        K.swiglu_forward(rec, a["m"], a["gate"], a["up"], n * cfg.intermediate_size)
        if recompute:
            lora = self.lora.get(module_path(i, "down_proj"))
            if lora is not None:
                rec.section(self._where + " gemm")
                lora_a_forward(rec, a["lora_h.down_proj"], self._lora_input(rec, a["m"], lora, "down_proj", a, n),
                               lora.a, n, lora.in_f, lora.r)
            return
        x_next = acts.layers[i + 1]["x_in"] if i + 1 < len(acts.layers) else acts.x_final
        K.copy(rec, x_next, a["x_mid"], n * c)
        self._linear(rec, x_next, a["m"], i, "down_proj", acts, a, accumulate=True)

    def _record_head(self, rec, acts: Activations, backward: bool):
        """lm_head and cross-entropy over the loss head's acts.n_head rows (the trained ones, _upload_batch),
        by chunks of acts.head_rows rows of logits: loss, lse and valid per head row (targets are in head
        row order too). With backward, dlogits, then dxf (zero on the rows the head skipped) and dW_head."""
        cfg = self.cfg
        head, v, c, n, m = self._head(), cfg.vocab_size, cfg.hidden_size, acts.n, acts.n_head
        rec.section("loss head (lm_head, cross-entropy)")
        x, dx = acts.xf, acts.dxf if backward else None
        compact = acts.head_index is not None
        if compact:
            # the gathered rows and their gradient live in buffers idle here: x_final when forward only
            # (read by the final norm, before), else d_res and d_tmp (the final norm's backward and the
            # layers' backward write them, after)
            x, dx = (acts.d_res, acts.d_tmp) if backward else (acts.x_final, None)
            K.row_gather_forward(rec, x, acts.xf, acts.head_index, m, c, n)
        dhead = self.grads.get("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight") \
            if self.full else None
        for r0 in range(0, m, acts.head_rows):
            rows = min(acts.head_rows, m - r0)
            linear_forward(rec, acts.logits, at(x, r0 * c), head, None, rows)
            K.cross_entropy_forward(rec, acts.loss_rows, acts.lse_rows, acts.valid_rows, acts.logits, acts.targets,
                                    rows, v, r0)
            if backward:
                K.cross_entropy_backward(rec, acts.logits, acts.logits, acts.targets, acts.lse_rows, self.step_buf,
                                         rows, v, r0)
                linear_backward(rec, at(dx, r0 * c), dhead, None, acts.logits, at(x, r0 * c), head, rows)
        if backward and compact:
            K.row_gather_backward(rec, acts.dxf, dx, acts.head_index, m, c, n)

    # ---- backward -----------------------------------------------------------------------------
    def _linear_backward(self, rec, dx, dy, layer, module, acts, a, x, accumulate_dx):
        """dx (+)= gradient through one module (base and LoRA); weight gradients accumulate."""
        path = module_path(layer, module)
        w = self.w[path + ".weight"]
        n = acts.n
        rec.section(f"layer {layer} backward gemm")
        dw = self.grads.get(path + ".weight") if self.full else None
        db = self.grads.get(path + ".bias") if self.full else None
        linear_backward(rec, dx, dw, db, dy, x, w, n, accumulate_dx)
        lora = self.lora.get(path)
        if lora is None:
            return
        group = self._group_of.get(module)
        if group is not None:    # the group's LoRA backward runs once every member's dy is there
            self._pending[module] = dy
            if len(self._pending) == len(group):
                mods = [self.lora[module_path(layer, m)] for m in group]
                lora_group_backward(rec, dx, mods[0].ga, [m.gb for m in mods], [self._pending.pop(m) for m in group],
                                    x, a["lora_h." + "+".join(group)], mods[0].a, [m.b for m in mods],
                                    [m.scale for m in mods], n, lora.in_f, [m.out_f for m in mods],
                                    [m.r for m in mods], acts.d_lora_h, accumulate_grads=True)
            return
        h = a["lora_h." + module]
        if lora.dropout > 0:
            xl = a["lora_x." + module]
            K.fill(rec, acts.d_lora_x, 0.0, n * lora.in_f)
            lora_backward(rec, acts.d_lora_x, lora.ga, lora.gb, dy, xl, h, lora.a, lora.b, lora.scale, n, lora.in_f,
                          lora.out_f, lora.r, acts.d_lora_h, accumulate_grads=True)
            K.lora_dropout_backward(rec, dx, acts.d_lora_x, self.seeds, self._seed_slot(lora), lora.dropout, n * lora.in_f)
        else:
            lora_backward(rec, dx, lora.ga, lora.gb, dy, x, h, lora.a, lora.b, lora.scale, n, lora.in_f, lora.out_f,
                          lora.r, acts.d_lora_h, accumulate_grads=True)

    def _norm_grad(self, name):
        return self.grads.get(name) if self.full else None

    def _record_backward(self, rec, acts: Activations):
        cfg = self.cfg
        b, t, n = acts.b, acts.t, acts.n
        c, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self._record_head(rec, acts, backward=True)
        rec.section("final norm backward")
        K.rmsnorm_backward(rec, acts.d_res, self._norm_grad("model.norm.weight"), acts.dxf, acts.x_final,
                           self.w["model.norm.weight"], acts.rstd_f, n, c, acts.scratch_norm, accumulate=True)
        for i in reversed(range(cfg.num_hidden_layers)):
            rec.split_point()
            p = f"model.layers.{i}."
            a = acts.layers[i]
            # checkpointed: the forward left the last layer's activations in the shared buffers; the
            # others are recomputed (self._training and the micro-batch's seed slot still hold)
            if acts.checkpoint and i < cfg.num_hidden_layers - 1:
                self._record_layer_forward(rec, acts, i, recompute=True)
            self._linear_backward(rec, acts.d_m, acts.d_res, i, "down_proj", acts, a, a["m"], False)
            rec.section(f"layer {i} backward swiglu")
            K.swiglu_backward(rec, acts.d_gate, acts.d_up, acts.d_m, a["gate"], a["up"], n * f)
            self._linear_backward(rec, acts.d_h, acts.d_gate, i, "gate_proj", acts, a, a["h2"], False)
            self._linear_backward(rec, acts.d_h, acts.d_up, i, "up_proj", acts, a, a["h2"], True)
            rec.section(f"layer {i} backward norm")
            K.rmsnorm_backward(rec, acts.d_tmp, self._norm_grad(p + "post_attention_layernorm.weight"), acts.d_h,
                               a["x_mid"], self.w[p + "post_attention_layernorm.weight"], a["rstd2"], n, c,
                               acts.scratch_norm, accumulate=True)
            K.add_inplace(rec, acts.d_res, acts.d_tmp, n * c)
            self._linear_backward(rec, acts.d_att, acts.d_res, i, "o_proj", acts, a, a["att"], False)
            rec.section(f"layer {i} backward attention")
            K.attention_backward(rec, acts.dq, acts.dk, acts.dv, acts.d_att, a["q"], a["k"], a["v"], a["att"], a["lse"],
                                 acts.segments, b, t, hq, hkv, d, acts.scratch_att, cfg.window(i))
            K.rope_backward(rec, acts.dq, acts.dq, acts.positions, self.inv_freq, n, hq, d)
            K.rope_backward(rec, acts.dk, acts.dk, acts.positions, self.inv_freq, n, hkv, d)
            dq, dk = acts.dq, acts.dk
            if cfg.qk_norm:
                K.rmsnorm_backward(rec, acts.dq2, self._norm_grad(p + "self_attn.q_norm.weight"), acts.dq, a["q_pre"],
                                   self.w[p + "self_attn.q_norm.weight"], a["rstd_q"], n * hq, d, acts.scratch_norm,
                                   accumulate=True)
                K.rmsnorm_backward(rec, acts.dk2, self._norm_grad(p + "self_attn.k_norm.weight"), acts.dk, a["k_pre"],
                                   self.w[p + "self_attn.k_norm.weight"], a["rstd_k"], n * hkv, d, acts.scratch_norm,
                                   accumulate=True)
                dq, dk = acts.dq2, acts.dk2
            self._linear_backward(rec, acts.d_h, acts.dv, i, "v_proj", acts, a, a["h1"], False)
            self._linear_backward(rec, acts.d_h, dk, i, "k_proj", acts, a, a["h1"], True)
            self._linear_backward(rec, acts.d_h, dq, i, "q_proj", acts, a, a["h1"], True)
            rec.section(f"layer {i} backward norm")
            K.rmsnorm_backward(rec, acts.d_tmp, self._norm_grad(p + "input_layernorm.weight"), acts.d_h, a["x_in"],
                               self.w[p + "input_layernorm.weight"], a["rstd1"], n, c, acts.scratch_norm, accumulate=True)
            K.add_inplace(rec, acts.d_res, acts.d_tmp, n * c)
        if self.full:
            rec.section("embedding backward")
            emb, g = self.w["model.embed_tokens.weight"], self.grads["model.embed_tokens.weight"]
            for (gbuf, r0, rows) in g.chunks:
                K.embedding_backward(rec, gbuf, acts.d_res, acts.ids, n, emb.cols, rows, acts.scratch_emb, r0,
                                     accumulate=True)

    # ---- the engine protocol ------------------------------------------------------------------
    _training = False
    _where = ""

    def _submit(self, rec):
        before = dict(self.rt.counters)
        rec.submit()
        self._count(before)

    def _count(self, before):
        for k in ("submits", "readbacks", "bytes_uploaded", "bytes_read"):
            self.counters[k] += self.rt.counters[k] - before[k]

    def _reserve_seed_slots(self, n_micro: int):
        """Room for the dropout seeds of n_micro micro-batches (before anything of the step is recorded)."""
        if self.seeds.size < n_micro * self.n_modules * F32:
            old, self.seeds = self.seeds, self.rt.buffer(n_micro * self.n_modules * F32, "dropout_seeds")
            self.rt.release(old)

    def _seed_slot(self, lora: GpuLora) -> int:
        return self._micro * self.n_modules + lora.module_id

    def _write_seeds(self, slot: int):
        """Dropout seeds of every module for micro-batch `slot`, as reference.model computes them."""
        self.dropout_calls += 1
        self._micro = slot
        if not any(m.dropout > 0 for m in self.lora.values()):
            return
        seeds = np.zeros(self.n_modules, np.uint32)
        base = ref_ops.pcg_hash(np.uint32(self.dropout_seed) ^ np.uint32(self.dropout_calls))
        for m in self.lora.values():
            seeds[m.module_id] = ref_ops.pcg_hash(base ^ np.uint32(m.module_id))
        self.rt.write(self.seeds, seeds, slot * self.n_modules * F32)

    def logits(self, ids, segment_ids, position_ids):
        b, t = ids.shape
        acts = self._activations(b, t, train=False)
        self._upload_batch(acts, ids, segment_ids, position_ids)
        before = dict(self.rt.counters)
        self._training = False
        rec = self.rt.recorder()
        self._record_forward(rec, acts)
        rec.submit()
        v, c = self.cfg.vocab_size, self.cfg.hidden_size
        out = np.empty((acts.n, v), np.float32)
        for r0 in range(0, acts.n, acts.head_rows):
            rows = min(acts.head_rows, acts.n - r0)
            rec = self.rt.recorder()
            linear_forward(rec, acts.logits, at(acts.xf, r0 * c), self._head(), None, rows)
            rec.submit()
            out[r0:r0 + rows] = self.rt.read(acts.logits, np.float32, (rows, v))
        self._count(before)
        return out.reshape(b, t, v)

    def loss(self, ids, targets, segment_ids, position_ids):
        b, t = ids.shape
        acts = self._activations(b, t, train=False)
        self._upload_batch(acts, ids, segment_ids, position_ids, targets)
        before = dict(self.rt.counters)
        self._training = False
        rec = self.rt.recorder()
        self._record_forward(rec, acts)
        self._record_head(rec, acts, backward=False)
        K.cross_entropy_reduce(rec, self.results, acts.loss_rows, acts.valid_rows, acts.n_head)
        rec.read_back(self.results, np.float32, (2,))
        rec.submit()
        loss_sum, count = rec.result()
        self._count(before)
        return float(loss_sum), int(round(count))

    def forward_backward(self, ids, targets, segment_ids, position_ids, grad_scale):
        """Forward, loss and backward of one micro-batch (gradients accumulate); returns (loss_sum, count)."""
        b, t = ids.shape
        acts = self._activations(b, t, train=True)
        self._upload_batch(acts, ids, segment_ids, position_ids, targets)
        self.rt.write(self.step_buf, np.array([grad_scale], np.float32))
        self._write_seeds(0)
        before = dict(self.rt.counters)
        rec = self.rt.recorder()
        self._training = True
        self._record_forward(rec, acts)
        self._record_backward(rec, acts)
        self._training = False
        K.cross_entropy_reduce(rec, self.results, acts.loss_rows, acts.valid_rows, acts.n_head)
        rec.read_back(self.results, np.float32, (2,))
        rec.submit()
        loss_sum, count = rec.result()
        self._count(before)
        return float(loss_sum), int(round(count))

    def train_step(self, micro_batches, hp, step: int, profile: bool = False):
        """One optimizer step over micro-batches [(ids, targets, segment_ids, position_ids), ...] in one submit.

        The only readback is [loss_sum, count] per micro-batch and the gradient norm with its
        finite flag. Returns (loss_sum, token_count, grad_norm, applied). With profile=True,
        `last_profile` holds GPU seconds per op group (timestamp queries), or the wall-clock time of
        the submission where the adapter has no timestamp queries; profile="total" gives the GPU's
        busy time as one figure. `last_timing` holds the Python recording time and the step's wall time.
        """
        started = time.perf_counter()
        total = sum(int((tg != ref_ops.IGNORE_INDEX).sum()) for _, tg, _, _ in micro_batches)
        rt = self.rt
        before = dict(rt.counters)
        n_micro = len(micro_batches)
        if self.results.size < (2 * n_micro + 3) * F32:
            self.results = rt.buffer((2 * n_micro + 3) * F32, "results")
        rt.write(self.step_buf, np.array([1.0 / max(total, 1)], np.float32))
        self._reserve_seed_slots(n_micro)
        rec = rt.recorder(profile=profile, max_dispatches=self._dispatch_budget)
        self._record_zero_grads(rec)
        self._training = True
        used = []
        for j, (ids, targets, seg, pos) in enumerate(micro_batches):
            # every micro-batch has its own input slot: queue writes all land before the submission runs
            b, t = ids.shape
            acts = self._activations(b, t, train=True, keep=used)
            used.append(acts.key)
            self._upload_batch(acts, ids, seg, pos, targets, slot=j)
            self._write_seeds(j)
            self._record_forward(rec, acts)
            self._record_backward(rec, acts)
            K.cross_entropy_reduce(rec, (self.results, 2 * j), acts.loss_rows, acts.valid_rows, acts.n_head)
        self._training = False
        norm_at = (self.results, 2 * n_micro)
        self._record_optimizer(rec, hp, step, norm_at)
        rec.read_back(self.results, np.float32, (2 * n_micro + 3,))
        submitted = time.perf_counter()
        rec.submit()
        out = rec.result()
        done = time.perf_counter()
        self.last_timing = {"record_s": submitted - started, "wall_s": done - started}
        self._plan_submissions(rec, done - submitted)
        if profile:
            self.last_profile = rec.timings() or {"whole step (wall clock: no timestamp-query)": done - submitted}
        self._count(before)
        loss_sum = float(out[0:2 * n_micro:2].sum())
        norm, finite = float(out[2 * n_micro]), out[2 * n_micro + 2] > 0.5
        if not finite:
            self.counters["nonfinite_skipped"] += 1
        self.last_step = {k: rt.counters[k] - before[k] for k in ("submits", "readbacks", "bytes_uploaded", "bytes_read")}
        return loss_sum, total, norm if finite else float("nan"), bool(finite)

    def _plan_submissions(self, rec, last_part_s: float):
        """Split the next steps into submissions of at most about max_submit_s of GPU work each (Windows resets a
        device whose command buffer runs for 2 s, macOS has a watchdog too), from the time the last submission
        of this step took to finish: the earlier ones ran while the rest was recorded, so only the last one's
        time is the GPU's alone."""
        part = rec.dispatches - rec.flushed_at
        if last_part_s > self.max_submit_s and part > 1:
            self._dispatch_budget = max(1, int(part * self.max_submit_s / last_part_s))
        elif self._dispatch_budget and last_part_s < 0.5 * self.max_submit_s:
            grown = 2 * self._dispatch_budget
            self._dispatch_budget = 0 if grown >= rec.dispatches else grown

    def _record_optimizer(self, rec, hp, step, norm_at):
        rec.section("optimizer (grad norm, AdamW)")
        slot = 0
        for (_, grad, _, _, n), slots in zip(self._groups, self._norm_slots):
            K.grad_norm_partial(rec, self.partials, slot, grad, n)
            slot += slots
        K.grad_norm_finalize(rec, norm_at, self.partials, slot, hp.max_grad_norm or 0.0)
        for param, grad, m, v, n in self._groups:
            K.adamw_update(rec, param, grad, m, v, n, hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, step,
                           scale_buf=norm_at)

    # ---- generation with a KV cache -----------------------------------------------------------
    def new_kv_cache(self, batch: int, max_len: int) -> dict:
        """A KV cache of `batch` rows (sequences) of up to max_len positions: per layer a key and a value
        buffer (batch, max_len, Hkv, D)."""
        cfg = self.cfg
        size = batch * max_len * cfg.kv_size * F32
        if size > self.rt.max_binding:
            raise DeviceError(f"a KV cache of {batch} x {max_len} positions needs {size / 2**20:.0f} MiB per layer, "
                              f"over the device's max storage binding of {self.rt.max_binding / 2**20:.0f} MiB: "
                              f"generate fewer sequences at once or fewer tokens")
        return {"k": [self.rt.buffer(size, "k_cache") for _ in range(cfg.num_hidden_layers)],
                "v": [self.rt.buffer(size, "v_cache") for _ in range(cfg.num_hidden_layers)],
                "len": 0, "batch": batch, "max_len": max_len}

    def free_kv_cache(self, kv: dict):
        """Free a KV cache's buffers now (and the cached bind groups that hold them)."""
        self.rt.release(*kv["k"], *kv["v"])
        kv["k"] = kv["v"] = []

    def forward_cached(self, ids, kv: dict) -> np.ndarray:
        """New tokens ids (B, Tq) of every row after the kv["len"] cached ones -> logits (B, V) of each row's last."""
        return forward_cached(self, ids, kv)

    def forward_rows(self, ids, rows, positions, kv: dict, last) -> np.ndarray:
        """n new tokens, each with its own cache row and position (reference.model.NumpyEngine.forward_rows):
        keys and values written first, then causal attention within each row; logits (m, V) of the tokens
        at indices last (m,). One submission and one readback while the m rows of logits fit the head's
        chunk. The tokens are padded to a power of two (padding has row -1, which writes nothing) so that
        calls of varying sizes (decoding steps as rows finish, prefills) share a few activation buckets."""
        ids, rows, positions, last = check_rows(ids, rows, positions, last, kv, self.cfg.vocab_size)
        n, m = ids.shape[0], last.shape[0]
        if n == 0:
            return np.zeros((m, self.cfg.vocab_size), np.float32)
        size = 1 << (n - 1).bit_length()
        pad = size - n
        before = dict(self.rt.counters)
        acts = self._activations(1, size, train=False)
        # the rows go where the segment ids go (which sequence each token belongs to), `last` where the targets go
        self._upload_batch(acts, np.pad(ids, (0, pad))[None], np.pad(rows, (0, pad), constant_values=-1)[None],
                           np.pad(positions, (0, pad))[None], last=np.pad(last, (0, size - m))[None])
        self._training = False
        rec = self.rt.recorder()
        self._record_forward(rec, acts, kv, m)
        v, c = self.cfg.vocab_size, self.cfg.hidden_size
        out = np.empty((m, v), np.float32)
        if m == 0:   # keys and values only
            rec.submit()
        for r0 in range(0, m, acts.head_rows):
            if r0:
                rec = self.rt.recorder()
            count = min(acts.head_rows, m - r0)
            linear_forward(rec, acts.logits, at(acts.x_final, r0 * c), self._head(), None, count)
            rec.submit()
            out[r0:r0 + count] = self.rt.read(acts.logits, np.float32, (count, v))
        self._count(before)
        return out
