"""PEFT adapters written on transformers 4, one LoRA pair per expert and projection (Mixtral's w1 / w3 / w2, the
Qwen MoE family's and OLMoE's gate_proj / up_proj / down_proj under experts.N, the router's gate), load here as
PEFT 0.21 converts them on transformers 5: the same fused tensors and logits; and the MoE inputs refused in one
line: an expert count other than the model's, Qwen2-MoE's per-expert adapters (which PEFT does not convert);
training continued from such an adapter saves PEFT's new layout."""
from __future__ import annotations

import copy
import json

import numpy as np
import peft
import pytest
import torch

from tiny_models import build_moe, save_model
from tolerances import assert_close
from wgpu_train.cli.main import main
from wgpu_train.engines.loading import load_model
from wgpu_train.errors import AdapterError
from wgpu_train.formats.safetensors import write_safetensors

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

OLD_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
             **{arch: ("mlp", "gate_proj", "up_proj", "down_proj") for arch in ("qwen3_moe", "olmoe", "qwen2_moe")}}


def write_old_adapter(hf, arch, folder, r=2, alpha=5, experts=None, projections=None, router=True):
    """A PEFT adapter as transformers 4 models saved it: LoRA on q_proj, on each expert's projections (`experts`
    of them, by default the model's count) and on the router, random A and B."""
    c = hf.config
    count = getattr(c, "num_local_experts", None) or c.num_experts
    experts = count if experts is None else experts
    hidden, inter = c.hidden_size, getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    block, gate, up, down = OLD_NAMES[arch]
    projections = (gate, up, down) if projections is None else projections
    rng = np.random.default_rng(0)
    tensors = {}

    def pair(key, out_f, in_f):
        tensors[f"{key}.lora_A.weight"] = (0.3 * rng.standard_normal((r, in_f))).astype(np.float32)
        tensors[f"{key}.lora_B.weight"] = (0.3 * rng.standard_normal((out_f, r))).astype(np.float32)

    for i in range(c.num_hidden_layers):
        prefix = f"base_model.model.model.layers.{i}"
        pair(f"{prefix}.self_attn.q_proj", hf.model.layers[i].self_attn.q_proj.out_features, hidden)
        if arch == "qwen3_moe" and i in c.mlp_only_layers:
            continue
        for e in range(experts):
            for proj in projections:
                pair(f"{prefix}.{block}.experts.{e}.{proj}", *((hidden, inter) if proj == down else (inter, hidden)))
        if router:
            pair(f"{prefix}.{block}.gate", count, hidden)
    folder.mkdir(parents=True)
    write_safetensors(folder / "adapter_model.safetensors", tensors, metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
        "bias": "none", "target_modules": ["q_proj", *projections, *(["gate"] if router else [])],
        "base_model_name_or_path": ""}))
    return folder


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe"])
def test_old_per_expert_adapter_loads_as_peft_converts_it(arch, tmp_path):
    """The converted tensors equal PEFT's (rank 2r block-diagonal gate_up pairs, stacked down pairs, the router's),
    and the logits PEFT's with the adapter; merged, PEFT's merge_and_unload."""
    hf = build_moe(arch, seed=4)
    save_model(hf, tmp_path / "model")
    adapter = write_old_adapter(hf, arch, tmp_path / "adapter")
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), adapter).eval()
    assert pm.peft_config["default"].target_parameters            # PEFT converted it
    model = load_model(tmp_path / "model", backend="numpy")
    model.load_adapter(adapter)
    assert model.lora_config.target_parameters == ("gate_up_proj", "down_proj")
    theirs = {n.replace(".default.", "."): p.detach().numpy() for n, p in pm.named_parameters() if "lora_" in n}
    mine = model.lora_state_dict()
    assert set(mine) == set(theirs)
    for k, v in mine.items():
        assert_close(v, theirs[k], "exact", k)
    ids = np.array([[1, 5, 9, 2, 7, 11], [3, 4, 8, 13, 2, 6]])
    mask = np.ones_like(ids)
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids)).logits.numpy()
        merged_want = pm.merge_and_unload()(input_ids=torch.tensor(ids)).logits.numpy()
    assert np.abs(want - hf(input_ids=torch.tensor(ids)).logits.detach().numpy()).max() > 0.1   # the adapter bites
    assert_close(model.logits(ids, mask), want, "logits_f32", arch)
    assert main(["merge", "--model", str(tmp_path / "model"), "--adapter-path", str(adapter),
                 "--out", str(tmp_path / "merged")]) == 0
    merged = load_model(tmp_path / "merged", backend="numpy")
    assert_close(merged.logits(ids, mask), merged_want, "merged_logits", arch)


def test_old_adapter_on_experts_alone_loads(tmp_path):
    """Targets that are all experts leave target_modules empty after the conversion, as PEFT's does."""
    hf = build_moe("mixtral", seed=4)
    save_model(hf, tmp_path / "model")
    adapter = write_old_adapter(hf, "mixtral", tmp_path / "adapter", router=False)
    raw = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**raw, "target_modules": ["w1", "w2", "w3"]}))
    from safetensors.numpy import load_file, save_file
    tensors = {k: v for k, v in load_file(adapter / "adapter_model.safetensors").items() if "q_proj" not in k}
    save_file(tensors, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), adapter).eval()
    model = load_model(tmp_path / "model", backend="numpy")
    model.load_adapter(adapter)
    assert model.lora_config.target_modules == ()
    ids = np.array([[1, 5, 9, 2, 7, 11]])
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids)).logits.numpy()
    assert_close(model.logits(ids, np.ones_like(ids)), want, "logits_f32", "experts alone")


def _one_line_error(argv, capsys) -> str:
    capsys.readouterr()
    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    return err[0]


def test_moe_adapter_refusals(tmp_path, capsys):
    """One line, exit 2: an old adapter with fewer experts than the model; a fused (target_parameters) adapter of
    a model with another expert count; expert targets on a dense model; gate without up; Qwen2-MoE's per-expert adapters, which PEFT 0.21 does not
    convert (it puts their names on the shared expert and drops the experts' weights)."""
    hf = build_moe("mixtral", seed=4)
    save_model(hf, tmp_path / "model")
    merge = ["merge", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "out"), "--adapter-path"]
    few = write_old_adapter(hf, "mixtral", tmp_path / "few", experts=4)
    assert "the adapter has LoRA for 4 experts in" in _one_line_error([*merge, str(few)], capsys)
    assert "the model has 5" in _one_line_error([*merge, str(few)], capsys)
    half = write_old_adapter(hf, "mixtral", tmp_path / "half", projections=("w1", "w2"))
    assert "w1 cannot be converted without w3" in _one_line_error([*merge, str(half)], capsys)
    other = build_moe("mixtral", seed=4, num_local_experts=6)
    fused = tmp_path / "fused"
    peft.get_peft_model(copy.deepcopy(other), peft.LoraConfig(
        r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    ).save_pretrained(fused)
    line = _one_line_error([*merge, str(fused)], capsys)
    assert "LoRA for 6 experts" in line and "the model has 5" in line, line
    from tiny_models import build_model
    save_model(build_model("llama", vocab_size=61), tmp_path / "dense")
    line = _one_line_error(["merge", "--model", str(tmp_path / "dense"), "--out", str(tmp_path / "out"),
                            "--adapter-path", str(fused)], capsys)
    assert "LoRA target_parameters gate_up_proj, down_proj: LlamaForCausalLM has no experts" in line, line
    q2 = build_moe("qwen2_moe", seed=4)
    save_model(q2, tmp_path / "q2")
    old = write_old_adapter(q2, "qwen2_moe", tmp_path / "q2-adapter", router=False)
    line = _one_line_error(["merge", "--model", str(tmp_path / "q2"), "--out", str(tmp_path / "out"),
                            "--adapter-path", str(old)], capsys)
    assert "PEFT 0.21 does not convert them for this family" in line
    assert not (tmp_path / "out").exists()
    with pytest.raises(AdapterError, match="LoRA for 4 experts"):
        load_model(tmp_path / "model", backend="numpy").load_adapter(few)


def test_training_continues_from_an_old_adapter_and_saves_peft_s_new_layout(tmp_path):
    """finetune --adapter-path of a transformers 4 adapter: it trains on, and the saved adapter (target_parameters,
    gate_up_proj at rank 2r) loads in PEFT with our tensors."""
    from finetune_helpers import build_tokenizer, make_data_dir

    vocab = build_tokenizer(tmp_path / "model")
    hf = build_moe("mixtral", seed=4, vocab_size=vocab)
    save_model(hf, tmp_path / "model")
    old = write_old_adapter(hf, "mixtral", tmp_path / "old")
    assert main(["finetune", "--model", str(tmp_path / "model"), "--adapter-path", str(old), "--data",
                 str(make_data_dir(tmp_path / "data")), "--out", str(tmp_path / "run"), "--max-steps", "1",
                 "--backend", "numpy", "--no-progress"]) == 0
    raw = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert set(raw["target_parameters"]) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj", "gate.weight"}
    assert raw["rank_pattern"] == {r".*\.gate_up_proj": 4}
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "run")
    theirs = {n.replace(".default.", "."): p.detach().numpy() for n, p in pm.named_parameters() if "lora_" in n}
    model = load_model(tmp_path / "model", backend="numpy")
    model.load_adapter(tmp_path / "run")
    mine = model.lora_state_dict()
    assert set(mine) == set(theirs)
    for k, v in mine.items():
        assert_close(v, theirs[k], "exact", k)
