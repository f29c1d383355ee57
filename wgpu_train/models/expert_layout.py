"""Where a checkpoint keeps an MoE layer's experts: transformers 5's fused 3-D tensors (mlp.experts.gate_up_proj
(E, 2I, hidden), gate rows first; mlp.experts.down_proj (E, hidden, I)) or the hub's one tensor per expert and
projection (Mixtral's block_sparse_moe.experts.N.w1 / w3 / w2, the Qwen MoE family's and OLMoE's
mlp.experts.N.gate_proj / up_proj / down_proj, LFM2-MoE's feed_forward.experts.N.w1 / w3 / w2, its fused ones under
feed_forward too). Read either as the fused one; write back the one a checkpoint came in. gpt-oss keeps its own
(gpt_oss_layout.py). Qwen3-VL-MoE's published checkpoints store the fused tensors with their last two axes swapped
(gate_up_proj (E, hidden, 2I), down_proj (E, I, hidden)): read transposed where the shape says so, as transformers'
conversion mapping does, and written back so (in_out_names)."""
from __future__ import annotations

from wgpu_train.formats.safetensors import Stacked, TensorMap, Transposed
from wgpu_train.models import gpt_oss_layout
from wgpu_train.models.config import EXPERT_PARAMETERS, ModelConfig

# per family: the block's name in hub checkpoints, and its experts' (gate, up, down) projection names
_HUB = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")), "lfm2_moe": ("feed_forward", ("w1", "w3", "w2"))}
_DEFAULT_HUB = ("mlp", ("gate_proj", "up_proj", "down_proj"))
# the multimodal classes whose checkpoints may store the fused experts as (E, in, out) (transformers' conversion
# mapping transposes them when the stored shape is not the module's: qwen3_vl_moe)
_IN_OUT_FUSED = ("Qwen3VLMoeForConditionalGeneration",)


def _hub(cfg: ModelConfig):
    return _HUB.get(cfg.family, _DEFAULT_HUB)


def expert_names(cfg: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """The hub's names of one expert's gate, up and down weights."""
    block, projections = _hub(cfg)
    return tuple(f"model.layers.{layer}.{block}.experts.{expert}.{p}.weight" for p in projections)


def is_fused(names) -> bool:
    """Whether a checkpoint's tensor names hold transformers 5's fused experts (mlp.experts.gate_up_proj)."""
    return any(n.endswith(".mlp.experts.gate_up_proj") for n in names)


def read_fused(tensors: dict, cfg: ModelConfig, source: str = "") -> dict:
    """A checkpoint's raw tensors (name -> (bytes, dtype)) with every sparse layer's experts under transformers
    5's fused names (Stacked views of the per-expert ones where the checkpoint has those) and the router under
    mlp.gate (LFM2-MoE's: under feed_forward; gpt-oss: its experts in our layout from MXFP4 or transformers', gpt_oss_layout.read_experts; source
    names the checkpoint in its errors); tensors of a layout the model lacks are left for the caller's check to
    name."""
    if cfg.family == "gpt_oss":
        return gpt_oss_layout.read_experts(tensors, cfg.num_hidden_layers, source)
    block, _ = _hub(cfg)
    out = dict(tensors)
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_sparse(i):
            continue
        ours = cfg.moe.block
        router = f"model.layers.{i}.{block}.gate.weight"
        if router in out and block != ours:
            out[f"model.layers.{i}.{ours}.gate.weight"] = out.pop(router)
        fused = f"model.layers.{i}.{ours}.experts.gate_up_proj"
        names = [expert_names(cfg, i, e) for e in range(cfg.moe.num_experts)]
        if fused in out and cfg.wrapper in _IN_OUT_FUSED:
            _read_in_out(out, cfg, f"model.layers.{i}.{ours}.experts.")
        if fused in out or not all(n in out for trio in names for n in trio):
            continue
        dtypes = {out[n][1] for trio in names for n in trio}
        if len(dtypes) > 1:
            continue          # mixed dtypes within one layer's experts: the shape check names the fused tensor
        dtype = dtypes.pop()
        out[fused] = (Stacked([(out[g][0], out[u][0]) for g, u, _ in names]), dtype)
        out[f"model.layers.{i}.{ours}.experts.down_proj"] = (Stacked([(out[d][0],) for _, _, d in names]), dtype)
        for trio in names:
            for n in trio:
                del out[n]
    return out


def _read_in_out(tensors: dict, cfg: ModelConfig, prefix: str):
    """A layer's fused expert tensors (under `prefix`) stored (E, in, out), read as (E, out, in) (Transposed) in
    `tensors`; a tensor already of that shape (or of neither: the caller's shape check names it) left as it is."""
    for param in EXPERT_PARAMETERS:
        raw, dtype = tensors.get(prefix + param, (None, None))
        e, rows, cols = cfg.expert_shape(param)
        if raw is not None and tuple(raw.shape) == (e, cols, rows) != (e, rows, cols):
            tensors[prefix + param] = (Transposed(raw), dtype)


def in_out_names(cfg: ModelConfig, source: dict) -> set:
    """The names of a checkpoint's fused expert tensors stored (E, in, out) (source: {file name: (raw, dtype)}), which
    a merged folder writes back so; none for a model whose checkpoints do not (_IN_OUT_FUSED)."""
    if cfg.wrapper not in _IN_OUT_FUSED:
        return set()
    out = set()
    for name, (raw, _) in source.items():
        param = name.rsplit(".", 1)[-1]
        if ".experts." in name and param in EXPERT_PARAMETERS:
            e, rows, cols = cfg.expert_shape(param)
            if tuple(raw.shape) == (e, cols, rows) != (e, rows, cols):
                out.add(name)
    return out


def hub_names(cfg: ModelConfig, name: str) -> list[tuple[str, tuple | None]]:
    """How the hub's layout stores our tensor `name`: [(its name, (expert, row slice) or None)]: a fused expert
    tensor becomes one tensor per expert (gate_up_proj: the gate's rows, then the up's), Mixtral's router moves
    under block_sparse_moe; any other tensor keeps its name."""
    parts = name.split(".")
    if cfg.moe is None or len(parts) != 6 or parts[:2] != ["model", "layers"] or parts[3] != cfg.moe.block:
        return [(name, None)]
    block, layer, inter = _hub(cfg)[0], int(parts[2]), cfg.moe.expert_size
    if parts[4:] == ["gate", "weight"]:
        return [(f"model.layers.{layer}.{block}.gate.weight", None)]
    if parts[4] != "experts":
        return [(name, None)]
    out = []
    for e in range(cfg.moe.num_experts):
        gate, up, down = expert_names(cfg, layer, e)
        if parts[5] == "gate_up_proj":
            out += [(gate, (e, slice(0, inter))), (up, (e, slice(inter, 2 * inter)))]
        else:
            out.append((down, (e, slice(None))))
    return out


def hub_layout(cfg: ModelConfig, weights) -> TensorMap:
    """Our tensors (name -> array, read one at a time) under the hub's names (hub_names), each expert's made
    from its fused tensor when it is read (the last fused tensor read is kept: a writer takes a layer's experts
    one after another); gpt-oss's in transformers' layout (gpt_oss_layout.hub_layout)."""
    if cfg.family == "gpt_oss":
        return gpt_oss_layout.hub_layout(weights, cfg.num_hidden_layers)
    where = {hub: (name, part) for name in weights for hub, part in hub_names(cfg, name)}
    last = {}

    def fetch(hub: str):
        name, part = where[hub]
        if part is None:
            return weights[name]
        if name not in last:
            last.clear()
            last[name] = weights[name]
        return last[name][part[0], part[1]]

    return TensorMap(list(where), fetch)
