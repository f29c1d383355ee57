"""`wgpu-train bench --json`: one JSON object with the adapter, its FMA peak and each figure next to its
reference. Only the structure and the correctness checks are asserted here: speeds are for the
benchmark to report, never for a test to time."""
from __future__ import annotations

import json

from conftest import require_adapter

from wgpu_train.cli.main import main


def test_bench_json_gemm_and_training(capsys, monkeypatch):
    require_adapter()
    # one submission per step however slow the (shared, loaded) machine is: the engine splits a step whose GPU
    # time passes this many seconds, which is for real GPUs' watchdogs, not for this structural check
    monkeypatch.setenv("WGPU_TRAIN_MAX_SUBMIT_S", "inf")
    assert main(["bench", "--json", "--only", "gemm_nt"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"adapter", "fma_peak_gflops", "kernels"} and result["fma_peak_gflops"] > 0
    names = {k["name"] for k in result["kernels"]}
    assert "gemm_nt" in names
    for k in result["kernels"]:
        assert k["gflops"] > 0 and 0 < k["fraction_of_peak"] and k["max_rel_err"] < 1e-4
        assert k["shape"].count("x") == 2

    assert main(["bench", "--json", "--only", "training"]) == 0
    training = json.loads(capsys.readouterr().out)["training"]
    assert training["submits_per_step"] == 1 and training["readbacks_per_step"] == 1
    assert set(training["tokens_per_s"]) == {"wgpu", "wgpu_gradient_checkpointing", "numpy", "torch_cpu_peft"}
    assert training["gradient_checkpointing_step_time_ratio"] > 0
    assert 0 < training["python_record_fraction"] < 1


def test_bench_json_decode(capsys):
    """The cached-attention bench: every pass it times was checked against NumPy (a wrong one stops the bench),
    the tuner's choice is marked once per shape, and "vs_single" is there where the single pass ran."""
    require_adapter()
    assert main(["bench", "--json", "--only", "decode"]) == 0
    rows = json.loads(capsys.readouterr().out)["kernels"]
    shapes = {r["shape"] for r in rows}
    assert len(shapes) == 3 and all(r["name"] == "attention_decode" and r["ms"] > 0 for r in rows)
    assert all(sum(bool(r.get("default")) for r in rows if r["shape"] == s) == 1 for s in shapes)
    assert {r["kernel"].split("/")[0] for r in rows} == {"decode"}
    small = [r for r in rows if r["shape"].startswith("n1 len480")]
    assert any(r["kernel"] == "decode/single" for r in small) and all("vs_single" in r for r in small)


def test_bench_json_preference(capsys, tmp_path, monkeypatch):
    """The preference bench on a given model: a DPO step (its first loss checked to be log 2, the policy equal to
    its reference) next to an SFT step on the chosen rows; the DPO micro-batch holds twice the rows, and the memory
    estimates say what that costs; the trainer's one-pass DPO step is timed beside the two-pass one."""
    require_adapter()
    from finetune_helpers import make_model_dir

    monkeypatch.setenv("WGPU_TRAIN_MAX_SUBMIT_S", "inf")
    model = make_model_dir(tmp_path / "model")
    assert main(["bench", "--json", "--only", "preference", "--model", str(model)]) == 0
    result = json.loads(capsys.readouterr().out)["preference"]
    (sft_rows, sft_len), (dpo_rows, dpo_len) = (map(int, result["micro_batch"][k].split("x")) for k in ("sft", "dpo"))
    assert dpo_rows == 2 * sft_rows == 2 * result["pairs_per_step"] and dpo_len >= sft_len
    assert all(v > 0 for v in [*result["step_ms"].values(), *result["dpo_step_ms"].values(),
                               *result["dpo_two_pass_step_ms"].values()])
    # the trainer's step: the reference scored (one submission), then the policy's forward to its loss head, whose
    # log-probabilities the host weighs, and the backward with the optimizer step
    assert result["dpo_step_calls"] == {"submits": 3, "readbacks": 3}
    assert result["dpo_two_pass_step_calls"] == {"submits": 2, "readbacks": 2}
    memory = result["memory_estimate_bytes"]
    assert memory["dpo"]["weights"] == memory["sft"]["weights"]
    assert memory["dpo"]["activations"] >= 2 * memory["sft"]["activations"] > 0
    assert result["dpo_vs_sft_memory"] == memory["dpo"]["total"] / memory["sft"]["total"] > 1


def test_bench_model_needs_the_preference_bench(capsys):
    from finetune_helpers import one_line_error

    one_line_error(capsys, ["bench", "--only", "gemm", "--model", "some/model"],
                   "--model is the model of the preference")


# a Gemma-3-vision-shaped model a few hundred weights wide: the vision bench's structure and checks, not its speed
TINY_VISION = dict(tower_hidden=16, tower_intermediate=24, tower_layers=1, tower_heads=2, image_size=28, patch_size=14,
                   mm_tokens=4, text_hidden=32, text_intermediate=48, text_layers=2, text_heads=2, text_kv_heads=1,
                   head_dim=16, vocab=64, rows=2, row_tokens=16)
VISION_RATIOS = ("tower_forward_vs_lm_step", "tower_forward_backward_vs_lm_step")


def test_bench_vision_numpy_rows_and_ratios(monkeypatch):
    """`bench --only vision` on the NumPy engine alone (no adapter): one row with the tower's times per image and
    the step's, the ratios their quotients; a tower off its float64 forward stops the bench before any timing."""
    import pytest

    from wgpu_train.bench import vision
    from wgpu_train.bench.suite import bench_names

    assert "vision" in bench_names()
    shape = vision.VisionBenchShape(**TINY_VISION)
    result = vision.bench_vision(None, shape, rounds=1)
    assert result["images_per_step"] == 2 and result["webgpu"] == "no adapter"
    assert result["tower_max_rel_err_vs_float64"] < vision.TOWER_REL_TOL
    (row,) = result["rows"]
    assert row["engine"] == "numpy" and row["lm_step_ms_per_image"] == row["lm_step_ms"] / 2
    assert row["tower_forward_vs_lm_step"] == row["tower_forward_ms_per_image"] / row["lm_step_ms_per_image"] > 0
    assert row["tower_forward_backward_vs_lm_step"] == (row["tower_forward_backward_ms_per_image"]
                                                        / row["lm_step_ms_per_image"]) > 0
    monkeypatch.setattr(vision, "TOWER_REL_TOL", 0.0)
    with pytest.raises(AssertionError, match="float64 forward"):
        vision.bench_vision(None, shape, rounds=1)


def test_bench_vision_webgpu_row_matches_the_numpy_engine():
    """Where the WebGPU engine takes images (set_images), the bench adds the adapter's row (its frozen tower the
    WebGPU one, checked against the float64 forward), its first step's loss equal to the NumPy engine's on the same
    weights and batch (checked inside the bench before timing)."""
    import pytest

    require_adapter()
    from wgpu_train.bench import vision
    from wgpu_train.engines.webgpu.device.runtime import get_runtime
    from wgpu_train.engines.webgpu.engine import WgpuEngine

    if not hasattr(WgpuEngine, "set_images"):
        pytest.skip("the WebGPU engine has no set_images yet: the bench times the NumPy engine alone")
    result = vision.bench_vision(get_runtime(None), vision.VisionBenchShape(**TINY_VISION), rounds=1)
    numpy_row, gpu_row = result["rows"]
    assert result["webgpu"] == "timed" and gpu_row["engine"] != "numpy"
    assert abs(gpu_row["first_loss"] - numpy_row["first_loss"]) <= vision.LOSS_REL_TOL * numpy_row["first_loss"]
    assert all(gpu_row[k] > 0 for k in VISION_RATIOS)
    assert (numpy_row["tower"], gpu_row["tower"]) == ("numpy", "webgpu")
    assert result["webgpu_tower_max_rel_err_vs_float64"] < vision.TOWER_REL_TOL
    assert result["webgpu_tower_vs_numpy_tower"] > 0 and result["webgpu_tower_forward_backward_vs_numpy"] > 0
