"""Recording a decoder layer's forward and backward, the embedding and the loss head into a command encoder
(LayerRecorder, a part that WgpuEngine owns). (Over 450 lines on purpose: one short method per op kind and
direction, which the layer plan's walk finds by name; the mixture of experts' kinds brought it past 450.)"""
from __future__ import annotations

from wgpu_train.adapters.saved_modules import EMBED, HEAD
from wgpu_train.models.config import EXPERT_PARAMETERS, ModelConfig
from wgpu_train.models.weights import module_path
from wgpu_train.models.layer_plan import INPUT, OUTPUT, LayerPlan, layer_plans
from wgpu_train.engines.shared.moe import ClampedSwiGLU
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu import attention as A
from wgpu_train.engines.webgpu.tuned import quant
from wgpu_train.engines.webgpu.lora import lora_a_forward, lora_backward, lora_group_backward, linear_lora_forward
from wgpu_train.engines.webgpu.mixed_lora import mixed_lora_forward
from wgpu_train.engines.webgpu.tuned.quant import QuantMatrix
from wgpu_train.engines.webgpu.device.operands import at
from wgpu_train.engines.webgpu.buffers import Activations, GpuLora
from wgpu_train.engines.webgpu.conv_layers import ConvLayerOps
from wgpu_train.engines.webgpu.dora import DoraNorms, dora_linear_backward, dora_linear_forward
from wgpu_train.engines.webgpu.moe import (load_balancing_counts, load_balancing_dprobs, load_balancing_loss,
                                           moe_experts_backward, moe_experts_forward, moe_route_backward,
                                           moe_route_forward)
from wgpu_train.engines.webgpu.dropout_seeds import DropoutSeeds
from wgpu_train.engines.webgpu.gated_deltanet_layers import GatedDeltaNetOps
from wgpu_train.engines.webgpu.tensors import Matrix, linear_backward, linear_forward


class LayerRecorder(ConvLayerOps, GatedDeltaNetOps):
    """Records the layer plan's walk into a command encoder. It reads the engine's base weights `w` (name ->
    Matrix, QuantMatrix or buffer, a dict the engine keeps) and RoPE's frequencies, and what the engine sets
    on it: the LoRA modules and groups (set_adapter), the trained tensors' gradients (set_grads), and its mode:
    `adapter_enabled`, `loss_temperature` and `training` (LoRA dropout on).

    It records the layers of `span` (a pipeline stage's range, else every layer): with the embedding in front
    where `first`, the final norm and loss head after where `last`. A stage after the first finds its input in
    its first layer's input buffer; a stage before the last leaves its output in x_final, and its backward
    starts from the output's gradient in the residual stream's gradient buffer (d_res), where it leaves its
    input's."""

    def __init__(self, cfg: ModelConfig, plans: list, w: dict, inv_freqs: list, dora: DoraNorms,
                 dropout: DropoutSeeds, step_buf, counters: dict, span: range | None = None, first: bool = True,
                 last: bool = True):
        """plans: every layer's plan, by layer (models/layer_plan.layer_plans); inv_freqs [long][layer]: RoPE's
        frequency buffers; step_buf: the step's scalars (grad_scale first), which the cross-entropy backward
        reads; counters: the engine's, whose loss heads this counts."""
        self.cfg, self.plans, self.w, self.inv_freqs = cfg, list(plans), w, inv_freqs
        self.span = range(cfg.num_hidden_layers) if span is None else span
        self.first, self.last = first, last
        self.dora, self.dropout, self.step_buf, self.counters = dora, dropout, step_buf, counters
        self.lora: dict = {}          # path -> GpuLora
        self.groups: dict = {}        # module name -> the modules that run their LoRA as one
        self.expert_lora: dict = {}   # expert tensor path -> GpuExpertLora
        self.grads: dict = {}         # trained name -> its gradient tensor
        self.adapter_enabled = True   # False: forwards skip every LoRA module (a preference objective's reference)
        self.loss_temperature = 1.0
        self.training = False
        self.router_aux_weight = 0.0  # the weight of the router's load-balancing loss on a training step's gradient
        self._recomputing = False     # recording a checkpointed layer's forward again, inside the backward
        self.adapter_bank: dict = {}  # module path -> GpuBankModule (KvCacheGeneration.set_adapter_bank)
        self.image_grad_source = None  # the images.BatchImages whose gradient the last backward gathered
        self.bank_rows = None         # a buffer of each token's adapter (i32) while forward_rows records with them
        self._pending: dict = {}      # member -> dy of a group whose LoRA backward waits for the others
        self._where = ""

    @property
    def plan(self) -> LayerPlan:
        """The first layer's plan (every layer's in a model without layer kinds); set: every layer walks the
        plan given (a variant a test compares the engines on)."""
        return self.plans[0]

    @plan.setter
    def plan(self, plan: LayerPlan):
        self.plans = [plan] * len(self.plans)

    @staticmethod
    def unrecorded_kinds(cfg: ModelConfig) -> list[str]:
        """The op kinds of cfg's layer plans that no method here records (the engine refuses such a model)."""
        kinds = {op.kind for plan in layer_plans(cfg) for op in plan.ops}
        return sorted(k for k in kinds if not hasattr(LayerRecorder, "_forward_" + k))

    def set_adapter(self, lora: dict, groups: dict, expert_lora: dict | None = None):
        """The LoRA modules (path -> GpuLora), their groups (module name -> members) and the LoRA pairs on MoE
        experts (path -> GpuExpertLora) to record."""
        self.lora, self.groups, self.expert_lora = lora, groups, expert_lora or {}

    def set_grads(self, grads: dict):
        """The gradients (name -> tensor) of the trained tensors: those of base weights are written here."""
        self.grads = grads

    def head_name(self) -> str:
        """The head's weight: lm_head's, or a tied model's embedding unless set_trained_base untied them."""
        return HEAD if HEAD in self.w else EMBED

    def head(self) -> Matrix:
        return self.w[self.head_name()]

    # ---- forward ------------------------------------------------------------------------------
    def embed(self, rec, out, ids, n):
        """out (n, C) = the embedding rows of ids, times the model's embed_scale (Gemma)."""
        emb = self.w["model.embed_tokens.weight"]
        if isinstance(emb, QuantMatrix):
            quant.embedding_forward(rec, out, ids, emb, n)
        else:
            for buf, r0, rows in emb.chunks:
                K.embedding_forward(rec, out, ids, buf, n, emb.cols, rows, r0)
        if self.cfg.embed_scale != 1.0:
            K.scale(rec, out, out, self.cfg.embed_scale, n * self.cfg.hidden_size)

    def _linear(self, rec, y, x, layer, module, acts, a, accumulate=False):
        """Base linear (+ LoRA, with dropout on its input while training) of one module. With LoRA, h = x A^T
        comes first, so that the base GEMM can add the B term in the same dispatch (linear_lora_forward)."""
        path = module_path(layer, module)
        w, bias = self.w[path + ".weight"], self.w.get(path + ".bias")
        rec.section(self._where + " gemm")
        lora = self.lora.get(path) if self.adapter_enabled else None
        if lora is None:
            linear_forward(rec, y, x, w, bias, acts.n, accumulate)
            if self.bank_rows is not None and path in self.adapter_bank:     # a server's rows of mixed adapters
                mixed_lora_forward(rec, y, x, self.adapter_bank[path], self.bank_rows, acts.n)
            return
        if lora.m is not None:
            self._dora_linear(rec, y, x, lora, module, acts, a, accumulate)
            return
        h, ldh = self._lora_h(rec, x, layer, module, acts, a)
        linear_lora_forward(rec, y, x, w, bias, acts.n, h, ldh, lora.b, lora.scale, lora.r, accumulate)

    def _lora_h(self, rec, x, layer, module, acts, a):
        """h = x A^T (N, r) of the module's LoRA, its dropout mask applied to x while training, saved in the
        layer's lora_h buffer; returns (h, its row stride). A group's first module computes h of all of
        them in one GEMM (its columns side by side); each member gets its own columns."""
        lora, n = self.lora[module_path(layer, module)], acts.n
        group = self.groups.get(module)
        if group is None:
            xl = self._lora_input(rec, x, lora, module, a, n)
            lora_a_forward(rec, a["lora_h." + module], xl, lora.a, n, lora.in_f, lora.r)
            return a["lora_h." + module], lora.r
        mods = [self.lora[module_path(layer, m)] for m in group]
        h, ldh = a["lora_h." + "+".join(group)], sum(m.r for m in mods)
        if module == group[0]:
            lora_a_forward(rec, h, x, lora.a, n, lora.in_f, ldh)
        return at(h, sum(m.r for m in mods[:group.index(module)])), ldh

    def _lora_input(self, rec, x, lora: GpuLora, module, a, n):
        """The LoRA module's input: x, or while training with dropout x times the micro-batch's mask
        (saved in the layer's lora_x buffer; the mask is a hash of the seed slot, so recomputing it repeats it)."""
        if lora.dropout > 0 and self.training:
            xl = a["lora_x." + module]
            K.lora_dropout_forward(rec, xl, x, self.dropout.buffer, self.dropout.slot_of(lora.module_id), lora.dropout,
                                   n * lora.in_f)
            return xl
        return x

    def _dora_linear(self, rec, y, x, lora: GpuLora, module, acts, a, accumulate=False, recompute=False):
        """A DoRA module's forward (dora.dora_linear_forward), h and z saved in the layer's buffers."""
        xl = self._lora_input(rec, x, lora, module, a, acts.n)
        dora_linear_forward(rec, y, a["lora_h." + module], a["dora_z." + module], x, xl, lora,
                            self.w[lora.path + ".weight"], self.w.get(lora.path + ".bias"), acts.n, accumulate,
                            recompute)

    def record_forward(self, rec, acts: Activations, kv: dict | None = None, n_last: int = 0):
        """The embedding (first), the layers and the final norm (last). With a KV cache `kv` (generation,
        forward_rows), acts.segments holds each token's cache row: keys and values are written into the cache,
        attention reads it, and only the n_last tokens whose indices acts.targets holds are normed, into
        x_final's first rows."""
        n, c, eps, offset = acts.n, self.cfg.hidden_size, self.cfg.rms_norm_eps, self.cfg.norm_offset
        if self.dora.stale:
            self.dora.record_norms(rec)
        if self.first:
            self._where = "embedding forward"
            rec.section(self._where)
            x_in = acts.layers[self.span.start][INPUT] if acts.layers else acts.x_final
            self.embed(rec, x_in, acts.ids, n)
            if acts.images is not None:     # the projector's embeddings in place of the placeholders'
                K.row_gather_backward(rec, x_in, acts.images.embeds, acts.images.index, acts.images.count, c, n,
                                      keep=True)
        for i in self.span:
            rec.split_point()
            self.record_layer_forward(rec, acts, i, kv)
            im = acts.images
            if im is not None and i < len(im.deepstack):    # Qwen3-VL's DeepStack features at the image tokens
                K.row_gather_backward(rec, self._output(acts, i), im.deepstack[i], im.index, im.count, c, n,
                                      accumulate=True)
        if not self.last:
            return
        rec.section("final norm forward")
        if kv is None:
            K.rmsnorm_forward(rec, acts.xf, acts.rstd_f, acts.x_final, self.w["model.norm.weight"], n, c, eps, offset)
        else:   # gather the wanted rows into xf, then norm them back into x_final, whose rows are all read by then
            K.embedding_forward(rec, acts.xf, acts.targets, acts.x_final, n_last, c, n)
            K.rmsnorm_forward(rec, acts.x_final, acts.rstd_f, acts.xf, self.w["model.norm.weight"], n_last, c, eps,
                              offset)

    def record_layer_forward(self, rec, acts: Activations, i: int, kv: dict | None = None, recompute=False):
        """Layer i's forward (the plan's ops in order) from its input, writing the next layer's input
        (x_final after the last). recompute=True (gradient checkpointing, in the backward) refills the layer's
        buffers for its backward and leaves the next layer's input alone: of the op that writes it only the
        LoRA input and h are recomputed, since its backward needs its input (and those) but not its output."""
        a = acts.layers[i]
        buf = {**a, OUTPUT: self._output(acts, i)}
        self._where = f"layer {i} {'recompute' if recompute else 'forward'}"
        self._recomputing = recompute
        for op in self.plans[i].ops:
            if recompute and OUTPUT in op.outputs:
                lora = self.lora.get(module_path(i, op.param)) if op.kind == "linear" else None
                if lora is not None:
                    rec.section(self._where + " gemm")
                    if lora.m is not None:     # DoRA's backward reads z too
                        self._dora_linear(rec, None, buf[op.inputs[0]], lora, op.param, acts, a, recompute=True)
                    else:
                        self._lora_h(rec, buf[op.inputs[0]], i, op.param, acts, a)
                continue
            getattr(self, "_forward_" + op.kind)(rec, op, i, acts, buf, kv)

    @staticmethod
    def _output(acts, i: int):
        """Layer i's output buffer: the next layer's input, or x_final after the last."""
        return acts.layers[i + 1][INPUT] if i + 1 in acts.layers else acts.x_final

    def _rows(self, op, acts) -> tuple:
        """(rows, width) of an op over token rows or, per head, over head rows of head_dim."""
        if op.heads:
            return acts.n * self.plan.head_count(self.cfg, op), self.cfg.head_dim
        return acts.n, self.cfg.hidden_size

    def _forward_rmsnorm(self, rec, op, i, acts, buf, kv):
        rec.section(self._where + (" attention" if op.heads else " norm"))
        rows, width = self._rows(op, acts)
        K.rmsnorm_forward(rec, buf[op.outputs[0]], buf[op.outputs[1]], buf[op.inputs[0]],
                          self.w[f"model.layers.{i}.{op.param}"], rows, width, self.cfg.rms_norm_eps,
                          self.cfg.norm_offset)

    def _forward_linear(self, rec, op, i, acts, buf, kv):
        y = buf[op.outputs[0]]
        if op.residual:
            K.copy(rec, y, buf[op.residual], acts.n * self.plans[i].widths[op.residual])
        self._linear(rec, y, buf[op.inputs[0]], i, op.param, acts, buf, accumulate=bool(op.residual))

    def _forward_rope(self, rec, op, i, acts, buf, kv):
        rec.section(self._where + " attention")
        K.rope_forward(rec, buf[op.outputs[0]], buf[op.inputs[0]], *self._rope_args(op, i, acts))

    def _rope_args(self, op, i, acts) -> tuple:
        """RoPE's operands after its tensors: the positions (each pair's where the images give them, Qwen3-VL's),
        frequencies, sizes, scale, rotary dims and whether the positions are per pair."""
        pairs = acts.rope_pairs
        return (acts.positions if pairs is None else pairs, self.inv_freqs[acts.rope_long][i], acts.n,
                self.plan.head_count(self.cfg, op), self.cfg.head_dim, self.cfg.rope_scale, self.cfg.rotary_dim,
                pairs is not None)

    def _forward_attention(self, rec, op, i, acts, buf, kv):
        cfg = self.cfg
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        (q, k, v), (att, lse) = (buf[x] for x in op.inputs), (buf[x] for x in op.outputs)
        rec.section(self._where + " attention")
        sinks = self.w[f"model.layers.{i}.{op.param}"] if op.param else None    # gpt-oss's
        if kv is None:
            A.attention_forward(rec, att, lse, q, k, v, self._segments(acts), acts.b, acts.t, hq, hkv, d,
                                cfg.window(i), cfg.attn_softcap, sinks, blocks=acts.images is not None)
        else:   # generation: acts.segments holds each token's cache row
            A.kv_cache_write(rec, kv["k"][i], kv["v"][i], k, v, acts.segments, acts.positions, acts.n,
                             kv["batch"], kv["max_len"], hkv, d, kv["dtype"])
            A.attention_cached_forward(rec, att, q, kv["k"][i], kv["v"][i], acts.segments,
                                       acts.positions if acts.images is None else acts.images.spans,
                                       acts.n, kv["batch"], kv["max_len"], hq, hkv, d, cfg.window(i), cfg.attn_softcap,
                                       kv["scratch"], kv["dtype"], sinks, blocks=acts.images is not None)

    @staticmethod
    def _segments(acts):
        """The attention's segment operand: the segment ids, or with images their blocks' extents too."""
        return acts.segments if acts.images is None else acts.images.spans

    def _forward_glu(self, rec, op, i, acts, buf, kv):
        """A gated activation, swiglu or geglu (the op's kind names the kernel pair)."""
        rec.section(self._where + " swiglu")     # the gated activation's section, either kind
        getattr(K, op.kind + "_forward")(rec, buf[op.outputs[0]], buf[op.inputs[0]], buf[op.inputs[1]],
                                         acts.n * self.plans[i].widths[op.inputs[0]])

    _forward_swiglu = _forward_geglu = _forward_glu

    def _forward_add(self, rec, op, i, acts, buf, kv):
        rec.section(self._where + " norm")
        K.add(rec, buf[op.outputs[0]], buf[op.residual], buf[op.inputs[0]], acts.n * self.plans[i].widths[op.residual])

    def _forward_scale(self, rec, op, i, acts, buf, kv):
        rec.section(self._where + " attention")
        K.scale(rec, buf[op.outputs[0]], buf[op.inputs[0]], op.factor, acts.n * self.plans[i].widths[op.inputs[0]])

    def _split_rows(self, op, i, acts, names) -> tuple:
        """(rows, widths) of a split: with heads, each head's row split (Qwen3.5's q_proj, Qwen3-Next's fused ones)."""
        h = self.plans[i].head_count(self.cfg, op)
        return acts.n * h, [self.plans[i].widths[x] // h for x in names]

    def _forward_split(self, rec, op, i, acts, buf, kv):
        rec.section(self._where + " split")
        K.split_forward(rec, [buf[y] for y in op.outputs], buf[op.inputs[0]],
                        *self._split_rows(op, i, acts, op.outputs))

    def _forward_route(self, rec, op, i, acts, buf, kv):
        rec.section(self._where + " moe")
        moe = self.cfg.moe
        bias = self.w[f"model.layers.{i}.{op.param}"] if op.param else None    # LFM2-MoE's expert_bias
        moe_route_forward(rec, buf[op.outputs[0]], buf[op.outputs[1]], buf[op.inputs[0]], acts.n, moe.num_experts,
                          moe.top_k, moe.normalize, moe.scoring, bias, moe.scaling)
        if self.router_aux and not self._recomputing:     # a checkpointed layer counted once
            first = next(j for j in self.span if self.cfg.is_sparse(j))
            load_balancing_counts(rec, acts.moe.balance, buf[op.inputs[0]], buf[op.outputs[1]], acts.segments, acts.n,
                                  moe.num_experts, moe.top_k, acts.moe, accumulate=i != first)

    @property
    def router_aux(self) -> bool:
        """Whether the walk recorded now adds the router's load-balancing loss (a training one, weight > 0)."""
        return self.training and self.router_aux_weight > 0

    def record_router_aux_loss(self, rec, acts: Activations, loss):
        """loss (1,) f32 = the load-balancing loss of the training forward just recorded (router_aux)."""
        load_balancing_loss(rec, loss, acts.moe.balance, self.cfg.moe.num_experts)

    def _experts(self, i, op) -> tuple:
        """Layer i's experts: (gate_up, down) weights, their LoRA pairs (moe.MoeLora or None) and their paths."""
        paths = [f"model.layers.{i}.{op.param}.{name}" for name in EXPERT_PARAMETERS]
        loras = [self.expert_lora.get(p) if self.adapter_enabled else None for p in paths]
        return [self.w[p] for p in paths], [None if m is None else m.pair for m in loras], paths

    def _expert_variant(self, paths) -> dict:
        """gpt-oss's expert biases (their single buffers) and clamped SwiGLU, as keywords of the experts' op pair
        (engines/shared/moe.py's); {} for the plain SwiGLU without biases."""
        spec, out = self.cfg.moe, {}
        if spec.biases:
            out["gate_up_bias"], out["down_bias"] = (_whole(self.w[p + "_bias"]) for p in paths)
        if spec.swiglu:
            out["activation"] = ClampedSwiGLU(*spec.swiglu)
        return out

    def _moe_sizes(self, acts) -> tuple:
        """(N, k, E, C, I) of the experts' ops on this batch."""
        moe = self.cfg.moe
        return acts.n, moe.top_k, moe.num_experts, self.cfg.hidden_size, moe.expert_size

    def _forward_experts(self, rec, op, i, acts, buf, kv):
        rec.section(self._where + " moe")
        (gate_up, down), (lora_gu, lora_dn), paths = self._experts(i, op)
        moe_experts_forward(rec, buf[op.outputs[0]], buf[op.outputs[1]], *(buf[x] for x in op.inputs), gate_up, down,
                            lora_gu, lora_dn, *self._moe_sizes(acts), acts.moe, **self._expert_variant(paths))

    def _gate_rows(self, op, i, acts) -> tuple:
        """(rows, width, per_element, groups) of a sigmoid gate: a gate per token row (Qwen2-MoE's), per element
        (Qwen3.5's attention output gate), or per group of wx / wg columns (LFM3's per head)."""
        wx, wg = (self.plans[i].widths[x] for x in op.inputs)
        per_element = wg == wx > 1
        return acts.n, wx, per_element, 1 if per_element else wg

    def _forward_sigmoid_gate(self, rec, op, i, acts, buf, kv):
        rec.section(self._where + " moe")
        K.sigmoid_gate_forward(rec, buf[op.outputs[0]], buf[op.inputs[0]], buf[op.inputs[1]],
                               *self._gate_rows(op, i, acts))

    def head_logits(self, rec, acts: Activations, x, rows: int):
        """acts.logits (rows, V) = x (rows, C) lm_head^T, soft-capped where the model caps them (Gemma 2)."""
        linear_forward(rec, acts.logits, x, self.head(), None, rows)
        if self.cfg.logit_softcap:
            K.softcap_forward(rec, acts.logits, acts.logits, self.cfg.logit_softcap, rows * self.cfg.vocab_size)

    def record_head(self, rec, acts: Activations, backward: bool, part: str | None = None):
        """lm_head and cross-entropy over the loss head's acts.n_head rows (the trained ones, BucketCache.upload_batch),
        by chunks of acts.head_rows rows of logits: loss, lse and valid per head row (targets are in head
        row order too). With backward, dlogits, then dxf (zero on the rows the head skipped) and dW_head; with a
        TokenObjective (acts.objective), each chunk's row weights come from its own loss rows first.

        part (a SequenceObjective's step, whose weights the host computes from the loss rows in between):
        "forward", the logits and losses only, on the training step's buffers (the backward's inputs kept);
        "backward" (backward True), the rest: the logits and losses again where the head takes several chunks,
        where it takes one the chunk's logits and lse still there from the forward part."""
        cfg = self.cfg
        if part != "backward":
            self.counters["policy_forwards" if self.adapter_enabled else "reference_forwards"] += 1
        head, v, c, n, m = self.head(), cfg.vocab_size, cfg.hidden_size, acts.n, acts.n_head
        rec.section("loss head (lm_head, cross-entropy)")
        train = backward or part == "forward"
        x, dx = acts.xf, acts.dxf if backward else None
        compact = acts.head_index is not None
        if compact:
            # the gathered rows and their gradient live in buffers idle here: x_final when forward only
            # (read by the final norm, before), else d_res and d_tmp (the final norm's backward and the
            # layers' backward write them, after)
            x, dx = (acts.d_res, acts.d_tmp if backward else None) if train else (acts.x_final, None)
            K.row_gather_forward(rec, x, acts.xf, acts.head_index, m, c, n)
        dhead = self.grads.get(self.head_name())       # None unless the head's weight is trained
        kept = part == "backward" and m <= acts.head_rows
        for r0 in range(0, m, acts.head_rows):
            rows = min(acts.head_rows, m - r0)
            if not kept:
                self.head_logits(rec, acts, at(x, r0 * c), rows)
                if self.loss_temperature != 1.0:
                    K.scale(rec, acts.logits, acts.logits, 1.0 / self.loss_temperature, rows * v)
                K.cross_entropy_forward(rec, acts.loss_rows, acts.lse_rows, acts.valid_rows, acts.logits,
                                        acts.targets, rows, v, r0)
                if acts.entropies:      # a step with an objective: its policy's entropy, a metric
                    K.softmax_entropy_forward(rec, acts.entropy_rows, acts.logits, acts.lse_rows, rows, v, r0)
            if backward and acts.objective is not None:     # the weights of the head's own log-probabilities
                K.token_objective_backward(rec, acts.row_weights, acts.loss_rows, acts.row_terms, acts.objective,
                                           rows, r0)
            if backward:
                # through the temperature: 1 / T on the gradient, the cap's derivative in tempered units
                t = self.loss_temperature
                K.cross_entropy_backward(rec, acts.logits, acts.logits, acts.targets, acts.lse_rows, self.step_buf,
                                         rows, v, r0, cfg.logit_softcap / t, acts.row_weights, 1.0 / t)
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
        lora = self.lora.get(path)
        if lora is not None and lora.m is not None:
            xl = a["lora_x." + module] if lora.dropout > 0 else x
            dora_linear_backward(rec, dx, dy, a["lora_h." + module], a["dora_z." + module], x, xl, lora, w, n,
                                 acts.d_dora, acts.d_lora_h, acts.d_lora_x, self.dropout.buffer,
                                 self.dropout.slot_of(lora.module_id), accumulate_dx)
            return
        dw, db = self.grads.get(path + ".weight"), self.grads.get(path + ".bias")   # trained base weights only
        linear_backward(rec, dx, dw, db, dy, x, w, n, accumulate_dx)
        if lora is None:
            return
        group = self.groups.get(module)
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
            K.lora_dropout_backward(rec, dx, acts.d_lora_x, self.dropout.buffer, self.dropout.slot_of(lora.module_id),
                                    lora.dropout, n * lora.in_f)
        else:
            lora_backward(rec, dx, lora.ga, lora.gb, dy, x, h, lora.a, lora.b, lora.scale, n, lora.in_f, lora.out_f,
                          lora.r, acts.d_lora_h, accumulate_grads=True)

    def _norm_grad(self, name):
        return self.grads.get(name)

    def _backward_rmsnorm(self, rec, op, i, acts, a, dys, dxs, accumulate):
        """Into dx, or (accumulate) added to it by the kernel (one rounding of the sum in 16 bits)."""
        rec.section(self._where + (" attention" if op.heads else " norm"))
        rows, width = self._rows(op, acts)
        name = f"model.layers.{i}.{op.param}"
        K.rmsnorm_backward(rec, dxs[0], self._norm_grad(name), dys[0], a[op.inputs[0]], self.w[name], a[op.outputs[1]],
                           rows, width, acts.scratch_norm, accumulate=True, offset=self.cfg.norm_offset,
                           accumulate_dx=accumulate[0])

    def _backward_linear(self, rec, op, i, acts, a, dys, dxs, accumulate):
        self._linear_backward(rec, dxs[0], dys[0], i, op.param, acts, a, a[op.inputs[0]], accumulate[0])

    def _backward_rope(self, rec, op, i, acts, a, dys, dxs, accumulate):
        assert not accumulate[0], "rope's backward writes its gradient"
        rec.section(self._where + " attention")
        K.rope_backward(rec, dxs[0], dys[0], *self._rope_args(op, i, acts))

    def _backward_attention(self, rec, op, i, acts, a, dys, dxs, accumulate):
        assert not any(accumulate), "attention's backward writes its gradients"
        cfg = self.cfg
        rec.section(self._where + " attention")
        sinks = f"model.layers.{i}.{op.param}" if op.param else None      # gpt-oss's, trained or not
        A.attention_backward(rec, *dxs, dys[0], *(a[x] for x in op.inputs), *(a[x] for x in op.outputs),
                             self._segments(acts), acts.b, acts.t, cfg.num_attention_heads, cfg.num_key_value_heads,
                             cfg.head_dim, acts.scratch_att, cfg.window(i), cfg.attn_softcap,
                             sinks and self.w[sinks], sinks and self.grads.get(sinks), blocks=acts.images is not None)

    def _backward_glu(self, rec, op, i, acts, a, dys, dxs, accumulate):
        assert not any(accumulate), f"{op.kind}'s backward writes its gradients"
        rec.section(self._where + " swiglu")     # the gated activation's section, either kind
        getattr(K, op.kind + "_backward")(rec, *dxs, dys[0], *(a[x] for x in op.inputs),
                                          acts.n * self.plans[i].widths[op.inputs[0]])

    _backward_swiglu = _backward_geglu = _backward_glu

    def _backward_add(self, rec, op, i, acts, a, dys, dxs, accumulate):
        """The input's gradient is the output's (the residual's passes through in the same buffer)."""
        rec.section(self._where + " norm")
        n = acts.n * self.plans[i].widths[op.inputs[0]]
        if accumulate[0]:
            K.add_inplace(rec, dxs[0], dys[0], n)
        else:
            K.copy(rec, dxs[0], dys[0], n)

    def _backward_scale(self, rec, op, i, acts, a, dys, dxs, accumulate):
        assert not accumulate[0], "scale's backward writes its gradient"
        rec.section(self._where + " attention")
        K.scale(rec, dxs[0], dys[0], op.factor, acts.n * self.plans[i].widths[op.inputs[0]])

    def _backward_split(self, rec, op, i, acts, a, dys, dxs, accumulate):
        assert not accumulate[0], "split's backward writes its gradient"
        rec.section(self._where + " split")
        K.split_backward(rec, dxs[0], dys, *self._split_rows(op, i, acts, op.outputs))

    def _backward_route(self, rec, op, i, acts, a, dys, dxs, accumulate):
        assert not accumulate[0], "the route's backward writes the router logits' gradient"
        rec.section(self._where + " moe")
        moe = self.cfg.moe
        dprobs = None
        if self.router_aux:
            dprobs = acts.moe.probs
            load_balancing_dprobs(rec, dprobs, acts.moe.balance, acts.segments, acts.n, moe.num_experts,
                                  self.router_aux_weight)
        moe_route_backward(rec, dxs[0], dys[0], a[op.inputs[0]], a[op.outputs[1]], acts.n, moe.num_experts, moe.top_k,
                           moe.normalize, dprobs, moe.scoring, moe.scaling)

    def _backward_experts(self, rec, op, i, acts, a, dys, dxs, accumulate):
        """dx written or added (a Qwen2-MoE layer's shared expert wrote it first), the route weights' gradient
        written, the LoRA pairs' and trained experts' gradients added (the micro-batches of a step)."""
        assert not accumulate[1], "the experts' backward writes the route weights' gradient"
        rec.section(self._where + " moe")
        (gate_up, down), loras, paths = self._experts(i, op)
        grads = {}
        for part, path, lora in zip(("gate_up", "down"), paths, loras):
            if path in self.grads:
                grads[part] = self.grads[path]
            if path + "_bias" in self.grads:            # gpt-oss's, trained in full fine-tuning
                grads[part + "_bias"] = _whole(self.grads[path + "_bias"])
            if lora is not None:
                m = self.expert_lora[path]
                grads.update({part + ".lora_A": m.ga, part + ".lora_B": m.gb})
        sizes = self._moe_sizes(acts)
        if not accumulate[0]:
            K.fill(rec, dxs[0], 0.0, acts.n * self.cfg.hidden_size)
        moe_experts_backward(rec, dxs[0], dxs[1], grads, dys[0], *(a[x] for x in op.inputs), a[op.outputs[1]], gate_up,
                             down, *loras, *sizes, acts.moe, accumulate=True, **self._expert_variant(paths))

    def _backward_sigmoid_gate(self, rec, op, i, acts, a, dys, dxs, accumulate):
        assert not any(accumulate), "sigmoid_gate's backward writes its gradients"
        rec.section(self._where + " moe")
        K.sigmoid_gate_backward(rec, *dxs, dys[0], *(a[x] for x in op.inputs), *self._gate_rows(op, i, acts))

    def record_backward(self, rec, acts: Activations, head_part: str | None = None):
        """The loss head's and the final norm's backward (last; else the output's gradient is in d_res), every
        layer's (the plan's ops in reverse), then the embedding's (first, when the embedding is trained: full
        fine-tuning, modules_to_save). head_part "backward": the head's forward part was recorded before
        (record_head's part)."""
        cfg = self.cfg
        n, c = acts.n, cfg.hidden_size
        if self.last:
            self.record_head(rec, acts, backward=True, part=head_part)
            rec.section("final norm backward")
            K.rmsnorm_backward(rec, acts.d_res, self._norm_grad("model.norm.weight"), acts.dxf, acts.x_final,
                               self.w["model.norm.weight"], acts.rstd_f, n, c, acts.scratch_norm, accumulate=True,
                               offset=cfg.norm_offset)
        im = acts.images
        for i in reversed(self.span):
            rec.split_point()
            if im is not None and i < len(im.deepstack):     # Qwen3-VL's DeepStack features' gradient: layer i's
                rec.section(f"layer {i} backward")             # output's at the image rows
                K.row_gather_forward(rec, im.deepstack_grad[i], acts.d_res, im.index, im.count, c, n)
            # checkpointed: the forward left the last layer's activations in the shared buffers; the
            # others are recomputed (self.training and the micro-batch's seed slot still hold)
            if acts.checkpoint and i < self.span.stop - 1:
                self.record_layer_forward(rec, acts, i, recompute=True)
                self._recomputing = False
            self._where = f"layer {i} backward"
            for op, accumulate in self.plans[i].backward_steps():
                dys = [getattr(acts, name) for name in op.grads_out]
                dxs = [getattr(acts, name) for name in op.grads_in]
                getattr(self, "_backward_" + op.kind)(rec, op, i, acts, acts.layers[i], dys, dxs, accumulate)
        if self.first and acts.images is not None:     # the image rows' gradient, for the vision tower
            rec.section("embedding backward")
            K.row_gather_forward(rec, acts.images.grad, acts.d_res, acts.images.index, acts.images.count, c, n)
            self.image_grad_source = acts.images
        if self.first and EMBED in self.grads:
            rec.section("embedding backward")
            emb, g = self.w["model.embed_tokens.weight"], self.grads["model.embed_tokens.weight"]
            if cfg.embed_scale != 1.0:    # the layers' input gradient, read only here from now on
                K.scale(rec, acts.d_res, acts.d_res, cfg.embed_scale, n * c)
            pad = cfg.pad_token_id
            for (gbuf, r0, rows) in g.chunks:
                # torch's padding_idx: the padding row takes no gradient from the lookup (a tied head's stays)
                spans = [(r0, rows)] if pad is None or not r0 <= pad < r0 + rows else \
                    [(r0, pad - r0), (pad + 1, r0 + rows - pad - 1)]
                for start, count in spans:
                    if count:
                        K.embedding_backward(rec, at(gbuf, (start - r0) * emb.cols), acts.d_res, acts.ids, n,
                                             emb.cols, count, acts.scratch_emb, start, accumulate=True)


def _whole(t):
    """The one buffer of a small 2-D float32 tensor (a Matrix of one chunk: gpt-oss's expert biases) or a buffer."""
    if isinstance(t, Matrix):
        assert len(t.chunks) == 1 and t.chunks[0][1] == 0, "an expert bias spans one storage binding"
        return t.chunks[0][0]
    return t
