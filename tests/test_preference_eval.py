"""`wgpu-train eval --objective` (cli/preference_eval.py): a preference objective's loss and TRL's metrics on a
split, equal to the validation row the PreferenceTrainer wrote for the same adapter and data (one scoring
implementation, training/preference_scoring.py); its one-line refusals of bad input."""
from __future__ import annotations

import json

import pytest

from wgpu_train.cli.main import main
from wgpu_train.distributed.dispatch import finetune
from wgpu_train.training.config import TrainConfig

from finetune_helpers import make_model_dir, one_line_error, write_jsonl
from tolerances import assert_close
from test_preference_train import pairs, unpaired

RUNS = {    # name -> (data folder, TrainConfig arguments); each option away from its default, so that eval must
    # take it from the run (train_config.json) to reproduce the row
    "dpo": ("pairs", dict(objective="dpo", beta=0.3, batch_size=3)),
    "ipo": ("pairs", dict(objective="dpo", dpo_loss="ipo", beta=0.5, max_seq_len=10, truncation_mode="keep_end")),
    "orpo": ("pairs", dict(objective="orpo", beta=0.2, batch_size=3, max_prompt_length=4)),
    "kto": ("unpaired", dict(objective="kto", beta=0.2, desirable_weight=1.5, batch_size=3)),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref_eval")
    model = make_model_dir(root / "model")
    for name, (train, valid) in (("pairs", (pairs(8), pairs(5, 100))), ("unpaired", (unpaired(8), unpaired(7)))):
        (root / name).mkdir()
        write_jsonl(root / name / "train.jsonl", train)
        write_jsonl(root / name / "valid.jsonl", valid)
    (root / "sft").mkdir()
    for split in ("train", "valid"):
        write_jsonl(root / "sft" / f"{split}.jsonl", [{"prompt": p["prompt"], "completion": p["chosen"]}
                                                      for p in pairs(4)])
    return root, model


def _train(workspace, out, name, backend="numpy"):
    root, model = workspace
    data, kw = RUNS[name]
    base = dict(model=str(model), data=str(root / data), out=str(out), backend=backend, no_progress=True, lr=1e-2,
                eval_generate=False, log_every=1, batch_size=2, max_steps=3, valid_split=0.0, lr_schedule="constant")
    finetune(TrainConfig(**{**base, **kw}))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "valid"][-1]


def _eval(capsys, argv, backend="numpy") -> dict:
    assert main(["eval", "--backend", backend, "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name, backend", [(name, "numpy") for name in RUNS] + [("kto", "wgpu")])
def test_eval_equals_the_trainers_validation_row(workspace, tmp_path, capsys, request, name, backend):
    """The run's last validation row (its final adapter) is what eval reports for that adapter on the valid split,
    the objective's options, batch size and truncation taken from the run."""
    if backend == "wgpu":
        request.getfixturevalue("default_rt")
    root, _ = workspace
    row = _train(workspace, tmp_path / "run", name, backend)
    data, kw = RUNS[name]
    got = _eval(capsys, ["--objective", kw["objective"], "--data", str(root / data), "--split", "valid",
                         "--adapter-path", str(tmp_path / "run")], backend)
    assert got["backend"] == backend
    assert got["examples"] == row["examples"] and got["batch_size"] == kw.get("batch_size", 2)
    assert got["objective"]["beta"] == kw["beta"]
    for key in ("max_seq_len", "truncation_mode", "max_prompt_length"):
        if key in kw:
            assert got[key] == kw[key], key
    assert got["truncated"] > 0 if name == "ipo" else got["truncated"] == 0
    metrics = [k for k in row if "/" in k or k in ("kl", "nll_loss")]
    assert "rewards/accuracies" in metrics or name == "kto"
    assert "kl" in metrics if name == "kto" else "logps/chosen" in metrics
    for key in ["loss", *metrics]:
        # the same engine, rows and batches as the trainer's evaluation; only the adapter's trip through
        # adapter_model.safetensors lies between them, and float32 survives it
        assert_close(got[key], row[key], "exact", key)
    assert row["rewards/chosen"] != 0.0         # trained: the policy is not its reference


def test_valid_split_of_one_file_is_the_pairs_the_run_held_out(workspace, tmp_path, capsys):
    """A run on one file (no valid split of its own) holds out a seeded fraction; eval --split valid on the same
    file finds those pairs again (the run's valid_split and seed) and reproduces the run's last validation row;
    --split train is the rest, and without --split the file is one split, as before."""
    root, model = workspace
    data = tmp_path / "pairs.jsonl"
    write_jsonl(data, pairs(12))
    run = tmp_path / "run"
    finetune(TrainConfig(model=str(model), data=str(data), out=str(run), backend="numpy", no_progress=True,
                         lr=1e-2, eval_generate=False, log_every=1, batch_size=2, max_steps=2, valid_split=0.25, seed=3,
                         objective="dpo", lr_schedule="constant"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    row = [r for r in rows if r.get("split") == "valid"][-1]
    argv = ["--objective", "dpo", "--data", str(data), "--adapter-path", str(run)]
    got = _eval(capsys, [*argv, "--split", "valid"])
    assert (got["split"], got["examples"], row["examples"]) == ("valid", 3, 3)
    for key in ("loss", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert_close(got[key], row[key], "exact", key)
    assert _eval(capsys, [*argv, "--split", "train"])["examples"] == 9
    whole = _eval(capsys, argv)
    assert (whole["split"], whole["examples"]) == ("train", 12)


def test_reference_adapter_and_explicit_options(workspace, tmp_path, capsys):
    """--ref-adapter scores the reference as the base with that adapter: the policy's own adapter as reference
    makes every reward 0 (and DPO's sigmoid loss log 2); options given win over the run's."""
    import math

    root, _ = workspace
    _train(workspace, tmp_path / "run", "dpo")
    argv = ["--objective", "dpo", "--data", str(root / "pairs"), "--split", "valid", "--adapter-path",
            str(tmp_path / "run")]
    same = _eval(capsys, [*argv, "--ref-adapter", str(tmp_path / "run")])
    assert same["rewards/chosen"] == same["rewards/rejected"] == same["rewards/margins"] == 0.0
    assert_close(same["loss"], math.log(2.0), "loss_f32")
    base = _eval(capsys, [*argv, "--beta", "0.6", "--batch-size", "5"])
    at_run = _eval(capsys, argv)
    assert (base["objective"]["beta"], base["batch_size"], base["reference"]) == (0.6, 5, at_run["reference"])
    # rewards are beta times the log-ratios: doubling beta doubles them
    assert_close(base["rewards/margins"], 2 * at_run["rewards/margins"], "loss_f32")


def test_text_output_names_the_metrics(workspace, capsys):
    root, model = workspace
    assert main(["eval", "--backend", "numpy", "--model", str(model), "--objective", "simpo", "--data",
                 str(root / "pairs"), "--split", "valid"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("valid (") and "5 pairs): simpo loss " in out and "rewards/accuracies" in out, out


@pytest.mark.parametrize("argv, match", [
    (["--objective", "dpo", "--data", "{root}/sft"], "train.jsonl:1: not a preference record"),
    (["--objective", "kto", "--data", "{root}/sft"], 'train.jsonl:1: missing field "label"'),
    (["--objective", "kto", "--data", "{root}/pairs", "--split", "valid", "--ref-adapter", "{root}/nope"], "nope"),
    (["--objective", "simpo", "--data", "{root}/pairs", "--ref-adapter", "{root}/model"], "needs no reference model"),
    (["--objective", "orpo", "--data", "{root}/pairs", "--ref-adapter", "{root}/model"], "needs no reference model"),
    (["--beta", "0.2", "--data", "{root}/pairs"], "give --objective"),
    (["--ref-adapter", "{root}/model", "--data", "{root}/pairs"], "give --objective"),
    (["--truncation-mode", "keep_end", "--data", "{root}/pairs"], "give --objective"),
    (["--objective", "kto", "--data", "{root}/unpaired", "--truncation-mode", "keep_end"], "keep_start only"),
    (["--objective", "dpo", "--data", "{root}/pairs", "--max-prompt-length", "0"], "at least 1"),
    (["--objective", "dpo", "--tasks", "hellaswag"], "leave out --objective"),
    (["--objective", "dpo", "--data", "{root}/pairs", "--label-smoothing", "0.1"], "label_smoothing applies to"),
    (["--objective", "dpo", "--data", "{root}/pairs", "--split", "test"], "no test split"),
])
def test_bad_input_is_one_line(workspace, capsys, argv, match):
    root, model = workspace
    one_line_error(capsys, ["eval", "--model", str(model), "--backend", "numpy",
                            *[a.format(root=root) for a in argv]], match.format(root=root))
