"""--report-to: the metrics.jsonl rows arrive in each tracking tool that is installed (local or offline modes
only: no network, no accounts); an unknown tool or a missing package is one line and exit code 2."""
from __future__ import annotations

import json
import struct
import sys
import uuid

import pytest

from finetune_helpers import make_data_dir, make_model_dir
from wgpu_train.cli.main import main
from wgpu_train.training.tracking import scalars


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("tracking")
    return make_model_dir(root / "model"), make_data_dir(root / "data")


def _run(workspace, out, *extra):
    model, data = workspace
    return main(["finetune", "--model", str(model), "--data", str(data), "--out", str(out), "--backend", "numpy",
                 "--no-progress", "--max-steps", "3", "--log-every", "1", "--eval-every", "2", *extra])


def _events(folder):
    """(tag, step, value) of every scalar in a TensorBoard event folder (TFRecord framing, Event protos)."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        raw = path.read_bytes()
        pos = 0
        while pos + 12 <= len(raw):
            (n,) = struct.unpack("<Q", raw[pos:pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(raw[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value if v.HasField("simple_value")]
    return out


def test_scalars_of_rows():
    assert scalars({"step": 3, "epoch": 0.5, "loss": 2.0, "lr": 1e-3}) == (3, {"train/epoch": 0.5, "train/loss": 2.0,
                                                                               "train/lr": 1e-3})
    assert scalars({"step": 4, "split": "valid", "loss": 1.5, "perplexity": 4.48})[1] == {
        "valid/loss": 1.5, "valid/perplexity": 4.48}
    assert scalars({"step": 5, "profile_ms": {"attention": 1.0}, "step_wall_ms": 9.0})[1] == {
        "profile/attention_ms": 1.0, "train/step_wall_ms": 9.0}


def test_tensorboard_gets_every_row(workspace, tmp_path):
    pytest.importorskip("tensorboardX")
    out = tmp_path / "run"
    assert _run(workspace, out, "--report-to", "tensorboard") == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = {(tag, step): value for tag, step, value in _events(out / "runs")}
    for row in rows:
        step, values = scalars(row)
        for key, value in values.items():
            assert events[(key, step)] == pytest.approx(value, rel=1e-6), key
    assert ("valid/loss", 2) in events and ("train/loss", 3) in events


def test_mlflow_local_store(workspace, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    assert _run(workspace, out, "--report-to", "mlflow") == 0
    db = out / "mlflow.db"
    mlflow.set_tracking_uri(f"sqlite:///{db.resolve()}" if db.exists() else (out / "mlruns").resolve().as_uri())
    runs = mlflow.search_runs(experiment_names=["wgpu-train"], output_format="list")
    history = mlflow.tracking.MlflowClient().get_metric_history(runs[0].info.run_id, "train.loss")
    assert [m.step for m in history] == [1, 2, 3]


def test_wandb_offline(workspace, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    out = tmp_path / "run"
    assert _run(workspace, out, "--report-to", "wandb") == 0
    assert list((out / "wandb").glob("offline-run-*"))


def test_trackio_local(workspace, tmp_path, monkeypatch):
    pytest.importorskip("trackio")
    import sqlite3

    from trackio.utils import TRACKIO_DIR

    project = f"wgpu-train-test-{uuid.uuid4().hex[:12]}"      # trackio keeps its store in the user's cache
    monkeypatch.setenv("TRACKIO_PROJECT", project)
    out = tmp_path / "run"
    assert _run(workspace, out, "--report-to", "trackio") == 0
    db = sqlite3.connect(TRACKIO_DIR / f"{project}.db")
    steps = sorted(step for (step,) in db.execute("select step from metrics"))
    db.close()
    for leftover in TRACKIO_DIR.glob(f"{project}.*"):
        leftover.unlink()
    assert steps == [0, 1, 2, 2, 3, 3]      # valid before, train 1..3, valid at 2 and 3


@pytest.mark.parametrize("report,match", [("comet", "unknown tool 'comet'"),
                                          ("wandb", "needs the wandb package: pip install 'wgpu-train[wandb]'")])
def test_unknown_tool_or_missing_package_is_one_line(workspace, tmp_path, capsys, monkeypatch, report, match):
    monkeypatch.setitem(sys.modules, "wandb", None)          # as if it were not installed
    assert _run(workspace, tmp_path / "x", "--report-to", report) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and match in err[0], err
    assert not (tmp_path / "x").exists()
