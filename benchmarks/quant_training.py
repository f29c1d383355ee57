"""Training quality with float16 / NF4 base weights against float32, measured in the same run: the
default run's recipe (embedded model and dataset) once per base dtype and seed, then each dtype's
final training loss (mean of the last 20 steps), validation loss and test exact match next to
float32's of the same seed, and the mean of those ratios over the seeds.

    python benchmarks/quant_training.py [--seeds 3] [--dtypes float16,nf4,nf4-dq] [--backend wgpu] [--json]

A single run says little: a different base dtype changes the whole trajectory, so the per-seed ratios
scatter (float32 against itself across seeds differs far more); the mean over seeds is the figure.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import wgpu_train as wt
from wgpu_train.training.trainer import default_run_config

LAST = 20          # training loss: mean of the last LAST steps


def one_run(base_dtype: str, seed: int, backend: str, root: Path) -> dict:
    """Final figures of the default run with `base_dtype` base weights and `seed` (the embedding and lm_head
    stay float32, so that only the base dtype differs between the runs)."""
    out = root / f"{base_dtype}-{seed}"
    summary = wt.finetune(default_run_config(base_dtype=base_dtype, embed_dtype="float32", seed=seed,
                                             backend=backend, out=str(out), no_progress=True, log_every=1))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "split" not in r and r.get("loss") is not None]
    return {"train_loss": float(np.mean(losses[-LAST:])), "valid_loss": summary["valid_loss_after"],
            "exact_match": summary["exact_match_after"], "steps": summary["steps"],
            "base_weight_bytes": summary["base_weight_bytes"], "backend": summary["backend"]}


def compare(seeds: int, dtypes: list[str], backend: str) -> dict:
    """{"runs": {dtype: [figures per seed]}, "vs_float32": {dtype: {measure: {"per_seed", "mean"}}}}; loss
    ratios are dtype / float32 of the same seed, exact match is the difference in points."""
    runs: dict = {d: [] for d in ["float32", *dtypes]}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(seeds):
            for d in runs:
                runs[d].append(one_run(d, seed, backend, Path(tmp)))
                print(f"seed {seed} {d}: {json.dumps(runs[d][-1])}", file=sys.stderr, flush=True)
    ref = runs["float32"]
    vs = {}
    for d in dtypes:
        vs[d] = {}
        for key in ("train_loss", "valid_loss"):
            ratios = [r[key] / f[key] for r, f in zip(runs[d], ref)]
            vs[d][key] = {"per_seed": ratios, "mean": float(np.mean(ratios))}
        diffs = [r["exact_match"] - f["exact_match"] for r, f in zip(runs[d], ref)]
        vs[d]["exact_match"] = {"per_seed": diffs, "mean": float(np.mean(diffs))}
    spread = {key: max(r[key] for r in ref) / min(r[key] for r in ref) for key in ("train_loss", "valid_loss")}
    return {"seeds": seeds, "backend": ref[0]["backend"], "runs": runs, "vs_float32": vs,
            "float32_seed_spread": spread}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--dtypes", default="float16,nf4,nf4-dq")
    p.add_argument("--backend", default="auto", choices=("auto", "wgpu", "numpy"))
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    result = compare(args.seeds, args.dtypes.split(","), args.backend)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['seeds']} seeds on {result['backend']}; float32 across seeds: training loss varies "
          f"{result['float32_seed_spread']['train_loss']:.2f}x, validation loss "
          f"{result['float32_seed_spread']['valid_loss']:.2f}x")
    print(f"{'base dtype':<10} {'train loss vs f32':>18} {'valid loss vs f32':>18} {'exact match':>12}  per seed (train)")
    for d, v in result["vs_float32"].items():
        per = " ".join(f"{100 * (x - 1):+.1f}%" for x in v["train_loss"]["per_seed"])
        print(f"{d:<10} {100 * (v['train_loss']['mean'] - 1):>+17.1f}% {100 * (v['valid_loss']['mean'] - 1):>+17.1f}% "
              f"{100 * v['exact_match']['mean']:>+10.1f}pt  {per}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
