"""Recording a decoder layer's forward and backward, the embedding and the loss head into a command encoder
(LayerRecorder, a part of WgpuEngine)."""
from __future__ import annotations

from ..hf import module_path
from . import kernels as K
from . import quant
from .lora import lora_a_forward, lora_backward, lora_group_backward, linear_lora_forward
from .quant import QuantMatrix
from .operands import at
from .buffers import Activations, GpuLora
from .tensors import linear_backward, linear_forward


class LayerRecorder:
    """WgpuEngine's layer recording (a mixin: it uses the engine's weights, LoRA modules and buckets)."""

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
