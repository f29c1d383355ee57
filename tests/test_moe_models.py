"""Mixtures of experts against transformers 5 and PEFT on tiny random models of each family (Mixtral, Qwen3-MoE
with a dense layer, Qwen2-MoE with its shared expert, OLMoE): logits, LoRA on the experts in PEFT's
target_parameters format (loss and gradients, the adapter both ways), the checkpoint layouts, merging, and the
configurations refused in one line."""
from __future__ import annotations

import copy
import json

import numpy as np
import peft
import pytest
import torch

from finetune_helpers import padded_batch, peft_random_b
from tiny_models import MOE_ARCHS, build_moe, save_model
from tolerances import assert_close
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.cli.main import main
from wgpu_train.engines.loading import load_model
from wgpu_train.errors import ConfigError
from wgpu_train.formats.safetensors import read_safetensors, write_safetensors
from wgpu_train.models.config import ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe(request, tmp_path_factory):
    hf = build_moe(request.param, seed=3)
    folder = tmp_path_factory.mktemp(request.param)
    save_model(hf, folder)
    return request.param, hf, folder


def batch():
    ids, labels, mask = padded_batch(5, 9, 6, 2)
    return ids % 61, np.where(labels >= 0, labels % 61, labels), mask


def test_logits_match_transformers(moe):
    arch, hf, folder = moe
    ids, _, mask = batch()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    model = load_model(folder, backend="numpy")
    assert model.config.moe is not None
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], want[real], "logits_f32", arch)


def _peft(hf, targets, seed=1):
    cfg = peft.LoraConfig(r=3, lora_alpha=7, lora_dropout=0.0, target_modules=targets, target_parameters=EXPERTS)
    return peft_random_b(peft.get_peft_model(copy.deepcopy(hf), cfg), seed)


def test_peft_expert_adapter_loads_here_with_its_gradients(moe, tmp_path):
    """A PEFT adapter with LoRA on the attention and on every expert (target_parameters): the same loss and
    the same gradient on every LoRA tensor, the experts' included."""
    arch, hf, folder = moe
    pm = _peft(hf, ["q_proj", "v_proj"])
    pm.save_pretrained(tmp_path)
    ids, labels, mask = batch()
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default.", "."): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    model = load_model(folder, backend="numpy")
    model.load_adapter(tmp_path)
    assert model.lora_config.target_parameters == ("gate_up_proj", "down_proj")
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    assert set(grads) == set(expected)
    assert any(".mlp.experts.base_layer.lora_A" in k for k in grads)
    for name, g in expected.items():
        assert np.abs(g).max() > 1e-5, name
        assert_close(grads[name], g, "grads_f32", name)


def test_all_linear_takes_the_router_and_experts_as_peft(moe, tmp_path):
    """all-linear on an MoE model: the attention, the router (PEFT adapts it as the parameter gate.weight), the
    experts (and the shared expert): our adapter loads in PEFT with the same tensors and logits. On Mixtral,
    Qwen3-MoE and OLMoE that is what PEFT's own all-linear takes; on Qwen2-MoE PEFT's takes its nn.Linear modules
    alone (the attention, dense MLPs, shared expert and its gate), neither router nor experts: ours takes those
    and the router and experts, named in target_parameters."""
    arch, hf, folder = moe
    model = load_model(folder, backend="numpy")
    model.add_lora(LoraConfig(r=2, alpha=5, target_modules="all-linear"), seed=2)
    rng = np.random.default_rng(0)
    model.engine.set_lora({p: (a, 0.3 * rng.standard_normal(b.shape).astype(np.float32), model._scales[p], 0.0)
                           for p, (a, b) in model.engine.lora_tensors().items()})
    model.save_adapter(tmp_path)
    raw = json.loads((tmp_path / "adapter_config.json").read_text())
    assert set(raw["target_parameters"]) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj", "gate.weight"}
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    theirs = {n.replace(".default.", "."): p.detach().numpy() for n, p in pm.named_parameters() if "lora_" in n}
    mine = model.lora_state_dict()
    assert set(theirs) == set(mine)
    own = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=2, target_modules="all-linear"))
    peft_all_linear = {n.replace(".default.", ".") for n, _ in own.named_parameters() if "lora_" in n}
    assert peft_all_linear == set(mine) if arch != "qwen2_moe" else peft_all_linear < set(mine)
    for k, v in mine.items():
        assert_close(theirs[k], v, "exact", k)
    ids, _, mask = batch()
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], want[real], "logits_f32", arch)


def test_qwen2_moe_mlp_names_take_the_shared_expert_as_peft(tmp_path):
    """On Qwen2-MoE PEFT 0.21 reads gate_proj / up_proj / down_proj as the dense layers' MLPs and the shared
    expert (it converts no expert names there): such an adapter loads here with PEFT's tensors, loss and
    gradients."""
    hf = build_moe("qwen2_moe", seed=3)
    save_model(hf, tmp_path / "model")
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=3, lora_alpha=7, lora_dropout=0.0, target_modules=["gate_proj", "up_proj", "down_proj"])), 1)
    pm.save_pretrained(tmp_path / "adapter")
    ids, labels, mask = batch()
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default.", "."): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    assert any("shared_expert.gate_proj" in k for k in expected) and any(".0.mlp.gate_proj" in k for k in expected)
    model = load_model(tmp_path / "model", backend="numpy")
    model.load_adapter(tmp_path / "adapter")
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "loss_f32", "loss")
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)


def _fused_folder(hf, folder):
    """A checkpoint in transformers 5's fused layout (its state_dict as it is) beside config.json."""
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", {k: v.numpy() for k, v in hf.state_dict().items()},
                      metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**hf.config.to_dict(),
                                                    "architectures": [type(hf).__name__]}))
    return folder


def test_merge_equals_peft_merge_and_unload(moe, tmp_path):
    """merge (the command) of LoRA on the attention and the experts: the merged folder, in the hub's per-expert
    layout the model came in, holds PEFT's merge_and_unload weights and gives its logits in transformers and
    here."""
    arch, hf, folder = moe
    pm = _peft(hf, ["q_proj", "o_proj"], seed=4)
    pm.save_pretrained(tmp_path / "adapter")
    assert main(["merge", "--model", str(folder), "--adapter-path", str(tmp_path / "adapter"),
                 "--out", str(tmp_path / "merged")]) == 0
    _check_merged(arch, pm.merge_and_unload(), tmp_path / "merged", fused=False)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_merge_of_a_fused_checkpoint_writes_it_fused(arch, tmp_path):
    """A checkpoint in transformers 5's fused layout merges back into that layout, equal to PEFT's
    merge_and_unload and read by transformers."""
    hf = build_moe(arch, seed=6)
    folder = _fused_folder(hf, tmp_path / "fused")
    pm = _peft(hf, ["k_proj", "v_proj"], seed=5)
    pm.save_pretrained(tmp_path / "adapter")
    assert main(["merge", "--model", str(folder), "--adapter-path", str(tmp_path / "adapter"),
                 "--out", str(tmp_path / "merged")]) == 0
    _check_merged(arch, pm.merge_and_unload(), tmp_path / "merged", fused=True)


def _check_merged(arch, peft_merged, out, fused: bool):
    import transformers as tf

    stored = read_safetensors(out / "model.safetensors")
    assert any("experts.gate_up_proj" in n for n in stored) == fused
    assert any(".experts.0." in n for n in stored) != fused
    theirs = {k: v.detach().numpy() for k, v in peft_merged.state_dict().items()}
    ours = load_model(out, backend="numpy").engine.weights()
    assert set(theirs) <= set(ours) | {"lm_head.weight"}
    for name, w in theirs.items():
        if name in ours:
            assert_close(np.asarray(ours[name]), w, "merged_weights", name)
    ids, _, mask = batch()
    real = mask.astype(bool)
    with torch.no_grad():
        want = peft_merged(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        reread = tf.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                         experts_implementation="eager").eval()
        got = reread(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert_close(got[real], want[real], "merged_logits", f"{arch} merged, in transformers")
    merged = load_model(out, backend="numpy")
    assert_close(merged.logits(ids, mask)[real], want[real], "merged_logits", f"{arch} merged, here")


def test_fused_checkpoint_layout_reads_the_same(tmp_path):
    """transformers 5's fused expert tensors and the hub's per-expert ones give the same model."""
    hf = build_moe("qwen3_moe", seed=5)
    save_model(hf, tmp_path / "hub")
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    _fused_folder(hf, tmp_path / "fused")
    ids, _, mask = batch()
    a = load_model(tmp_path / "hub", backend="numpy").logits(ids, mask)
    b = load_model(tmp_path / "fused", backend="numpy").logits(ids, mask)
    assert_close(a, b, "exact", "fused against per-expert")


@pytest.mark.parametrize("change, match", [
    ({"num_experts_per_tok": 9}, "'num_experts_per_tok' \\(9\\) is larger than"),
    ({"topk_group": 2}, "'topk_group' asks for grouped top-k routing"),
    ({"scoring_func": "sigmoid"}, "'scoring_func' asks for a router score other than softmax"),
    ({"router_jitter_noise": 0.1}, "'router_jitter_noise'"),
])
def test_unsupported_moe_configs_are_refused_naming_the_field(change, match):
    raw = {**build_moe("mixtral").config.to_dict(), "architectures": ["MixtralForCausalLM"], **change}
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_expert_targets_on_a_dense_model_and_dropout_on_experts_are_refused():
    from tiny_models import hf_config
    dense = ModelConfig.from_dict({**hf_config("llama").to_dict(), "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match="has no experts"):
        LoraConfig(target_parameters=EXPERTS).modules(dense)
    assert LoraConfig(target_modules="all-linear").modules(dense)        # all-linear: the model's own modules
    sparse = ModelConfig.from_dict({**build_moe("mixtral").config.to_dict(), "architectures": ["MixtralForCausalLM"]})
    with pytest.raises(ConfigError, match="neither dropout nor DoRA"):
        LoraConfig(target_parameters=EXPERTS, dropout=0.1).modules(sparse)


def test_finetune_an_moe_model_from_the_command_line(tmp_path, capsys):
    """finetune on a Qwen3-MoE folder with all-linear: backend auto takes the adapter (the WebGPU engine runs a
    mixture of experts), the first lines count the parameters in the experts, the loss falls, and the adapter loads
    in PEFT."""
    from finetune_helpers import build_tokenizer, make_data_dir
    from wgpu_train.cli.main import main

    model_dir = tmp_path / "model"
    vocab = build_tokenizer(model_dir)
    hf = build_moe("qwen3_moe", seed=7, vocab_size=vocab)
    save_model(hf, model_dir)
    out = tmp_path / "out"
    code = main(["finetune", "--model", str(model_dir), "--data", str(make_data_dir(tmp_path / "data")),
                 "--out", str(out), "--lora-targets", "all-linear", "--max-steps", "4", "--lr", "0.02",
                 "--no-progress", "--log-every", "1"])
    assert code == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "backend: wgpu (auto" in text and "in the experts)" in text and "experts' gate_up_proj,down_proj" in text
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line and '"step"' in line]
    assert losses[-1] < losses[0]
    pm = peft.PeftModel.from_pretrained(hf, out)
    assert any("experts.base_layer.lora_A" in n for n, _ in pm.named_parameters())


def test_greedy_generation_matches_transformers(moe):
    """The KV-cache generation through the routed experts: transformers' greedy tokens, one for one."""
    arch, hf, folder = moe
    prompt = [5, 17, 3, 40, 22]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert load_model(folder, backend="numpy").generate(prompt, max_new_tokens=8) == want


@pytest.mark.parametrize("aux", [0.0, None])
def test_three_sft_steps_equal_trl_sft_trainer(tmp_path, aux):
    """Three whole SFT steps on a Qwen3-MoE with LoRA on the attention and the experts, from the same PEFT
    adapter (B random), against TRL 1.16's SFTTrainer: every LoRA tensor after them, experts included; with the
    router's aux loss off, and on as TRL's SFTTrainer turns it on by default (the config's coefficient, which
    --router-aux-loss-coef gives here)."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune_helpers import build_tokenizer
    from wgpu_train.training.config import TrainConfig
    from wgpu_train.training.trainers import make_trainer

    model_dir = tmp_path / "model"
    vocab = build_tokenizer(model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    save_model(build_moe("qwen3_moe", seed=9, vocab_size=vocab), model_dir)
    pm = _peft(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                    experts_implementation="eager"), ["q_proj", "v_proj"], seed=2)
    pm.save_pretrained(tmp_path / "adapter")
    rows = [{"text": t} for t in ("after red 1? blue 1", "after blue 2? green two", "after green 3? red 3",
                                  "after sun 4? moon four")]
    (tmp_path / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pm.train()
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, learning_rate=0.02,
                         lr_scheduler_type="constant", max_steps=3, max_grad_norm=1.0, report_to=[], use_cpu=True,
                         save_strategy="no", seed=0, max_length=64, logging_steps=1, weight_decay=0.0, bf16=False,
                         router_aux_loss_coef=aux)      # None: TRL's default, the config's 0.001
    trainer = trl.SFTTrainer(model=pm, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    theirs = {n.replace(".default.", "."): p.detach().numpy() for n, p in pm.named_parameters() if "lora_" in n}
    cfg = TrainConfig(model=str(model_dir), data=str(tmp_path / "text.jsonl"), adapter_path=str(tmp_path / "adapter"),
                      backend="numpy", out=str(tmp_path / "ours"), batch_size=4, lr=0.02, lr_schedule="constant",
                      warmup_steps=0, max_steps=3, max_grad_norm=1.0, valid_split=0.0, eval_generate=False,
                      no_progress=True, max_seq_len=64, weight_decay=0.0,
                      router_aux_loss_coef=0.001 if aux is None else aux)
    make_trainer(cfg, log=lambda m: None).setup().train()
    if aux is None:         # both logged it, step by step
        rows = [json.loads(line) for line in (tmp_path / "ours" / "metrics.jsonl").read_text().splitlines()]
        ours_aux = [r["aux_loss"] for r in rows if "grad_norm" in r]
        trl_aux = [h["aux_loss"] for h in trainer.state.log_history if "aux_loss" in h]
        assert len(ours_aux) == len(trl_aux) == 3
        assert_close(np.array(ours_aux), np.array(trl_aux), "loss_f32", "aux_loss")
    ours = read_safetensors(tmp_path / "ours" / "adapter_model.safetensors")
    assert set(ours) == set(theirs)
    for k, v in ours.items():
        assert_close(v, theirs[k], "preference_vs_trl_params", k)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_router_aux_loss_and_its_gradient_match_transformers(arch, tmp_path):
    """With the router's auxiliary loss on (transformers' output_router_logits), the loss is the mean token loss
    plus coef times load_balancing_loss_func over the padded batch's real tokens, and every LoRA gradient
    (router and experts included) is PEFT's."""
    hf = build_moe(arch, seed=11)
    save_model(hf, tmp_path / "model")
    cfg = peft.LoraConfig(r=3, lora_alpha=7, target_modules=["q_proj"], target_parameters=EXPERTS + ["gate.weight"])
    pm = peft_random_b(peft.get_peft_model(copy.deepcopy(hf), cfg), 3)
    pm.save_pretrained(tmp_path / "adapter")
    ids, labels, mask = batch()
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels),
             output_router_logits=True)
    (out.loss - 0.001 * out.aux_loss + 0.3 * out.aux_loss).backward()      # coef 0.3: its gradient shows
    expected = {n.replace(".default.", "."): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    model = load_model(tmp_path / "model", backend="numpy")
    model.load_adapter(tmp_path / "adapter")
    model.engine.set_router_aux_loss(0.3)
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item() - 0.001 * out.aux_loss.item(), "loss_f32", "token loss")
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)
    model.engine.set_router_aux_loss(0.0)
    _, plain = model.loss_and_grads(ids, labels, mask)
    router = next(k for k in grads if ".mlp.gate.lora_A" in k)
    assert np.abs(plain[router] - grads[router]).max() > 1e-4          # the aux term moved the router's gradient


def test_router_aux_loss_is_refused_on_a_dense_model():
    from tiny_models import build_model
    from wgpu_train.engines.loading import model_from_weights
    hf = build_model("llama")
    cfg = ModelConfig.from_dict({**hf.config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    model = model_from_weights(cfg, {k: v.numpy() for k, v in hf.state_dict().items()}, backend="numpy")
    with pytest.raises(ConfigError, match="not a mixture of experts"):
        model.engine.set_router_aux_loss(0.01)


def test_router_aux_loss_and_expert_targets_from_the_command_line(tmp_path):
    """--lora-target-parameters names the experts; --router-aux-loss-coef turns the loss on (logged as aux_loss
    each step, as TRL logs it); on a dense model it is refused in one line."""
    from finetune_helpers import build_tokenizer, make_data_dir, make_model_dir
    from wgpu_train.cli.main import main

    model_dir = tmp_path / "model"
    vocab = build_tokenizer(model_dir)
    save_model(build_moe("mixtral", seed=7, vocab_size=vocab), model_dir)
    data = make_data_dir(tmp_path / "data")
    out = tmp_path / "out"
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--max-steps", "2",
                 "--lora-targets", "q_proj", "--lora-target-parameters", "mlp.experts.down_proj",
                 "--router-aux-loss-coef", "0.02", "--no-progress", "--log-every", "1"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "grad_norm" in r]
    assert len(steps) == 2 and all(r["aux_loss"] > 0 for r in steps)
    raw = json.loads((out / "adapter_config.json").read_text())
    assert raw["target_parameters"] == ["mlp.experts.down_proj"] and raw["target_modules"] == ["q_proj"]
    dense = make_model_dir(tmp_path / "dense")
    code = main(["finetune", "--model", str(dense), "--data", str(data), "--out", str(tmp_path / "o2"),
                 "--max-steps", "1", "--router-aux-loss-coef", "0.02", "--backend", "numpy", "--no-progress"])
    assert code == 2


def test_a_server_takes_expert_adapters_one_at_a_time(moe, tmp_path):
    """Adapters with LoRA on the experts are not put in one bank (its per-row GEMMs do not route): the server
    switches them, and each adapter's tokens are its own."""
    from wgpu_train.serve.adapters import AdapterRegistry
    from wgpu_train.serve.prompts import PromptStyle

    arch, hf, folder = moe
    for seed, name in ((1, "a"), (2, "b")):
        _peft(hf, ["q_proj"], seed=seed).save_pretrained(tmp_path / name)
    model = load_model(folder, backend="numpy")
    registry = AdapterRegistry(model, "base")
    for name in "ab":
        registry.add(name, tmp_path / name, PromptStyle())
    assert not registry.build_bank()
    prompt = [4, 9, 13, 2]
    outs = {}
    for name in "ab":
        registry.activate(name)
        outs[name] = model.generate(prompt, max_new_tokens=6)
        alone = load_model(folder, backend="numpy")
        alone.load_adapter(tmp_path / name)
        assert alone.generate(prompt, max_new_tokens=6) == outs[name]
