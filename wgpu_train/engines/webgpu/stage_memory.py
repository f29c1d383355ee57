"""The memory of each pipeline stage (a model's layers cut by models/stage_plan.py): its weights, trainable state,
the activations of its layers for the micro-batches it holds at once, on the last stage the loss head's, and a
vision model's image inputs; what balances the stages and what `wgpu-train memory --pipeline-stages` prints."""
from __future__ import annotations

from dataclasses import dataclass

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.adapters.experts import is_expert_path
from wgpu_train.engines.webgpu.memory import (F32, activation_bytes, activation_plan, activation_ranks,
                                              base_weight_bytes, bucket_tokens, expert_rank, layer_ranks,
                                              lora_groups)
from wgpu_train.engines.protocol import Precision
from wgpu_train.models.config import ModelConfig
from wgpu_train.models.layer_plan import INPUT
from wgpu_train.models.stage_plan import StagePlan, plan_stages
from wgpu_train.models.weights import module_name

SCHEDULES = ("gpipe", "1f1b")
I32 = 4


@dataclass(frozen=True)
class StageImages:
    """A vision model's images in each training row, as the stages take them (webgpu/images.ImageInputs)."""

    tokens_per_row: int         # the image tokens (the placeholders the embeddings replace) of a row
    deepstack: int = 0          # Qwen3-VL's DeepStack features, added to layers 0 .. deepstack - 1
    mrope: bool = False         # every token's M-RoPE positions (Qwen3-VL's)


def image_input_bytes(cfg: ModelConfig, images: StageImages, batch: int, seq: int, layers: range, first: bool,
                      precision: Precision | str = "fp32") -> int:
    """The image buffers a stage holds for one micro-batch (batch x seq) it has in flight, as ImageInputs.attach
    fills them (their elements: it allocates up to the next power of two): the image tokens' rows (int32) and the
    attention's blocks (3 int32 a token); M-RoPE's positions (int32, each token's rotated pairs); the DeepStack
    features of the layers it holds and their gradients (float32, which the backward gathers for the tower's LoRA)
    and, on the first stage, the embeddings (the layers' input format) and their gradient (float32)."""
    n, tokens, c = batch * images.tokens_per_row, batch * seq, cfg.hidden_size
    features = activation_bytes(cfg, INPUT, n * c, precision) if n else 0
    total = (n + 3 * tokens) * I32 if n else 0
    total += tokens * ((cfg.rotary_dim or cfg.head_dim) // 2) * I32 if images.mrope else 0
    total += (features + n * c * F32) * sum(k in layers for k in range(images.deepstack))
    return total + (features + n * c * F32 if first and n else 0)


def in_flight(schedule: str, stages: int, stage: int, micro_batches: int) -> int:
    """The training micro-batches whose activations stage `stage` holds at once: all of a step's under GPipe
    (every forward before any backward), at most stages - stage under 1F1B; one on the last stage, whose forward,
    loss and backward of a micro-batch run at once."""
    if stage == stages - 1:
        return 1
    return micro_batches if schedule == "gpipe" else min(micro_batches, stages - stage)


def _activation_parts(cfg: ModelConfig, batch: int, seq: int, lora: LoraConfig | None, gc: bool,
                      max_binding, precision: Precision | str, head: bool) -> tuple:
    """(bytes of each layer's activations {layer: bytes}, of the shared buffers but the logits, of the logits) of a
    training micro-batch's bucket, as a stage allocates it (webgpu/stage.py: a bucket per micro-batch it holds; the
    final norm's and loss head's buffers on the last stage alone: head)."""
    ranks, drop, dora, moe_rank = {}, {}, {}, 0
    if lora is not None:
        modules = lora.as_saved(cfg).modules(cfg)
        for path, (r, _) in modules.items():
            if is_expert_path(path):
                continue
            m = module_name(path)
            out_f, in_f = cfg.linear_shape(m)
            drop.update({m: in_f} if lora.dropout > 0 else {})
            dora.update({m: out_f} if lora.use_dora else {})
        ranks = layer_ranks({p: r for p, (r, _) in modules.items()})
        moe_rank = expert_rank({p: r for p, (r, _) in modules.items()})
    precision = Precision.parse(precision)
    ranks = activation_ranks(ranks, lora_groups(cfg, ranks, bool(drop or dora) or precision.sixteen_bit))
    layers, shared = activation_plan(cfg, 1, bucket_tokens(batch * seq), ranks, drop, train=True, checkpoint=gc,
                                     max_binding=max_binding, dora_outputs=dora, head=head, expert_rank=moe_rank)
    logits = shared.pop("logits", 0) * F32
    size = lambda part: sum(activation_bytes(cfg, k, e, precision) for k, e in part.items())   # noqa: E731
    return {i: size(part) for i, part in layers.items()}, size(shared), logits


def _trainable_bytes(cfg: ModelConfig, lora: LoraConfig | None, method: str, keep, weights: int) -> int:
    """A stage's LoRA tensors (or full weights) with their gradients and AdamW moments."""
    if method != "lora":
        return weights * 3
    total = 0
    lora = lora or LoraConfig()
    for path, (r, _) in lora.as_saved(cfg).modules(cfg).items():
        if keep(path) and is_expert_path(path):        # a pair per expert
            e, out_f, in_f = cfg.expert_shape(path.rsplit(".", 1)[1])
            total += e * r * (in_f + out_f)
        elif keep(path):
            out_f, in_f = cfg.linear_shape(module_name(path))
            total += r * (in_f + out_f) + (out_f if lora.use_dora else 0)
    return total * 4 * F32


def stage_memory(cfg: ModelConfig, plan: StagePlan, batch: int, seq: int, lora: LoraConfig | None = None,
                 method: str = "lora", base_dtype: str = "float32", embed_dtype: str = "auto", gc: bool = False,
                 max_binding=None, precision: Precision | str = "fp32", micro_batches: int = 1, schedule: str = "1f1b",
                 images: StageImages | None = None) -> list:
    """Each stage's bytes by estimate_memory's categories (weights, trainable_state, activations, logits, total),
    with its layers and the micro-batches it holds at once (in_flight); with images, image_inputs too (the
    image_input_bytes of each micro-batch in flight)."""
    parts = {head: _activation_parts(cfg, batch, seq, lora, gc, max_binding, precision, head) for head in (False, True)}
    out = []
    for s, layers in enumerate(plan.stages):
        keep = lambda name, s=s: plan.holds(s, name)          # noqa: E731
        weights = base_weight_bytes(cfg, base_dtype, embed_dtype, max_binding, keep=keep)["total"]
        held = in_flight(schedule, len(plan), s, micro_batches)
        layer, shared, logits = parts[s == len(plan) - 1]
        est = {"layers": f"{layers.start}-{layers.stop - 1}", "in_flight": held, "weights": weights,
               "trainable_state": _trainable_bytes(cfg, lora, method, keep, weights),
               "activations": held * (sum(layer[i] for i in layers) + shared), "logits": held * logits}
        if images is not None:
            est["image_inputs"] = held * image_input_bytes(cfg, images, batch, seq, layers, s == 0, precision)
        est["total"] = sum(est.get(k, 0) for k in ("weights", "trainable_state", "activations", "logits",
                                                   "image_inputs"))
        out.append(est)
    return out


def balanced_stages(cfg: ModelConfig, stages: int, stage_layers: str | None, batch: int, seq: int,
                    lora: LoraConfig | None = None, method: str = "lora", base_dtype: str = "float32",
                    embed_dtype: str = "auto", gc: bool = False, precision: Precision | str = "fp32",
                    micro_batches: int = 1, schedule: str = "1f1b") -> StagePlan:
    """plan_stages with the smallest largest stage_memory total: a stage's layers' weights and trainable state,
    their activations for the micro-batches that stage holds at once (in_flight: more on the first stages under
    1F1B), the shared buffers, the embedding on the first stage, the norm, head and logits on the last (a vision
    model's image inputs, small beside them, left out: finetune's split and `memory`'s are one)."""
    n = cfg.num_hidden_layers
    if stage_layers or not 1 <= stages <= n:      # by hand, or refused in one line
        return plan_stages(n, stages, stage_layers, tied=cfg.tie_word_embeddings)
    whole = StagePlan((range(n),), n, cfg.tie_word_embeddings)
    parts = {head: _activation_parts(cfg, batch, seq, lora, gc, None, precision, head) for head in (False, True)}
    prefix = [0]
    for i in range(n):
        keep = lambda name, i=i: name.startswith(f"model.layers.{i}.")          # noqa: E731
        weights = base_weight_bytes(cfg, base_dtype, embed_dtype, keep=keep)["total"]
        prefix.append(prefix[-1] + weights + _trainable_bytes(cfg, lora, method, keep, weights))
    first = base_weight_bytes(cfg, base_dtype, embed_dtype, keep=lambda k: k == "model.embed_tokens.weight")["total"]
    ends = base_weight_bytes(cfg, base_dtype, embed_dtype,
                             keep=lambda k: whole.holds(0, k) and not k.startswith("model.layers."))["total"]
    last = ends - (0 if cfg.tie_word_embeddings else first)

    def cost(k: int, a: int, b: int) -> float:
        held = in_flight(schedule, stages, k, micro_batches)
        layer, shared, logits = parts[k == stages - 1]
        return (prefix[b] - prefix[a] + held * (sum(layer[i] for i in range(a, b)) + shared + logits)
                + (first if k == 0 else 0)
                + (last if k == stages - 1 else 0))

    return plan_stages(n, stages, None, cost, cfg.tie_word_embeddings)
