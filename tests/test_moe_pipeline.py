"""The rest of the pipeline on a tiny Qwen3-MoE on the NumPy engine, with LoRA on the attention and the experts
(PEFT's target_parameters): a DPO step against TRL's DPOTrainer, a GRPO step, `eval`'s loss against
transformers, `generate`'s greedy tokens against transformers', and one request through `serve`."""
from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import peft
import pytest

from finetune_helpers import build_tokenizer, first_step_gradients_callback, records, write_jsonl
from tiny_models import build_moe, save_model
from tolerances import assert_close
from wgpu_train.cli.main import main
from wgpu_train.errors import ConfigError
from wgpu_train.training.config import TrainConfig
from wgpu_train.training.preference_trainer import PreferenceTrainer

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

PAIRS = [{"prompt": f"after {a} {i}?", "chosen": f" {b} {i}", "rejected": f" {c} {i}"}
         for i, (a, b, c) in enumerate([("red", "blue", "green"), ("cat", "dog", "sun"), ("moon", "tree", "red"),
                                        ("blue", "green", "moon")])]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """root/model: a tiny Qwen3-MoE (a dense layer among the sparse ones, tied embeddings) with a tokenizer that
    transformers reads as this folder's tokenizer.json; root/adapter: PEFT's LoRA on q / v and the experts (B
    random); root/pairs.jsonl, root/data (SFT records)."""
    root = tmp_path_factory.mktemp("moe_pipeline")
    folder = root / "model"
    vocab = build_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    hf = build_moe("qwen3_moe", seed=5, vocab_size=vocab)
    save_model(hf, folder)
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                                 target_modules=["q_proj", "v_proj"],
                                                                 target_parameters=EXPERTS))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn_like(p))
    pm.save_pretrained(root / "adapter")
    write_jsonl(root / "pairs.jsonl", PAIRS)
    (root / "data").mkdir()
    write_jsonl(root / "data" / "train.jsonl", records(6))
    write_jsonl(root / "data" / "test.jsonl", records(3, offset=200))
    return root, hf


def test_dpo_steps_equal_trl(moe, tmp_path):
    """DPO (sigmoid) through the routed experts, two steps: TRL's losses and margins (the first is log 2: the
    reference is the adapter as loaded, in TRL and here), and the adapter after them, the experts' LoRA included
    (TRL's router aux loss off: its DPOTrainer adds it on any MoE config by default)."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _ = moe
    folder = root / "model"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, experts_implementation="eager")
    pm = peft.PeftModel.from_pretrained(hf, str(root / "adapter"), is_trainable=True)
    grabber = first_step_gradients_callback(pm)
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(PAIRS), learning_rate=5e-3,
                         lr_scheduler_type="constant", max_steps=2, logging_steps=1, max_grad_norm=1.0,
                         report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0, max_length=64,
                         loss_type=["sigmoid"], beta=0.1, router_aux_loss_coef=0.0)
    trainer = trl.DPOTrainer(model=pm, args=args, train_dataset=datasets.Dataset.from_list(PAIRS),
                             processing_class=AutoTokenizer.from_pretrained(str(folder)), callbacks=[grabber])
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    after = {n.replace(".default.", "."): p.detach().numpy() for n, p in pm.named_parameters() if ".default." in n}

    cfg = TrainConfig(model=str(folder), data=str(root / "pairs.jsonl"), adapter_path=str(root / "adapter"),
                      backend="numpy", out=str(tmp_path / "run"), batch_size=len(PAIRS), lr=5e-3,
                      lr_schedule="constant", warmup_steps=0, max_steps=2, max_grad_norm=1.0, valid_split=0.0,
                      log_every=1, eval_generate=False, no_progress=True, max_seq_len=64, objective="dpo",
                      dpo_loss="sigmoid", beta=0.1)
    ours = PreferenceTrainer(cfg, log=lambda m: None).setup()
    ours.train()
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if "grad_norm" in line]
    assert len(steps) == len(history) == 2 and abs(history[1]["loss"] - math.log(2)) > 1e-3
    for mine, theirs in zip(steps, history):
        for key in ("loss", "rewards/margins"):
            assert_close(np.float64(mine[key]), np.float64(theirs[key]), "preference_vs_trl_loss", key)
    assert any("experts" in k for k in grabber.grads)
    with pytest.raises(ConfigError, match="router's aux loss .* is trained with sft only for now, not dpo"):
        PreferenceTrainer(dataclasses.replace(cfg, router_aux_loss_coef=0.001, out=str(tmp_path / "aux")),
                          log=lambda m: None).setup()
    mine = peft.PeftModel.from_pretrained(copy.deepcopy(moe[1]), tmp_path / "run")
    trained = {n.replace(".default.", "."): p.detach().numpy() for n, p in mine.named_parameters() if "lora_" in n}
    assert set(trained) == set(after)
    for k, v in trained.items():
        assert_close(v, after[k], "preference_vs_trl_params", k)


def _length(prompts, completions, **kw):
    """A reward that differs between a random model's completions: their length."""
    return [len(c) / 10 for c in completions]


def test_one_grpo_step_trains_the_experts(moe, tmp_path):
    """GRPO one step: completions generated through the routed experts, a nonzero gradient, and the experts'
    LoRA changed by the step."""
    from wgpu_train.adapters.files import read_adapter
    from wgpu_train.distributed.dispatch import finetune

    root, _ = moe
    prompts = [{"prompt": f"after {w} {i}?", "answer": f"{w} {i}"} for i, w in enumerate(["red", "cat", "sun", "dog"])]
    write_jsonl(tmp_path / "prompts.jsonl", prompts)
    out = tmp_path / "grpo"
    summary = finetune(TrainConfig(
        model=str(root / "model"), adapter_path=str(root / "adapter"), data=str(tmp_path / "prompts.jsonl"),
        out=str(out), backend="numpy", no_progress=True, lr=2e-2, log_every=1, objective="grpo", batch_size=4,
        max_steps=1, valid_split=0.0, lr_schedule="constant", num_generations=4, max_completion_length=5,
        reward="word_positions", eval_generate=False, seed=3, temperature=1.5), reward_funcs=[_length])
    assert summary["steps"] == 1
    step = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "grad_norm" in line][0]
    assert step["grad_norm"] > 0 and math.isfinite(step["loss"])
    before, after = read_adapter(root / "adapter")[1], read_adapter(out)[1]
    moved = [k for k in before if "experts" in k and not np.array_equal(before[k], after[k])]
    assert moved, "the experts' LoRA did not change"


def test_eval_loss_and_generate_equal_transformers(moe, capsys):
    """`eval --no-generate`'s loss is transformers' mean token loss of the PEFT model over the same tokens;
    `generate`'s greedy tokens are transformers' with the adapter, one for one."""
    from wgpu_train.cli.commands import prompt_ids
    from wgpu_train.formats.tokenizer import load_tokenizer

    root, hf = moe
    folder, adapter = root / "model", root / "adapter"
    capsys.readouterr()
    assert main(["eval", "--model", str(folder), "--adapter-path", str(adapter), "--data", str(root / "data"),
                 "--no-generate", "--json", "--backend", "numpy"]) == 0
    result = json.loads(capsys.readouterr().out)
    import wgpu_train as wt
    from wgpu_train.data.tokenize import tokenize_dataset

    model = wt.load_model(folder, backend="numpy")
    model.load_adapter(adapter)
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), adapter).eval()
    tok = load_tokenizer(folder)
    from wgpu_train.data.sources import resolve_data

    examples, _ = tokenize_dataset(tok, resolve_data(root / "data").test, 64)
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor([ex.input_ids])
            labels = torch.tensor([ex.labels])
            logits = pm(input_ids=ids).logits[0, :-1]
            target = labels[0, 1:]
            keep = target >= 0
            total += float(torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum"))
            count += int(keep.sum())
    assert result["samples"] == 3
    assert_close(np.float64(result["loss"]), np.float64(total / count), "loss_f32", "eval loss")

    ids = prompt_ids(tok, "after red 1?")
    with torch.no_grad():
        want = pm.generate(input_ids=torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    assert model.generate(ids, max_new_tokens=6) == want


def test_serve_answers_one_request_with_the_expert_adapter(moe):
    """One chat request through the HTTP server with the expert adapter: the greedy answer of the model with
    that adapter loaded."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    import wgpu_train as wt
    from wgpu_train.cli.commands import prompt_ids
    from wgpu_train.cli.main import build_parser
    from wgpu_train.cli.serve import prepare
    from wgpu_train.formats.tokenizer import load_tokenizer
    from wgpu_train.serve.app import build_app
    from wgpu_train.serve.server import ServerThread

    root, _ = moe
    folder, adapter = root / "model", root / "adapter"
    args = build_parser().parse_args(["serve", "--model", str(folder), "--adapter", f"a={adapter}",
                                      "--backend", "numpy", "--port", "0", "--api-key", "k"])
    scheduler, sock = prepare(args)
    scheduler.start()
    thread = ServerThread(build_app(scheduler, args.api_key), sock).start()
    try:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="k", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "after cat 3?"}],
                                           max_tokens=6, temperature=0)
    finally:
        thread.stop()
        scheduler.close()
    tok = load_tokenizer(folder)
    model = wt.load_model(folder, backend="numpy")
    model.load_adapter(adapter)
    new = model.generate(prompt_ids(tok, "after cat 3?"), max_new_tokens=6, stop_token_ids=tok.stop_token_ids)
    assert r.choices[0].message.content == tok.decode([t for t in new if t not in set(tok.stop_token_ids)])
    assert r.usage.completion_tokens == len(new)
