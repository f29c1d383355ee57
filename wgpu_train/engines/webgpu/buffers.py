"""The WebGPU engine's device buffers: a LoRA module's tensors (GpuLora), a batch's inputs, a bucket's
activations; and the bucket cache (BucketCache, a part that WgpuEngine owns): one growing capacity bucket per
kind, freed least recently used, and the batches uploaded into them."""
from __future__ import annotations

import numpy as np

from wgpu_train.models.config import ModelConfig
from wgpu_train.errors import DeviceError
from wgpu_train.engines.webgpu.memory import (MOE_SCRATCH, SHARED_LAYER, activation_format, activation_plan,
                                              activation_ranks, bucket_tokens, check_fits, head_rows, layer_ranks)
from wgpu_train.engines.webgpu.moe import MoeLora, MoeScratch
from wgpu_train.models.weights import module_name
from wgpu_train.engines.protocol import Precision
from wgpu_train.engines.shared.boundary import unpack_boundary
from wgpu_train.models.layer_plan import INPUT
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.engines.webgpu.device.runtime import Runtime
from wgpu_train.engines.webgpu.tensors import F32


class GpuLora:
    """A LoRA pair on the GPU: views of A (r, in) and B (out, r) and of their gradients; with DoRA (webgpu/dora.py)
    views of the magnitude m (out,), its gradient gm, ||W||^2 wsq and 1 / ||W + s B A|| rn (None without)."""

    def __init__(self, path, a, b, ga, gb, shape_a, shape_b, scale, dropout, module_id):
        self.path, self.scale, self.dropout, self.module_id = path, float(scale), float(dropout), module_id
        self.a, self.b, self.ga, self.gb = a, b, ga, gb
        self.m = self.gm = self.wsq = self.rn = None
        self.r, self.in_f = shape_a
        self.out_f = shape_b[0]


class GpuExpertLora:
    """LoRA pairs on an MoE layer's expert tensor (one pair per expert): views of A (E, r, in) and B (E, out, r) and
    of their gradients; `pair` is what the moe ops take."""

    def __init__(self, path, a, b, ga, gb, shape_a, shape_b, scale):
        self.path, self.a, self.b, self.ga, self.gb, self.scale = path, a, b, ga, gb, float(scale)
        self.experts, self.rank, self.in_f = shape_a
        self.out_f = shape_b[1]
        self.pair = MoeLora(a, b, self.scale, self.rank)


def loss_head_size(m: int, n: int) -> int:
    """Rows the loss head computes for m trained rows out of n: m rounded up to a multiple of 8, or of
    1/8 of m's power of two beyond 64 (at most 1/8 more rows), capped at n. The sizes of the head's
    dispatches follow it, and their uniforms are cached by value: a run then meets a few dozen of them,
    where every trained-token count would each add its own."""
    if m <= 0:
        return 0
    unit = max(8, 1 << max(0, m.bit_length() - 4))
    return min(n, -(-m // unit) * unit)


INPUT_NAMES = ("ids", "segments", "positions", "targets", "head_index", "row_weights", "row_terms")
INPUT_WIDTHS = {"row_terms": 4}      # 4-byte values per token where not one


class Inputs:
    """The uploaded batch of one micro-batch slot, (B*T,) each: ids, segment ids, positions, targets (those of
    the loss head's rows, or generation's row indices) and head_index (the loss head's rows), all i32; and
    row_weights, f32, the per-token gradient weights of the loss head's rows when a step has them; row_terms
    (B*T, 4) f32, a TokenObjective's terms of the loss head's rows, from which its kernel writes row_weights."""

    def __init__(self, rt: Runtime, n: int):
        for name in INPUT_NAMES:
            setattr(self, name, rt.buffer(n * INPUT_WIDTHS.get(name, 1) * F32,
                                          "segment_ids" if name == "segments" else name))


class Activations:
    """Every buffer a bucket of `capacity` tokens needs for forward and backward, allocated once and reused by
    every batch of up to that many tokens: the kernels take each batch's sizes (use(b, t)), and each buffer
    holds its tensor for `capacity` rows.

    layers[i] maps a name to layer i's buffer, for each layer i of `layers` (a pipeline stage's range, or every
    layer of the model); without `head` (a stage before the last) the final norm's and loss head's buffers are
    left out. With checkpoint (gradient checkpointing, training only)
    only "x_in" is layer i's own: the other names map to one set of buffers shared by every layer, which
    the backward refills by recomputing each layer's forward. A forward-only bucket (train=False) has
    one set for all layers, x_in included (memory.activation_plan). In a 16-bit precision the activations and
    their gradients are 16-bit buffers (memory.activation_format; kernels see the format of each buffer)."""

    def __init__(self, rt: Runtime, cfg: ModelConfig, capacity: int, lora_ranks: dict, dropout_inputs: dict,
                 train: bool, checkpoint: bool = False, batch: tuple = (1, 0), dora_outputs: dict | None = None,
                 precision: Precision = Precision.FP32, layers: range | None = None, head: bool = True,
                 expert_rank: int = 0):
        self.capacity, self.train = capacity, train
        self.checkpoint = checkpoint and train
        self.head_rows = head_rows(cfg, capacity, rt.max_binding)    # logits rows per chunk of the loss head
        own, shared = activation_plan(cfg, 1, capacity, lora_ranks, dropout_inputs, train, self.checkpoint,
                                      rt.max_binding, dora_outputs, head, layers, expert_rank)
        for part in own.values():      # named after the batch that asked
            check_fits(cfg, batch[0], batch[1], rt.max_binding, part, shared)
        # set per use: the batch's shape, its Inputs, n_head (rows of the loss head, gathered by head_index)
        self.b = self.t = self.n = self.n_head = 0
        self.rope_long = False
        self.ids = self.segments = self.positions = self.targets = self.head_index = self.row_weights = None
        self.images = None      # the batch's images (images.BatchImages) or None
        self.rope_pairs = None  # (B*T, R/2) i32: each rotated pair's position (Qwen3-VL's M-RoPE), or None
        self.row_terms = self.objective = None     # a TokenObjective's terms buffer and the objective itself
        self.head_order = None     # (n_head,) the batch's row of each loss head row (None: every row, in order)
        self.entropies = False     # whether the loss head writes entropy_rows (a training step's objective)


        def allocate(name, e):
            fmt = activation_format(cfg, name, precision)
            return storage.set_format(rt.buffer(storage.nbytes(max(1, e), fmt), name), fmt)

        try:
            one_set = {name[len(SHARED_LAYER):]: allocate(name, e) for name, e in shared.items()
                       if name.startswith(SHARED_LAYER)}
            self.layers = {i: {**{name: allocate(name, e) for name, e in part.items()}, **one_set}
                           for i, part in own.items()}
            scratch = {name[len(MOE_SCRATCH):]: allocate(name, e) for name, e in shared.items()
                       if name.startswith(MOE_SCRATCH)}
            self.moe = MoeScratch.of(scratch, capacity, cfg.moe, cfg.hidden_size, expert_rank) if scratch else None
            for name, e in shared.items():
                if not name.startswith((SHARED_LAYER, MOE_SCRATCH)):
                    setattr(self, name, allocate(name, e))
        except DeviceError as e:
            hint = "" if self.checkpoint or not train else ", or pass --gradient-checkpointing"
            raise DeviceError(f"{e}, for the activations of batch {batch[0]} x {batch[1]} tokens: reduce the batch "
                              f"size or --max-seq-len{hint}") from None

    @property
    def key(self) -> tuple:
        return self.capacity, self.train, self.checkpoint

    def use(self, b: int, t: int):
        """Run the next recording with a batch of b rows of t tokens (b * t <= capacity); upload_batch then
        points the bucket at the batch's inputs and sets n_head."""
        self.b, self.t, self.n = b, t, b * t


class BucketCache:
    """The engine's activation buckets (`acts`: (capacity in tokens, train, checkpointed) -> Activations) and
    batch inputs (`inputs`: (bucket capacity, micro-batch slot) -> Inputs), a part that WgpuEngine owns. It sizes
    buckets for the LoRA modules and groups set_adapter gave it, and for the gradient checkpointing that
    set_checkpointing gave it; both release every bucket. Its buckets hold the activations of the layers of `span` (a
    pipeline stage's range, else every layer); a stage after the first (first False) takes the previous stage's
    activations as its input where the first takes token ids (upload_batch); a stage before the last (last
    False) has no loss head's buffers."""

    MAX_BUCKETS = 4             # training activation buckets kept allocated at once
    MAX_FORWARD_BUCKETS = 8     # forward-only ones (one set of layer buffers each): generation uses several

    def __init__(self, rt: Runtime, cfg: ModelConfig, precision: Precision, counters: dict, span: range | None = None,
                 first: bool = True, last: bool = True):
        self.rt, self.cfg, self.precision, self.counters = rt, cfg, precision, counters
        self.span = range(cfg.num_hidden_layers) if span is None else span
        self.first, self.last = first, last
        self.acts: dict = {}
        self.inputs: dict = {}
        self.lora: dict = {}          # path -> GpuLora
        self.groups: dict = {}        # module name -> the modules that run their LoRA as one
        self.expert_lora: dict = {}   # expert tensor path -> GpuExpertLora (their rank sizes the MoE scratch)
        self.checkpoint = False
        self.images = None            # the engine's images.ImageInputs (set_images), which upload_batch attaches

    def set_adapter(self, lora: dict, groups: dict, expert_lora: dict | None = None):
        """The LoRA modules (path -> GpuLora), groups and LoRA pairs on experts (path -> GpuExpertLora) the buckets
        hold buffers for; frees every bucket."""
        self.release()
        self.lora, self.groups, self.expert_lora = lora, groups, expert_lora or {}

    def set_checkpointing(self, on: bool):
        """Training buckets keep only each layer's input (gradient checkpointing) or every buffer; frees every
        bucket."""
        self.release()
        self.checkpoint = bool(on)

    # ---- buffers per bucket -------------------------------------------------------------------
    def activations(self, b, t, train=True, keep=()) -> Activations:
        """A bucket that holds b x t tokens, set to that shape: the smallest allocated one of its kind (training
        or not, checkpointed or not) that is big enough, else a new one of memory.bucket_tokens(b * t) tokens
        (the exact size when that one would not fit the device). Allocating one frees the smaller buckets of
        its kind and, beyond MAX_BUCKETS, the least recently used; never those in `keep` (keys of buckets
        already recorded into the open encoder)."""
        n, checkpoint = b * t, train and self.checkpoint
        fits = [k for k in self.acts if k[1:] == (train, checkpoint) and k[0] >= n]
        if fits:
            key = min(fits)
            acts = self.acts.pop(key)
        else:
            for old in [k for k in self.acts if k[1:] == (train, checkpoint) and k not in keep]:
                self.free_bucket(old)
            limit = self.MAX_BUCKETS if train else self.MAX_FORWARD_BUCKETS
            while sum(k[1] == train for k in self.acts) >= limit:
                old = next((k for k in self.acts if k[1] == train and k not in keep), None)
                if old is None:
                    break
                self.free_bucket(old)
            ranks = activation_ranks(layer_ranks({p: m.r for p, m in self.lora.items()}), self.groups)
            drop = {module_name(p): m.in_f for p, m in self.lora.items() if m.dropout > 0 and train}
            dora = {module_name(p): m.out_f for p, m in self.lora.items() if m.m is not None}
            moe_rank = max([m.rank for m in self.expert_lora.values()] + [0])
            try:
                acts = Activations(self.rt, self.cfg, bucket_tokens(n), ranks, drop, train, checkpoint, (b, t), dora,
                                   self.precision, self.span, self.last, moe_rank)
            except DeviceError:     # the rounded-up bucket does not fit: one of the batch's own size
                acts = Activations(self.rt, self.cfg, n, ranks, drop, train, checkpoint, (b, t), dora,
                                   self.precision, self.span, self.last, moe_rank)
            self.counters["buckets_allocated"] += 1
        self.acts[acts.key] = acts          # most recently used last
        acts.use(b, t)
        return acts

    def free_bucket(self, key):
        """Free one bucket, and its batch inputs when no other bucket of its capacity remains."""
        self._free(self.acts.pop(key))
        if not any(k[0] == key[0] for k in self.acts):
            for stale in [k for k in self.inputs if k[0] == key[0]]:
                self.rt.release(*vars(self.inputs.pop(stale)).values())

    def _free(self, acts: Activations):
        # buffers shared by all layers (forward-only and checkpointed buckets) are released once
        bufs = list({id(b): b for layer in acts.layers.values() for b in layer.values()}.values())
        bufs += [v for k, v in vars(acts).items()    # (not the inputs, nor rope_pairs, which images.py owns)
                 if hasattr(v, "destroy") and k not in (*INPUT_NAMES, "rope_pairs")]
        bufs += acts.moe.buffers() if acts.moe is not None else []
        self.rt.release(*bufs)

    def release(self):
        """Free every bucket and batch input."""
        for acts in self.acts.values():
            self._free(acts)
        self.rt.release(*[b for inp in self.inputs.values() for b in vars(inp).values()])
        self.acts.clear()
        self.inputs.clear()

    def write_activations(self, buf, values):
        """Write float32 values (N, C) into an activation buffer, in its storage format (exact for values a
        stage stored in that format)."""
        self.rt.write(buf, storage.to_words(values, storage.format_of(buf)))

    def read_activations(self, buf, n: int) -> np.ndarray:
        """The first n rows (n, C) of an activation buffer as float32 values."""
        c = self.cfg.hidden_size
        return storage.read(self.rt, buf, n * c).reshape(n, c)

    def upload_row_weights(self, acts, weights, slot=0):
        """Write a micro-batch's per-token gradient weights (B, T) in the loss head's row order to its slot's
        row_weights, after upload_batch set acts' rows (acts.row_weights set)."""
        w = np.asarray(weights, np.float32).reshape(-1)                # (B*T,)
        acts.row_weights = self.inputs[(acts.capacity, slot)].row_weights
        self.rt.write(acts.row_weights, w if acts.head_order is None else w[acts.head_order])

    def upload_batch(self, acts, ids, segment_ids, position_ids, targets=None, slot=0, last=None, weights=None,
                     objective=None):
        """Write one micro-batch into the input buffers of its slot and point acts at them: ids (B, T), or on a
        stage after the first (first False) the previous stage's packed activations (engines/shared/boundary.py,
        (B*T, C)), which go into its first layer's input instead.

        targets (B, T) (training, evaluation): only the rows with a target (not IGNORE_INDEX) go through
        the loss head. Their indices, padded with untrained rows to loss_head_size, go to head_index and
        their targets, in that order, to targets; acts.n_head counts them and acts.head_order holds those
        indices. When that is every row, the targets go as they are and head_index is unused
        (acts.head_index and acts.head_order None). weights (B, T) float32 (optional, training): each
        token's gradient weight, written in the loss head's row order to row_weights (acts.row_weights
        None without). objective (a TokenObjective, training, instead of weights): its terms written in the loss
        head's row order to row_terms, and row_weights left for the loss head's token_objective_backward to
        write (acts.objective set). last (generation, forward_rows): row indices, written to targets as they
        are."""
        rt = self.rt
        b, t = segment_ids.shape
        n = b * t
        inp = self.inputs.get((acts.capacity, slot))
        if inp is None:
            inp = self.inputs[(acts.capacity, slot)] = Inputs(rt, acts.capacity)
        acts.ids, acts.segments, acts.positions, acts.targets = inp.ids, inp.segments, inp.positions, inp.targets
        if self.first:
            rt.write(acts.ids, ids.astype(np.int32).reshape(-1))
        else:
            self.write_activations(acts.layers[self.span.start][INPUT], unpack_boundary(ids))
        rt.write(acts.segments, segment_ids.astype(np.int32).reshape(-1))
        rt.write(acts.positions, position_ids.astype(np.int32).reshape(-1))
        acts.rope_long = self.cfg.rope_long(int(position_ids.max(initial=0)))    # longrope's set for this batch
        acts.images = None
        if self.images is not None:     # (a stage after the first: the blocks, M-RoPE positions and DeepStack's)
            self.images.attach(acts, slot, ids if self.first else None, segment_ids, position_ids,
                               acts.layers[self.span.start][INPUT] if acts.layers else acts.x_final, last is not None,
                               self.span)
        acts.head_index, acts.head_order, acts.n_head, acts.row_weights = None, None, n, None
        acts.row_terms = acts.objective = None
        acts.entropies = False
        if last is not None:
            rt.write(acts.targets, last.astype(np.int32).reshape(-1))
        if targets is None:
            return
        tg = targets.astype(np.int32).reshape(-1)                    # (B*T,)
        trained = tg != IGNORE_INDEX
        m = loss_head_size(int(trained.sum()), n)
        rows = None
        if m < n:
            # padding rows are untrained ones (ignored targets: no loss, zero gradient), so indices stay distinct
            rows = np.concatenate([np.flatnonzero(trained), np.flatnonzero(~trained)])[:m].astype(np.int32)  # (m,)
            acts.head_index, acts.head_order, acts.n_head = inp.head_index, rows, m
            rt.write(acts.head_index, rows)
        rt.write(acts.targets, tg if rows is None else tg[rows])
        if weights is not None:
            self.upload_row_weights(acts, weights, slot)
        if objective is not None:
            terms = objective.terms()                                  # (B*T, 4)
            acts.row_weights, acts.row_terms, acts.objective = inp.row_weights, inp.row_terms, objective
            rt.write(acts.row_terms, terms if rows is None else terms[rows])
