"""Tests of the finetune / generate / eval / merge subcommands: options from TrainConfig, TOML resolution,
one-line errors with exit code 2, and the commands end to end on the NumPy backend."""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from finetune_helpers import folder_state, make_data_dir, make_model_dir, one_line_error, records, write_jsonl
from tolerances import assert_close
from wgpu_train.cli.main import build_parser, main
from wgpu_train.cli.commands import prompt_ids, resolve_train_config
from wgpu_train.formats.safetensors import read_safetensors
from wgpu_train.engines.loading import load_model
from wgpu_train.formats.tokenizer import load_tokenizer
from wgpu_train.training.config import TrainConfig


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return make_model_dir(root / "model"), make_data_dir(root / "data")


@pytest.fixture(scope="module")
def trained(workspace, tmp_path_factory):
    """One finetune through the command line, with a TOML file and command-line overrides."""
    model, data = workspace
    root = tmp_path_factory.mktemp("trained")
    toml = root / "run.toml"
    toml.write_text('lr = 0.02\nmax-steps = 4\nbatch_size = 3\nlora_targets = ["q_proj", "o_proj"]\n'
                    f'data = "{data}"\nno_progress = true\n')
    out = root / "out"
    code = main(["finetune", "--config", str(toml), "--model", str(model), "--out", str(out), "--backend", "numpy",
                 "--max-steps", "3", "--eval-generate", "--max-new-tokens", "4", "--log-every", "1"])
    assert code == 0
    return out


# ---- help and options -----------------------------------------------------------------------------------

def test_every_train_config_field_is_an_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["finetune", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in text, f.name
    assert "--config" in text and "--no-pack" in text and "--no-eval-generate" in text
    assert "rank-stabilised LoRA" in text and "(default: 8)" in text


@pytest.mark.parametrize("command, options", [
    ("generate", ["--model", "--adapter-path", "--prompt", "--system", "--no-chat-template", "--max-new-tokens",
                  "--temperature", "--top-k", "--top-p", "--seed", "--backend", "--device", "--base-dtype",
                  "--embed-dtype"]),
    ("eval", ["--model", "--adapter-path", "--data", "--json", "--split", "--batch-size", "--backend",
              "--base-dtype", "--embed-dtype"]),
    ("merge", ["--model", "--adapter-path", "--out"]),
])
def test_subcommand_help(capsys, command, options):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for option in options:
        assert option in text, option


# ---- TOML resolution ------------------------------------------------------------------------------------

def test_command_line_over_toml_over_defaults(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('lr = 0.5\nbatch-size = 3\npack = true\nlora_targets = "all-linear"\nmax_steps = 7\n')
    args = build_parser().parse_args(["finetune", "--config", str(toml), "--lr", "0.1", "--no-pack"])
    cfg = resolve_train_config(args)
    assert cfg.lr == 0.1 and cfg.pack is False            # command line
    assert cfg.batch_size == 3 and cfg.max_steps == 7     # TOML
    assert cfg.lora_targets == "all-linear"
    assert cfg.epochs == TrainConfig().epochs and cfg.output_dir() == Path("wgpu-train-out")   # defaults
    cfg = resolve_train_config(build_parser().parse_args(["finetune", "--max-steps", "none", "--rslora",
                                                          "--gradient-checkpointing"]))
    assert cfg.max_steps is None and cfg.rslora is True and cfg.gradient_checkpointing is True


def test_trained_via_cli(trained, workspace):
    resolved = json.loads((trained / "train_config.json").read_text())
    assert resolved["lr"] == 0.02 and resolved["batch_size"] == 3           # from TOML
    assert resolved["max_steps"] == 3 and resolved["eval_generate"] is True  # the command line wins
    assert resolved["lora_targets"] == "q_proj,o_proj"
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["exact_match_after"] is not None
    cfg = json.loads((trained / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["q_proj", "o_proj"] and cfg["peft_type"] == "LORA"


# ---- one-line errors --------------------------------------------------------------------------------------

def test_bad_toml(capsys, tmp_path, workspace):
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("learning_rate = 0.1\n")
    one_line_error(capsys, ["finetune", "--config", str(unknown)], "unknown key 'learning_rate'")
    broken = tmp_path / "broken.toml"
    broken.write_text("lr = = 1\n")
    one_line_error(capsys, ["finetune", "--config", str(broken)], "invalid TOML")
    typed = tmp_path / "typed.toml"
    typed.write_text('batch_size = "four"\n')
    one_line_error(capsys, ["finetune", "--config", str(typed)], "key 'batch_size' must be an int")
    one_line_error(capsys, ["finetune", "--config", str(tmp_path / "none.toml")], "config file not found")


def test_bad_options(capsys, tmp_path, workspace):
    model, data = workspace
    one_line_error(capsys, ["finetune", "--lr", "fast"], "invalid float value: 'fast'")
    one_line_error(capsys, ["finetune", "--backend", "cuda"], "invalid choice: 'cuda'")
    one_line_error(capsys, ["finetune", "--bogus"], "unrecognized arguments: --bogus")
    one_line_error(capsys, ["finetune", "--batch-size", "0"], "batch_size must be at least 1")
    one_line_error(capsys, ["finetune", "--lora-targets", "foo_proj"], "foo_proj")
    one_line_error(capsys, ["finetune", "--model", str(model), "--data", str(tmp_path / "nope.jsonl"),
                            "--out", str(tmp_path / "o"), "--backend", "numpy"], "no such file")
    one_line_error(capsys, ["finetune", "--model", str(tmp_path / "nomodel"), "--data", str(data),
                            "--out", str(tmp_path / "o"), "--backend", "numpy"], "nomodel")
    one_line_error(capsys, ["generate", "--model", str(model), "--adapter-path", str(model), "--prompt", "hi"],
                   "is a model folder, not an adapter")
    one_line_error(capsys, ["generate", "--model", str(model), "--prompt", "hi", "--top-p", "-0.1",
                            "--backend", "numpy"], "top_p")
    one_line_error(capsys, ["eval", "--model", str(model), "--data", str(data), "--split", "test2"], "invalid choice")
    one_line_error(capsys, ["merge", "--model", str(model), "--out", str(tmp_path / "m")], "--adapter-path")


def test_subprocess_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "wgpu_train.cli", "finetune", "--data", str(tmp_path / "x.jsonl"),
                           "--model", str(tmp_path), "--backend", "numpy", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()][-1].startswith("error: ")


def test_ctrl_c_before_the_first_step(workspace, tmp_path, capsys, monkeypatch):
    """Ctrl-C during the evaluation before training: exit 130, no "wrote adapter" claim, no folder left."""
    import os
    import signal

    from wgpu_train.training import trainer as train

    before = train.Trainer._evaluate_before

    def interrupted(self):
        os.kill(os.getpid(), signal.SIGINT)
        before(self)

    monkeypatch.setattr(train.Trainer, "_evaluate_before", interrupted)
    model, data = workspace
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(model), "--data", str(data), "--out", str(out), "--backend", "numpy",
                 "--no-progress"]) == 130
    captured = capsys.readouterr()
    assert "wrote" not in captured.out and "nothing trained" in captured.err and not out.exists()


def test_finetune_into_an_earlier_run(capsys, trained, workspace, tmp_path):
    model, data = workspace
    run = ["finetune", "--model", str(model), "--data", str(data), "--backend", "numpy", "--no-progress"]
    before = folder_state(trained)
    one_line_error(capsys, run + ["--out", str(trained)],
                   f"the output folder {trained} already holds a run (adapter_config.json, adapter_model.safetensors, "
                   f"checkpoints/, metrics.jsonl, summary.json, train_config.json); pass --overwrite to replace it, "
                   f"--resume {trained} to continue it, or choose another --out")
    assert folder_state(trained) == before

    out = tmp_path / "out"
    shutil.copytree(trained, out)
    assert main(run + ["--out", str(out), "--max-steps", "2", "--overwrite"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["resumed_from"] is None
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]
    assert main(run + ["--out", str(out), "--max-steps", "3", "--resume", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 3

    (tmp_path / "empty").mkdir()
    assert main(run + ["--out", str(tmp_path / "empty"), "--max-steps", "1"]) == 0
    assert (tmp_path / "empty" / "adapter_model.safetensors").is_file()


# ---- generate, eval, merge --------------------------------------------------------------------------------

def test_generate_streams_the_adapted_models_answer(trained, workspace, capsys):
    model_dir, _ = workspace
    # --model is left out: the adapter's base model folder is used
    code = main(["generate", "--adapter-path", str(trained), "--prompt", "after red 1?", "--max-new-tokens", "7",
                 "--backend", "numpy"])
    assert code == 0
    printed = capsys.readouterr().out
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir)
    model.load_adapter(trained)
    ids = model.generate(prompt_ids(tok, "after red 1?"), max_new_tokens=7, stop_token_ids=tok.stop_token_ids)
    expected = tok.decode([i for i in ids if i not in tok.stop_token_ids])
    assert printed == expected + "\n"


def test_generate_streams_as_tokens_come(workspace, monkeypatch):
    model_dir, _ = workspace
    writes = []

    class Out:
        def write(self, s):
            writes.append(s)

        def flush(self):
            writes.append(None)

    monkeypatch.setattr(sys, "stdout", Out())
    assert main(["generate", "--model", str(model_dir), "--prompt", "hi", "--system", "be brief",
                 "--max-new-tokens", "5", "--temperature", "0.8", "--top-k", "20", "--seed", "3",
                 "--backend", "numpy"]) == 0
    pieces = [w for w in writes if w]
    assert len(pieces) >= 2                      # written piece by piece, each flushed
    assert writes.count(None) >= len(pieces) - 1


def test_eval_json(trained, workspace, capsys):
    model_dir, data = workspace
    code = main(["eval", "--model", str(model_dir), "--adapter-path", str(trained), "--data", str(data), "--json",
                 "--max-new-tokens", "4", "--backend", "numpy"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["split"] == "test" and result["samples"] == 3
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert result["exact_match_n"] == 3 and 0 <= result["exact_match"] <= 1
    summary = json.loads((trained / "summary.json").read_text())
    assert result["exact_match"] == summary["exact_match_after"]
    assert main(["eval", "--model", str(model_dir), "--data", str(data / "valid.jsonl"), "--no-generate",
                 "--backend", "numpy"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("train (") and "perplexity" in line and "exact match" not in line


def test_eval_split_valid_of_one_file_is_what_the_run_held_out(workspace, tmp_path, capsys):
    """finetune on one file holds out a seeded fraction as valid; eval --split valid on that file finds the same
    records (the run's valid_split and seed) and gives the run's validation loss; --split train is the rest."""
    model_dir, _ = workspace
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, records(12))
    run = tmp_path / "run"
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(run), "--backend", "numpy",
                 "--max-steps", "2", "--valid-split", "0.25", "--seed", "5", "--no-progress"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    capsys.readouterr()
    argv = ["eval", "--model", str(model_dir), "--adapter-path", str(run), "--data", str(data), "--backend", "numpy",
            "--no-generate", "--json"]
    assert main(argv + ["--split", "valid"]) == 0
    valid = json.loads(capsys.readouterr().out)
    assert (valid["split"], valid["samples"]) == ("valid", 3)
    assert_close(valid["loss"], summary["valid_loss_after"], "loss_f32", "eval")
    assert main(argv + ["--split", "train"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 9


def test_generate_and_eval_store_the_base_as_the_adapter_was_trained(workspace, tmp_path, capsys):
    """An adapter trained over NF4 base weights is evaluated and used over NF4 weights unless --base-dtype
    says otherwise; the choice is said on stderr and reported by eval --json."""
    model_dir, data = workspace
    out = tmp_path / "qlora"
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--backend", "numpy",
                 "--max-steps", "2", "--base-dtype", "nf4", "--embed-dtype", "float16", "--no-progress"]) == 0
    capsys.readouterr()
    common = ["--model", str(model_dir), "--adapter-path", str(out), "--backend", "numpy"]
    assert main(["eval", *common, "--data", str(data), "--json", "--no-generate"]) == 0
    captured = capsys.readouterr()
    inherited = json.loads(captured.out)
    assert (inherited["base_dtype"], inherited["embed_dtype"]) == ("nf4", "float16")
    assert "--base-dtype nf4, --embed-dtype float16" in captured.err
    assert main(["eval", *common, "--data", str(data), "--json", "--no-generate", "--base-dtype", "float32"]) == 0
    captured = capsys.readouterr()
    chosen = json.loads(captured.out)
    assert (chosen["base_dtype"], chosen["embed_dtype"]) == ("float32", "float16")
    assert "--embed-dtype float16" in captured.err and "nf4" not in captured.err
    assert chosen["loss"] != inherited["loss"]
    # a checkpoint (its folder, or the adapter inside it) is read the same way, from its trainer_state.json
    ckpt = out / "checkpoints" / "step-000002"
    for path in (ckpt, ckpt / "adapter"):
        assert main(["eval", "--model", str(model_dir), "--adapter-path", str(path), "--backend", "numpy",
                     "--data", str(data), "--json", "--no-generate"]) == 0
        assert json.loads(capsys.readouterr().out)["loss"] == inherited["loss"]
    assert main(["generate", *common, "--prompt", "after red 1?", "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, base_dtype="nf4", embed_dtype="float16")
    model.load_adapter(out)
    ids = model.generate(prompt_ids(tok, "after red 1?"), max_new_tokens=6, stop_token_ids=tok.stop_token_ids)
    assert printed == tok.decode([i for i in ids if i not in tok.stop_token_ids]) + "\n"
    # merge adds the update to the original float32 weights, not to the NF4-rounded ones
    assert main(["merge", "--model", str(model_dir), "--adapter-path", str(out), "--out", str(tmp_path / "m")]) == 0
    assert "settings of the run" not in capsys.readouterr().err
    merged = read_safetensors(tmp_path / "m" / "model.safetensors")
    base = read_safetensors(model_dir / "model.safetensors")
    assert all(np.array_equal(merged[k], base[k]) for k in base if "q_proj" not in k and "v_proj" not in k)
    assert not np.array_equal(merged["model.layers.0.self_attn.q_proj.weight"],
                              base["model.layers.0.self_attn.q_proj.weight"])


def test_memory_estimate_from_config_alone(workspace, tmp_path, capsys):
    """`wgpu-train memory` reads only config.json: its figures are estimate_memory's, e.g. Llama-2-7B's shape with
    NF4, LoRA r=16 on all linear layers and gradient checkpointing at 1 x 512 tokens."""
    from wgpu_train.adapters.config import LoraConfig
    from wgpu_train.models.config import ModelConfig
    from wgpu_train.engines.webgpu.memory import estimate_memory

    folder = tmp_path / "llama7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}))
    argv = ["memory", "--model", str(folder), "--batch-size", "1", "--max-seq-len", "512", "--base-dtype", "nf4",
            "--lora-rank", "16", "--lora-targets", "all-linear", "--gradient-checkpointing"]
    assert main(argv + ["--json", "--precision", "bf16"]) == 0
    result = json.loads(capsys.readouterr().out)
    # a GPU's precision, bf16 activations
    want = estimate_memory(ModelConfig.from_folder(folder), 1, 512, LoraConfig(r=16, target_modules="all-linear"),
                           "lora", "nf4", "float16", True, precision="bf16")
    assert {k: result[k] for k in want} == want and result["embed_dtype"] == "float16"
    assert result["parameters"] == 6_738_415_616 and round(want["total"] / 2**30, 2) == 4.77
    assert (result["precision"], result["precision_reason"]) == ("bf16", "as given")
    assert main(argv + ["--precision", "fp32"]) == 0
    assert "total                5.03 GiB" in capsys.readouterr().out
    one_line_error(capsys, ["memory", "--model", str(tmp_path / "nope")], "not found")
    one_line_error(capsys, ["memory", "--model", str(folder), "--method", "full", "--base-dtype", "nf4"], "float32")
    # the default base dtype, auto: a bf16 checkpoint's weights in bfloat16, half their float32 bytes; method full:
    # float32
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "torch_dtype": "bfloat16"}))
    plain = ["memory", "--model", str(folder), "--batch-size", "1", "--max-seq-len", "512", "--json"]
    assert main(plain) == 0
    auto = json.loads(capsys.readouterr().out)
    assert main(plain + ["--base-dtype", "float32"]) == 0
    f32 = json.loads(capsys.readouterr().out)
    assert (auto["base_dtype"], auto["embed_dtype"]) == ("bfloat16", "bfloat16")
    assert auto["weights"] / f32["weights"] == pytest.approx(0.5, abs=1e-3)
    assert main(plain + ["--method", "full"]) == 0
    assert json.loads(capsys.readouterr().out)["base_dtype"] == "float32"


@pytest.mark.parametrize("backend, adapters, want, why", [
    ("numpy", ["DiscreteGPU"], "fp32", "auto: the NumPy engine is the float32 reference"),
    ("auto", [], "fp32", "auto: the NumPy engine is the float32 reference"),
    ("auto", ["CPU"], "fp32", "auto: the only WebGPU adapters here are CPUs"),
    ("wgpu", ["CPU"], "fp32", "auto: a CPU adapter"),
    ("auto", ["CPU", "DiscreteGPU"], "bf16", "auto: a GPU"),
    ("wgpu", [], "bf16", "no WebGPU adapter here, so a GPU's"),
])
def test_memory_uses_the_precision_the_run_will(tmp_path, capsys, monkeypatch, backend, adapters, want, why):
    """memory's --precision auto is what the run takes on the engine --backend chooses here (the NumPy engine and
    CPU adapters: fp32), said with its reason, and the estimate is that precision's."""
    from types import SimpleNamespace

    from wgpu_train.engines import resources

    found = [SimpleNamespace(adapter_type=kind) for kind in adapters]
    monkeypatch.setattr(resources, "devices", lambda: found)
    monkeypatch.setattr(resources, "choose_adapter", lambda spec=None: next(
        (a for a in found if a.adapter_type != "CPU"), found[0]))
    model_dir = tmp_path / "model"          # even widths, which 16-bit activations can store
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5}))
    argv = ["memory", "--model", str(model_dir), "--json"]
    assert main(argv + ["--backend", backend]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["precision"] == want and why in auto["precision_reason"], auto["precision_reason"]
    assert main(argv + ["--precision", want]) == 0
    given = json.loads(capsys.readouterr().out)
    assert main(argv + ["--precision", "fp32" if want == "bf16" else "bf16"]) == 0
    other = json.loads(capsys.readouterr().out)
    assert auto["activations"] == given["activations"] != other["activations"]
    assert main(["memory", "--model", str(model_dir), "--backend", backend]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert f"precision {want} (auto: " in head and why in head, head


def test_memory_refuses_zero_pipeline_stages(capsys):
    """As finetune and serve refuse it: one line, exit 2."""
    one_line_error(capsys, ["memory", "--pipeline-stages", "0"], "argument --pipeline-stages: must be at least 1, got 0")


def test_merge(trained, workspace, tmp_path, capsys):
    model_dir, _ = workspace
    out = tmp_path / "merged"
    assert main(["merge", "--model", str(model_dir), "--adapter-path", str(trained), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    adapted = load_model(model_dir)
    adapted.load_adapter(trained)
    ids = np.array([[5, 40, 77, 12, 9]])
    np.testing.assert_allclose(load_model(out).logits(ids), adapted.logits(ids), rtol=1e-4, atol=1e-4)


def _merge_loads_in_transformers(model_dir, run, merged, ids):
    """`merge` the run's adapter into `merged`; transformers' logits there equal ours with the adapter."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    assert main(["merge", "--model", str(model_dir), "--adapter-path", str(run), "--out", str(merged)]) == 0
    ids = np.array([ids])
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    adapted = load_model(model_dir)
    adapted.load_adapter(run)
    np.testing.assert_allclose(theirs, adapted.logits(ids), rtol=1e-4, atol=1e-4)


def test_gemma2_finetune_generate_merge(workspace, tmp_path, capsys):
    """A Gemma 2 folder through the command line on the WebGPU engine: finetune, generate, then merge, whose
    folder transformers loads to our merged logits (soft-caps, sandwich norms and GeGLU included)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _, data = workspace
    model_dir = make_model_dir(tmp_path / "gemma2", arch="gemma2")
    run = tmp_path / "run"
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(run), "--backend", "wgpu",
                 "--max-steps", "3", "--lora-targets", "all-linear", "--lr", "0.01", "--no-progress"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and math.isfinite(summary["train_loss_last"])
    assert main(["generate", "--model", str(model_dir), "--adapter-path", str(run), "--prompt", "hello",
                 "--max-new-tokens", "3", "--backend", "wgpu"]) == 0
    _merge_loads_in_transformers(model_dir, run, tmp_path / "merged", [5, 40, 77, 12, 9, 3])
    capsys.readouterr()


def test_phi3_finetune_generate_merge(workspace, tmp_path, capsys):
    """A Phi-3 folder (fused projections, partial rotary under longrope) through the command line on the WebGPU
    engine: finetune with LoRA on the fused modules, generate, merge, whose folder transformers loads to our
    merged logits; Llama's split target names get one line naming Phi-3's modules."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _, data = workspace
    model_dir = make_model_dir(tmp_path / "phi3", arch="phi3")
    run = tmp_path / "run"
    capsys.readouterr()
    one_line_error(capsys, ["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(run),
                            "--lora-targets", "k_proj,v_proj", "--no-progress"], "k_proj,v_proj: Phi3ForCausalLM")
    assert not run.exists()
    # the default targets (q_proj,v_proj) are Phi-3's qkv_proj; continuing that adapter needs no --lora-targets
    first = tmp_path / "first"
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(first), "--max-steps", "1",
                 "--no-progress"]) == 0
    assert json.loads((first / "adapter_config.json").read_text())["target_modules"] == ["qkv_proj"]
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "again"),
                 "--max-steps", "1", "--adapter-path", str(first), "--no-progress"]) == 0
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(run), "--backend", "wgpu",
                 "--max-steps", "3", "--lora-targets", "qkv_proj,gate_up_proj", "--lr", "0.01", "--no-progress"]) == 0
    assert json.loads((run / "adapter_config.json").read_text())["target_modules"] == \
        ["qkv_proj", "gate_up_proj"]
    assert main(["generate", "--model", str(model_dir), "--adapter-path", str(run), "--prompt", "hello",
                 "--max-new-tokens", "3", "--backend", "wgpu"]) == 0
    # 10 tokens: past the original 8, the long factors
    _merge_loads_in_transformers(model_dir, run, tmp_path / "merged", [5, 40, 77, 12, 9, 3, 8, 21, 30, 2])
    capsys.readouterr()


# ---- run settings: epochs against a recipe's max_steps, resume, the adapter's prompt settings ---------------

def test_epochs_given_drop_the_recipes_max_steps(capsys, tmp_path):
    """The default run's recipe sets max_steps, which would silently win over --epochs; --epochs alone drops
    it, and both given keep max_steps (TrainConfig's meaning) with a note."""
    cfg = resolve_train_config(build_parser().parse_args(["finetune", "--epochs", "2"]))
    assert (cfg.epochs, cfg.max_steps) == (2, None) and cfg.lora_targets == "all-linear"   # the rest of the recipe
    assert resolve_train_config(build_parser().parse_args(["finetune"])).max_steps == 150
    toml = tmp_path / "e.toml"
    toml.write_text("epochs = 1\n")
    assert resolve_train_config(build_parser().parse_args(["finetune", "--config", str(toml)])).max_steps is None
    capsys.readouterr()
    cfg = resolve_train_config(build_parser().parse_args(["finetune", "--config", str(toml), "--max-steps", "5"]))
    assert (cfg.epochs, cfg.max_steps) == (1, 5)
    assert capsys.readouterr().err == "note: max_steps 5 overrides epochs 1 (both given; epochs is ignored when " \
                                      "max_steps is set)\n"


def test_toml_key_in_both_spellings(capsys, tmp_path):
    toml = tmp_path / "twice.toml"
    toml.write_text("lora-rank = 4\nlora_rank = 8\n")
    one_line_error(capsys, ["finetune", "--config", str(toml)], "'lora-rank' and 'lora_rank' are the same key")


def test_resume_takes_the_runs_settings(trained, workspace, tmp_path, capsys):
    """--resume alone continues the run as it was configured (model, data, LoRA, lr, batch) in its folder;
    options given win, and --epochs given replaces the run's max_steps."""
    model_dir, data = workspace
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    for path in (run, run / "checkpoints", run / "checkpoints" / "step-000003"):
        cfg = resolve_train_config(build_parser().parse_args(["finetune", "--resume", str(path), "--lr", "0.05"]))
        assert (cfg.model, cfg.data) == (str(model_dir), str(data))
        assert (cfg.lr, cfg.batch_size, cfg.lora_targets, cfg.max_steps) == (0.05, 3, "q_proj,o_proj", 3)
        assert cfg.output_dir() == run and cfg.resume == str(path)
    cfg = resolve_train_config(build_parser().parse_args(["finetune", "--resume", str(run), "--epochs", "2"]))
    assert (cfg.epochs, cfg.max_steps) == (2, None)
    assert main(["finetune", "--resume", str(run), "--max-steps", "4", "--no-progress"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from"].endswith("step-000003")
    assert json.loads((run / "train_config.json").read_text())["lora_targets"] == "q_proj,o_proj"


@pytest.mark.parametrize("objective", ["grpo", "dpo"])
def test_a_plain_resume_of_an_embedded_demo(objective, tmp_path, capsys, monkeypatch):
    """The embedded demos (no --model, no --data) record no data, so that `--resume` alone builds the demo's
    records again (DPO's pairs, GRPO's prompts) with its defaults (GRPO's word_positions reward), and trains the
    steps the uninterrupted run did. (The validation loss of DPO's 100 held-out pairs is left out: it is slow.)"""
    from wgpu_train.training.preference_trainer import PreferenceTrainer

    monkeypatch.setattr(PreferenceTrainer, "evaluate", lambda self: None)
    small = {"grpo": ["--batch-size", "8", "--num-generations", "4", "--max-completion-length", "4"],
             "dpo": ["--batch-size", "4"]}[objective]
    runs = {}
    for name, steps in (("whole", "2"), ("part", "1")):
        runs[name] = tmp_path / name
        assert main(["finetune", "--objective", objective, "--backend", "numpy", "--max-steps", "2",
                     "--save-every", steps, "--no-eval-generate", "--no-progress", "--out", str(runs[name])]
                    + small) == 0
    recorded = json.loads((runs["part"] / "train_config.json").read_text())
    assert recorded["data"] is None and recorded["reward"] is None
    part = runs["part"]
    shutil.rmtree(part / "checkpoints" / "step-000002")         # as if stopped after step 1
    capsys.readouterr()
    assert main(["finetune", "--resume", str(part), "--no-progress"]) == 0
    summary = json.loads((part / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["resumed_from"].endswith("step-000001")
    whole = json.loads((runs["whole"] / "summary.json").read_text())
    assert summary["data_format"] == whole["data_format"]
    if objective == "grpo":
        assert summary["objective"]["rewards"] == whole["objective"]["rewards"] == ["word_positions"]
    a, b = read_safetensors(runs["whole"] / "adapter_model.safetensors"), read_safetensors(
        part / "adapter_model.safetensors")
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_generate_and_eval_follow_the_runs_prompt_settings(workspace, tmp_path, capsys):
    """An adapter trained on raw text (--no-chat-template) with --train-on-last-turn and --max-seq-len is
    evaluated and asked the same way, said in one line on stderr; --chat-template etc. choose otherwise."""
    model_dir, data = workspace
    out = tmp_path / "raw"
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--backend", "numpy",
                 "--max-steps", "2", "--no-chat-template", "--train-on-last-turn", "--max-seq-len", "24",
                 "--no-progress"]) == 0
    capsys.readouterr()
    common = ["--model", str(model_dir), "--backend", "numpy", "--data", str(data), "--json", "--max-new-tokens", "4"]
    for path in (out, out / "checkpoints" / "step-000002"):
        assert main(["eval", *common, "--adapter-path", str(path)]) == 0
        captured = capsys.readouterr()
        result = json.loads(captured.out)
        assert (result["chat_template"], result["train_on_last_turn"], result["max_seq_len"]) == (False, True, 24)
        assert [line for line in captured.err.splitlines() if "settings" in line] == [
            "settings of the run that trained the adapter (options given here win): --no-chat-template, "
            "--train-on-last-turn, --max-seq-len 24"]
    assert main(["eval", *common, "--adapter-path", str(out), "--chat-template", "--no-train-on-last-turn",
                 "--max-seq-len", "64"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert (result["chat_template"], result["train_on_last_turn"], result["max_seq_len"]) == (True, False, 64)
    assert "settings of the run" not in captured.err

    tok = load_tokenizer(model_dir)
    model = load_model(model_dir)
    model.load_adapter(out)
    # trained on completions data: the raw prompt is the prompt as given, with no blank line after it
    answers = {chat: tok.decode([i for i in model.generate(prompt_ids(tok, "after red 1?", chat_template=chat,
                                                                      completions=not chat),
                                                             max_new_tokens=6, stop_token_ids=tok.stop_token_ids)
                                 if i not in tok.stop_token_ids]) for chat in (False, True)}
    assert answers[False] != answers[True]           # so that the prompt's form shows in the answer
    for option, chat in ((), False), (("--chat-template",), True):
        assert main(["generate", "--model", str(model_dir), "--adapter-path", str(out), "--backend", "numpy",
                     "--prompt", "after red 1?", "--max-new-tokens", "6", *option]) == 0
        captured = capsys.readouterr()
        assert captured.out == answers[chat] + "\n"
        assert ("--no-chat-template" in captured.err) == (not chat)


# ---- positions, merge into an existing folder, bad numbers --------------------------------------------------

def test_generate_within_the_models_positions(workspace, capsys):
    """The answer shares the model's max_position_embeddings (128) with the prompt: an explicit
    --max-new-tokens beyond what fits is capped with a note, the default silently, and a prompt that fills
    the positions by itself is refused in one line."""
    model_dir, _ = workspace
    tok = load_tokenizer(model_dir)
    prompt = "red " * 40
    room = 128 - len(prompt_ids(tok, prompt))
    assert 0 < room < 100
    base = ["generate", "--model", str(model_dir), "--backend", "numpy", "--prompt", prompt, "--temperature", "1",
            "--top-k", "5"]
    assert main(base + ["--max-new-tokens", "100"]) == 0
    assert capsys.readouterr().err == (f"note: --max-new-tokens 100 capped to {room}: the prompt's {128 - room} "
                                       f"tokens and the answer share the model's 128 positions\n")
    assert main(base) == 0
    assert capsys.readouterr().err == ""
    one_line_error(capsys, ["generate", "--model", str(model_dir), "--backend", "numpy", "--prompt", "red " * 200],
                   "the model takes at most 128 (max_position_embeddings)")


def test_merge_refuses_an_existing_model_folder(trained, workspace, tmp_path, capsys):
    """merge --out refuses a folder holding a model, an adapter or a run, unchanged; --overwrite removes the
    stale shards, their index, config, adapter and tokenizer files first, so the folder holds exactly the
    merged model (and files of its own); --out may not be the adapter itself."""
    model_dir, _ = workspace
    merge = ["merge", "--model", str(model_dir), "--adapter-path", str(trained)]
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for name in ("model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "config.json", "adapter_config.json", "chat_template.jinja"):
        (out / name).write_text("{}")
    before = folder_state(out)
    one_line_error(capsys, merge + ["--out", str(out)],
                   f"--out {out} already holds adapter_config.json, config.json, model-00001-of-00002.safetensors, "
                   f"model-00002-of-00002.safetensors, model.safetensors.index.json; pass --overwrite")
    assert folder_state(out) == before
    assert main(merge + ["--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "notes.txt", "tokenizer.json", "tokenizer_config.json"]
    adapted = load_model(model_dir)
    adapted.load_adapter(trained)
    ids = np.array([[5, 40, 77, 12, 9]])
    np.testing.assert_allclose(load_model(out).logits(ids), adapted.logits(ids), rtol=1e-4, atol=1e-4)
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    one_line_error(capsys, merge + ["--out", str(run)], "already holds checkpoints/")
    before = folder_state(trained)
    one_line_error(capsys, merge + ["--out", str(trained), "--overwrite"], "--out must differ from the adapter folder")
    assert folder_state(trained) == before


@pytest.mark.parametrize("argv, message", [
    (["eval", "--max-samples", "-1"], "argument --max-samples: must be at least 0, got -1"),
    (["eval", "--max-new-tokens", "-1"], "argument --max-new-tokens: must be at least 1, got -1"),
    (["eval", "--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    (["eval", "--max-seq-len", "1"], "argument --max-seq-len: must be at least 2, got 1"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "argument --max-new-tokens: must be at least 1, got 0"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "-3"], "must be at least 1, got -3"),
    (["generate", "--prompt", "hi", "--top-k", "-1"], "argument --top-k: must be at least 0, got -1"),
    (["eval", "--batch-size", "two"], "invalid int value: 'two'"),
    (["bench", "--only", "nosuch"], "--only 'nosuch' selects no benchmark; the names are gemm, gemm_candidates, "
                                    "gemm_quant, attention, decode, mixed_lora, moe, linear_attention, training, "
                                    "variable_lengths, base_weights, mfu, data_parallel, engines, grpo, serve, precision, "
                                    "pipeline, vision, preference"),
])
def test_bad_numbers_and_names(capsys, argv, message):
    one_line_error(capsys, argv, message)


def test_bad_tune_mode_is_refused_before_any_work(capsys, monkeypatch, tmp_path):
    """An unknown WGPU_TRAIN_TUNE: one line, exit code 2, and the output folder is not created."""
    monkeypatch.setenv("WGPU_TRAIN_TUNE", "sometimes")
    one_line_error(capsys, ["finetune", "--max-steps", "1", "--out", str(tmp_path / "run")],
                   "WGPU_TRAIN_TUNE='sometimes' is not one of off, fast, full")
    assert not (tmp_path / "run").exists()
