"""GPU memory planning: the buffers a model needs (weights, LoRA and optimizer state, activations,
logits) in bytes, computed from the same plan the WebGPU engine allocates from."""
from __future__ import annotations

import math

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.models.config import ModelConfig
from wgpu_train.engines.protocol import Precision
from wgpu_train.errors import DeviceError
from wgpu_train.models.layer_plan import INPUT, layer_plan

F32 = 4
MIN_BUCKET_TOKENS = 64        # the smallest activation bucket (tokens)
# modules that read the same input: with LoRA on two or more of them and no dropout, the WebGPU engine runs
# their A matrices as one GEMM into one h buffer (webgpu/lora.py)
LORA_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
               ("shared_expert.gate_proj", "shared_expert.up_proj"))
HEAD_CHUNK_BYTES = 32 << 20   # memory budget of the loss head's logits (rows held at a time), capped by the device
SHARED_LAYER = "layer."       # prefix, in a plan's shared part, of the one set of layer buffers all layers use


def format_bytes(n: int) -> str:
    """A byte count for people: GiB from 1 GiB on, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def head_rows(cfg: ModelConfig, n: int, max_binding: int | None = None, budget: int | None = None) -> int:
    """Rows of float32 logits the loss head holds at a time for n rows: as many as `budget` bytes hold
    (default HEAD_CHUNK_BYTES), never more than one storage binding of the device holds (max_binding;
    default 128 MiB), at most 65535 (one workgroup row each) and at least 1."""
    from wgpu_train.engines.webgpu.tuned.quant import DEFAULT_MAX_BINDING

    limit = min(HEAD_CHUNK_BYTES if budget is None else budget, max_binding or DEFAULT_MAX_BINDING)
    return max(1, min(n, limit // (cfg.vocab_size * F32), 65535))


def bucket_tokens(n: int) -> int:
    """Tokens an activation bucket for n tokens holds: the next power of two, at least MIN_BUCKET_TOKENS. A
    bucket runs any batch of up to that many tokens (the kernels take the sizes of each batch), so a run
    over many lengths allocates a few buckets rather than one per shape."""
    return max(MIN_BUCKET_TOKENS, 1 << max(0, (int(n) - 1).bit_length()))


def layer_ranks(module_ranks: dict) -> dict:
    """{module path: r} -> {module name: {layer: r}}: the ranks lora_groups and activation_ranks take (the linear
    modules', models.weights.module_name; the experts' LoRA lives in the MoE scratch: expert_rank)."""
    from wgpu_train.adapters.experts import is_expert_path
    from wgpu_train.models.weights import module_name

    out: dict = {}
    for path, r in module_ranks.items():
        if not is_expert_path(path):
            out.setdefault(module_name(path), {})[int(path.split(".")[2])] = int(r)
    return out


def expert_rank(module_ranks: dict) -> int:
    """{module path: r} -> the largest rank of a LoRA pair on MoE experts (0: none), which sizes the MoE scratch."""
    from wgpu_train.adapters.experts import is_expert_path

    return max([int(r) for path, r in module_ranks.items() if is_expert_path(path)] + [0])


def layer_kinds(cfg: ModelConfig, layers=None) -> list:
    """[(layer plan, its layers)] over `layers` (default every layer): the kinds of layer a model has (a mixture
    of experts' sparse and dense layers), each plan once."""
    out: dict = {}
    for i in range(cfg.num_hidden_layers) if layers is None else layers:
        plan = layer_plan(cfg, i)
        out.setdefault(id(plan), (plan, []))[1].append(i)
    return list(out.values())


def lora_groups(cfg: ModelConfig, ranks: dict, alone: bool) -> dict:
    """module -> the modules of its LORA_GROUPS entry whose LoRA runs as one (ranks: module -> {layer: r} of
    the modules with LoRA, layer_ranks): two or more members, LoRA on every member in the same layers, and in
    each of them ranks summing to less than the input width. alone: none (dropout, DoRA, or 16-bit activations,
    where each module's LoRA gradient is added into its input's gradient after the module's own base one, as
    engines/numpy rounds it)."""
    out = {}
    for group in LORA_GROUPS if not alone else ():
        members = tuple(m for m in group if m in ranks)
        if len(members) < 2 or len({frozenset(ranks[m]) for m in members}) > 1:
            continue
        width = cfg.linear_shape(members[0])[1]
        if all(sum(ranks[m][i] for m in members) < width for i in ranks[members[0]]):
            out.update({m: members for m in members})
    return out


def activation_ranks(ranks: dict, groups: dict) -> dict:
    """The lora_h buffers' widths (ranks: module -> {layer: r}): a group's summed ranks under its joined name,
    other modules' own rank, each the largest of any layer (every layer has buffers of that width)."""
    out = {}
    for m, per_layer in ranks.items():
        group = groups.get(m)
        if group:
            out["+".join(group)] = max(sum(ranks[g][i] for g in group) for i in per_layer)
        else:
            out[m] = max(per_layer.values())
    return out


# the buffers of the final norm and the loss head alone (a pipeline stage before the last has none of them; its
# output stays in x_final)
HEAD_BUFFERS = ("xf", "rstd_f", "logits", "loss_rows", "lse_rows", "valid_rows", "entropy_rows", "dxf", "d_tmp")


MOE_SCRATCH = "moe."          # prefix, in a plan's shared part, of the MoE ops' scratch (webgpu/moe.MoeScratch)
MOE_FORWARD_SCRATCH = ("group", "perm", "h", "outp", "lora_in", "lora_out", "gu")   # what the experts' forward uses


def activation_plan(cfg: ModelConfig, b: int, t: int, lora_ranks: dict, dropout_inputs: dict, train: bool,
                    checkpoint: bool = False, max_binding: int | None = None, dora_outputs: dict | None = None,
                    head: bool = True, layers=None, expert_rank: int = 0):
    """Element counts of every activation buffer of a (B, T) bucket: (per_layer, shared), per_layer {layer:
    {name: elements}} for each layer of `layers` (default every layer). A layer's activations and gradient
    buffers are those of its own layer_plan (an MoE model's sparse and dense layers differ); the activations no
    backward reads (a plan's unsaved ones) exist once, under SHARED_LAYER, each as wide as the widest kind of
    layer needs it; so do the gradient buffers.

    lora_ranks: module name (or a LoRA group's joined name) -> r, each layer holding the buffers of the modules it
    has; dropout_inputs: module name -> in_features (modules with dropout).
    checkpoint (gradient checkpointing, training only): each layer keeps only its input x_in; its other
    buffers exist once, in `shared` under the prefix SHARED_LAYER, and the backward recomputes them per layer.
    Forward-only buckets (train=False) keep nothing for a backward, so all their layer buffers, x_in
    included, exist once under SHARED_LAYER: a layer reads its input only before it writes the next one's.
    max_binding: the device's max storage binding, which caps the logits' rows (head_rows); default 128 MiB.
    dora_outputs: module name -> out_features of the DoRA modules (their z = W x + s B A x, dora_z, and the
    backward's scaled dy, d_dora).
    head: with the final norm's and the loss head's buffers (HEAD_BUFFERS); without, a pipeline stage's before
    the last.
    expert_rank: the largest rank of LoRA on MoE experts: with a sparse layer among `layers`, the MoE ops' scratch
    (webgpu/moe.scratch_sizes for every routed pair, the worst case; the forward's alone in a forward-only
    bucket) is shared under MOE_SCRATCH.
    """
    from wgpu_train.engines.webgpu import kernels as K
    from wgpu_train.engines.webgpu import attention as A

    n = b * t
    c, v, d, hq = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.num_attention_heads
    kinds = layer_kinds(cfg, layers)
    per_layer = {i: _layer_buffers(cfg, plan, i, n, lora_ranks, dropout_inputs, dora_outputs or {})
                 for plan, members in kinds for i in members}
    rows = head_rows(cfg, n, max_binding)
    shared = {"x_final": n * c, "xf": n * c, "rstd_f": n, "logits": rows * v, "loss_rows": n, "lse_rows": n,
              "valid_rows": n, "entropy_rows": n}

    def share(names_of):
        """Move the names names_of(plan) picks out of every layer's own buffers into one shared set, each as wide
        as its widest layer's."""
        for plan, members in kinds:
            for i in members:
                for name in names_of(plan, per_layer[i]):
                    e = per_layer[i].pop(name)
                    shared[SHARED_LAYER + name] = max(e, shared.get(SHARED_LAYER + name, 0))

    # activations no backward reads are written and read within a layer: one buffer for all layers
    share(lambda plan, own: [name for name in plan.widths if name not in plan.saved])
    if train:
        # d_tmp: the loss head's gathered rows' dx; d_lora_x: the LoRA dx of a module with dropout, before its mask
        for plan, _ in kinds:
            for name, width in plan.grad_widths.items():
                shared[name] = max(n * width, shared.get(name, 0))
        shared.update(d_tmp=n * c, dxf=n * c, d_lora_h=n * max(list(lora_ranks.values()) + [1]),
                      d_lora_x=n * max(list(dropout_inputs.values()) + [1]),
                      d_dora=n * max(list((dora_outputs or {}).values()) + [1]),
                      scratch_norm=K.rmsnorm_scratch_size(n * max(hq, 1), max(c, d)),
                      scratch_att=A.attention_scratch_size(b, t, hq), scratch_emb=K.embedding_scratch_size(n))
        if checkpoint:
            share(lambda plan, own: [name for name in own if name != INPUT])
    else:
        share(lambda plan, own: list(own))
    if any(cfg.is_sparse(i) for i in per_layer):
        from wgpu_train.engines.webgpu.moe import scratch_sizes

        moe = cfg.moe
        sizes = scratch_sizes(n, moe.top_k, moe.num_experts, c, moe.expert_size, expert_rank,
                              staged=moe.biases or bool(moe.swiglu))
        shared.update({MOE_SCRATCH + name: e for name, e in sizes.items() if train or name in MOE_FORWARD_SCRATCH})
    if not head:
        shared = {k: e for k, e in shared.items() if k not in HEAD_BUFFERS}
    return per_layer, shared


def _layer_buffers(cfg: ModelConfig, plan, layer: int, n: int, lora_ranks: dict, dropout_inputs: dict,
                   dora_outputs: dict) -> dict:
    """Layer `layer`'s buffers for n tokens, name -> elements: its plan's activations, and the LoRA, dropout and DoRA
    buffers of the modules it has (a group's under its joined name)."""
    modules = set(cfg.layer_modules(layer))
    own = {name: n * width for name, width in plan.widths.items()}
    own.update({"lora_h." + key: n * r for key, r in lora_ranks.items() if set(key.split("+")) <= modules})
    own.update({"lora_x." + m: n * in_f for m, in_f in dropout_inputs.items() if m in modules})
    own.update({"dora_z." + m: n * out_f for m, out_f in dora_outputs.items() if m in modules})
    return own


def activation_format(cfg: ModelConfig, name: str, precision: Precision | str = Precision.FP32) -> str:
    """The storage format of one activation_plan buffer in a precision: in bf16 / f16 the layer plan's activations
    and gradients, the loss head's input and their gradients are 16-bit (engines/numpy/precision.py's rounding
    points); statistics (rstd, logsumexp, the loss rows), LoRA's and DoRA's own buffers, scratch and the logits stay
    float32."""
    precision = Precision.parse(precision)
    if not precision.sixteen_bit:
        return precision.storage
    base = name.removeprefix(SHARED_LAYER)
    half = any((base in plan.widths and base not in plan.statistics) or base in plan.grad_widths
               for plan, _ in layer_kinds(cfg)) or base in ("x_final", "xf", "dxf", "d_tmp")
    return precision.storage if half else "f32"


def activation_bytes(cfg: ModelConfig, name: str, elements: int, precision: Precision | str = Precision.FP32) -> int:
    """Bytes of one activation_plan buffer in a precision (activation_format), as the engine allocates it."""
    from wgpu_train.engines.webgpu.device.storage import nbytes

    return nbytes(max(1, elements), activation_format(cfg, name, precision))


def weight_shapes(cfg: ModelConfig) -> dict:
    """Every base tensor the engines hold (biases and lm_head included), name -> shape."""
    from wgpu_train.models.weights import expected_shapes, module_path

    shapes = expected_shapes(cfg)
    if cfg.attention_bias:
        for i in range(cfg.num_hidden_layers):
            for m in ("q_proj", "k_proj", "v_proj"):
                shapes[module_path(i, m) + ".bias"] = (cfg.linear_shape(m)[0],)
    return shapes


def base_weight_bytes(cfg: ModelConfig, base_dtype: str = "float32", embed_dtype: str = "auto",
                      max_binding: int | None = None, keep=None) -> dict:
    """GPU bytes of the base weights stored as base_dtype (the linear layers and an MoE model's experts, every
    expert counted) and embed_dtype (embedding, lm_head; "auto": see check_dtypes), from the chunk plan the WebGPU
    engine allocates by: {"linear", "embedding", "other", "total"}; a checkpoint's MXFP4 experts at their packed
    size where the engines keep them so (shared/quant.storage_dtype).
    max_binding: the device's max storage binding (chunking rounds per buffer); default 128 MiB. keep: a
    predicate of the names counted (a pipeline stage's tensors); default all."""
    from wgpu_train.engines.webgpu.tuned.quant import DEFAULT_MAX_BINDING, stored_bytes
    from wgpu_train.engines.shared.quant import check_dtypes, check_experts_dtype, is_linear_weight, storage_dtype
    from wgpu_train.engines.webgpu.tensors import expert_bytes

    base_dtype, embed_dtype = check_dtypes(base_dtype, embed_dtype, cfg.checkpoint_dtype)
    check_experts_dtype(base_dtype, cfg)
    out = {"linear": 0, "embedding": 0, "other": 0}
    for name, shape in weight_shapes(cfg).items():
        if keep is not None and not keep(name):
            continue
        dtype = storage_dtype(name, len(shape), base_dtype, embed_dtype, cfg.packed_experts)
        if len(shape) == 3:      # an MoE layer's experts: one buffer in its format (tensors.store_experts)
            n = expert_bytes(math.prod(shape), dtype)
        elif len(shape) == 2:
            n = stored_bytes(shape[0], shape[1], dtype, max_binding or DEFAULT_MAX_BINDING)
        else:
            n = max(1, shape[0]) * F32
        out["linear" if is_linear_weight(name) or len(shape) == 3 else "embedding" if len(shape) == 2
            else "other"] += n
    out["total"] = sum(out.values())
    return out


def copy_bytes(cfg: ModelConfig, lora: LoraConfig, embed_dtype: str, max_binding: int | None = None) -> tuple:
    """(bytes the modules_to_save copies add to the stored base weights, bytes of the copies in float32) for
    an embedding stored as embed_dtype: a trained weight is stored in float32, and a tied model whose head
    PEFT unties holds the head as a tensor of its own."""
    from wgpu_train.engines.webgpu.tuned.quant import DEFAULT_MAX_BINDING, stored_bytes
    from wgpu_train.adapters.saved_modules import trained_weights

    names, untie = trained_weights(cfg.tie_word_embeddings, lora.modules_to_save, lora.ensure_weight_tying)
    binding = max_binding or DEFAULT_MAX_BINDING
    f32 = stored_bytes(cfg.vocab_size, cfg.hidden_size, "float32", binding)
    stored = stored_bytes(cfg.vocab_size, cfg.hidden_size, embed_dtype, binding)
    return (f32 - stored) * len(names) + (stored if untie else 0), f32 * len(names)


def estimate_memory(config: ModelConfig, batch_size: int, seq_len: int, lora: LoraConfig | None = None,
                    method: str = "lora", base_dtype: str = "float32", embed_dtype: str = "auto",
                    gradient_checkpointing: bool = False, max_binding: int | None = None,
                    precision: Precision | str = Precision.FP32) -> dict:
    """GPU bytes by category for training at (batch_size, seq_len), in the bucket the engine allocates for it
    (bucket_tokens): weights (the base weights as stored:
    see base_weight_bytes; modules_to_save copies in float32), trainable state (LoRA or full weights with
    gradients and AdamW moments; the copies' gradients and moments),
    activations (with gradient_checkpointing: one layer's set plus every layer's input; in bf16 / f16 two bytes
    an element where activation_bytes says; an MoE model's routed activations for every token's top-k pairs, the
    worst case, and the MoE scratch; a Gated DeltaNet model's delta-rule states and scratch, the most over its
    chunks: delta_rule.training_bytes), logits, and total.
    max_binding: the device's max storage binding (weight chunks, the logits' rows); default 128 MiB."""
    if method not in ("lora", "full"):
        raise ValueError("method must be 'lora' or 'full'")
    precision = Precision.parse(precision)
    from wgpu_train.engines.shared.quant import check_dtypes
    from wgpu_train.adapters.experts import is_expert_path
    from wgpu_train.models.weights import module_name

    base_dtype, embed_dtype = check_dtypes(base_dtype, embed_dtype, config.checkpoint_dtype, full=method == "full")
    if method == "full" and (base_dtype.rounds or embed_dtype.rounds):
        raise ValueError("full fine-tuning needs float32 base weights")
    weights = base_weight_bytes(config, base_dtype, embed_dtype, max_binding)["total"]
    ranks, drop, dora = {}, {}, {}
    if method == "lora":
        lora = lora or LoraConfig()
        trainable = 0
        modules = lora.as_saved(config).modules(config)      # path -> (r, alpha), each module's own r
        dora_norms = dora_scratch = 0
        for path, (r, _) in modules.items():
            if is_expert_path(path):        # a pair per expert: A (E, r, in), B (E, out, r)
                e, out_f, in_f = config.expert_shape(path.rsplit(".", 1)[1])
                trainable += e * r * (in_f + out_f)
                continue
            m = module_name(path)
            out_f, in_f = config.linear_shape(m)
            trainable += r * (in_f + out_f) + (out_f if lora.use_dora else 0)     # DoRA: the magnitude
            if lora.dropout > 0:
                drop[m] = in_f
            if lora.use_dora:    # webgpu/dora.py: ||W||^2 and 1 / ||W + s B A||, and the scratch of P^T and G
                dora[m] = out_f
                dora_norms += 2 * out_f
                dora_scratch = max(dora_scratch, r * out_f + r * r)
        ranks = layer_ranks({p: r for p, (r, _) in modules.items()})
        moe_rank = expert_rank({p: r for p, (r, _) in modules.items()})
        extra, copies = copy_bytes(config, lora, embed_dtype, max_binding)
        weights += extra
        # LoRA's parameter, gradient, two moments; DoRA's norm buffers and scratch; the copies' last three
        state = trainable * 4 * F32 + (dora_norms + dora_scratch) * F32 + copies * 3
    else:
        state = weights * 3                  # gradient and two moments of every weight
    ranks = activation_ranks(ranks, lora_groups(config, ranks, bool(drop or dora) or precision.sixteen_bit))
    layers, shared = activation_plan(config, 1, bucket_tokens(batch_size * seq_len), ranks, drop, train=True,
                                     checkpoint=gradient_checkpointing, max_binding=max_binding, dora_outputs=dora,
                                     expert_rank=moe_rank if method == "lora" else 0)
    logits = shared.pop("logits") * F32
    activations = sum(activation_bytes(config, k, e, precision) for part in (*layers.values(), shared)
                      for k, e in part.items())
    if any(config.linear_layers or ()):     # the delta rule's states and scratch (gated_deltanet_layers.py)
        from wgpu_train.engines.webgpu.delta_rule import training_bytes

        spec = config.linear_attention
        activations += training_bytes(batch_size, seq_len, spec.key_heads, spec.value_heads, spec.key_dim,
                                      spec.value_dim, sum(config.linear_layers), gradient_checkpointing,
                                      max_binding or 128 << 20, precision.sixteen_bit)
    out = {"weights": weights, "trainable_state": state, "activations": activations, "logits": logits}
    out["total"] = sum(out.values())
    return out


def check_fits(config: ModelConfig, batch_size: int, seq_len: int, max_binding: int, layer_plan: dict,
               shared_plan: dict):
    """Refuse a bucket with a buffer over the device's max storage binding, naming it and what to reduce."""
    for name, elems in list(layer_plan.items()) + list(shared_plan.items()):
        if elems * F32 > max_binding:
            raise DeviceError(
                f"activation '{name}' for batch {batch_size} x {seq_len} tokens needs {elems * F32 / 2**20:.0f} MiB, "
                f"over the device's max storage binding of {max_binding / 2**20:.0f} MiB: reduce the batch size "
                f"or --max-seq-len")


def count_trainable(cfg: ModelConfig, lora: LoraConfig | None, experts_only: bool = False) -> int:
    """Trainable parameters of a model: the LoRA matrices (and DoRA's magnitudes) and modules_to_save copies, or
    every weight (from shapes, nothing read back); experts_only: those of LoRA pairs on MoE experts alone."""
    from wgpu_train.models.weights import expected_shapes, module_name
    from wgpu_train.adapters.experts import is_expert_path
    from wgpu_train.adapters.saved_modules import count

    if lora is not None:
        total = 0 if experts_only else count(cfg, lora)
        for path, (r, _) in lora.as_saved(cfg).modules(cfg).items():
            if is_expert_path(path):
                e, out_f, in_f = cfg.expert_shape(path.rsplit(".", 1)[1])
                total += e * r * (out_f + in_f)
            elif not experts_only:
                out_f, in_f = cfg.linear_shape(module_name(path))
                total += r * (out_f + in_f) + (out_f if lora.use_dora else 0)
        return total
    if experts_only:
        return sum(math.prod(cfg.expert_shape(p)) for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i)
                   for p in ("gate_up_proj", "down_proj"))
    n = sum(math.prod(s) for s in expected_shapes(cfg).values())
    return n + (cfg.num_hidden_layers * (cfg.q_size + 2 * cfg.kv_size) if cfg.attention_bias else 0)
