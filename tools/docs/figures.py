"""The site's pictures, drawn from their sources: the embedded run's loss curve, the layer diagram, benchmark charts.
`python tools/docs/figures.py [--only loss,architecture,benchmarks]`; the loss curve trains the embedded run again."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "wgpu-train-docs"   # the same SVG ids on every run, so git diffs are real
from matplotlib.figure import Figure  # noqa: E402  (after the backend is chosen)
from matplotlib.patches import FancyBboxPatch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "docs" / "images"
NO_DATE = {"Date": None}


def markdown_table(text: str, heading_start: str) -> list[list[str]]:
    """The rows (header first, separator dropped) of the first table under the heading that starts so."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith("#") and line.lstrip("# ").startswith(heading_start))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif rows:
            break
    return rows


def first_number(cell: str) -> float | None:
    match = re.search(r"\d[\d,]*(\.\d+)?", cell)
    return float(match.group(0).replace(",", "")) if match else None


def loss_curve(out: Path) -> None:
    """Train the embedded default on the NumPy engine and draw its metrics.jsonl with the trainer's own plot."""
    from wgpu_train.training.metrics import plot_losses

    with tempfile.TemporaryDirectory() as run:
        subprocess.run([sys.executable, "-m", "wgpu_train.cli", "finetune", "--backend", "numpy", "--no-progress",
                        "--out", run, "--overwrite"], check=True, cwd=REPO)
        plot_losses(Path(run) / "metrics.jsonl", out)
        summary = json.loads((Path(run) / "summary.json").read_text())
    print(f"{out}: {summary.get('steps')} steps", file=sys.stderr)


def architecture(out: Path) -> None:
    """The layers of import-linter's contract in pyproject.toml, each with what ARCHITECTURE.md says it owns."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["id"] == "layers")["layers"]
    engines = next(c for c in contracts if c["id"] == "independent_engines")["modules"]
    owns = {}
    for layer, package, what in markdown_table((REPO / "ARCHITECTURE.md").read_text(), "Architecture")[1:]:
        names = re.findall(r"`([a-z_]+)(?:/|\.py)`", package)
        parts = what.replace("`", "").split("; ") if len(names) > 1 else [what.replace("`", "")]
        for name, part in zip(names, parts if len(parts) == len(names) else [parts[0]] * len(names)):
            owns[name] = part
    fig = Figure(figsize=(10, 0.85 * len(layers) + 0.8))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.6, len(layers) + 0.2)
    ax.axis("off")
    for row, entry in enumerate(layers):
        y = len(layers) - 1 - row
        names = [n.strip().removeprefix("wgpu_train.") for n in entry.split("|")]
        width = 9.0 / len(names)
        for k, name in enumerate(names):
            x = 0.5 + k * width
            engine_layer = name == "engines"
            ax.add_patch(FancyBboxPatch((x + 0.05, y + 0.08), width - 0.1, 0.75, boxstyle="round,pad=0.02",
                                        facecolor="#ffe8cc" if engine_layer else "#dbe4ff", edgecolor="#364fc7"))
            ax.text(x + width / 2, y + 0.66, name, ha="center", va="center", fontsize=11, weight="bold")
            if engine_layer:     # the two engines side by side, meeting only at the protocol
                for j, module in enumerate(engines):
                    inner = 0.5 + 1.5 + j * 3.2
                    ax.add_patch(FancyBboxPatch((inner, y + 0.2), 2.8, 0.3, boxstyle="round,pad=0.02",
                                                facecolor="#fff4e6", edgecolor="#e8590c"))
                    ax.text(inner + 1.4, y + 0.35, module.removeprefix("wgpu_train.") + " engine", ha="center",
                            va="center", fontsize=8)
                continue
            chars = max(int((width - 0.3) / 0.072), 10)
            ax.text(x + width / 2, y + 0.33, textwrap.fill(owns.get(name, ""), chars, max_lines=2, placeholder=" …"),
                    ha="center", va="center", fontsize=7.5, color="#343a40", linespacing=1.2)
    ax.annotate("", xy=(9.75, 0.1), xytext=(9.75, len(layers) - 0.3),
                arrowprops={"arrowstyle": "->", "color": "#868e96"})
    ax.text(9.85, len(layers) / 2, "imports go down", rotation=270, va="center", fontsize=9, color="#868e96")
    ax.text(5, -0.35, "wgpu_train/ layers, from pyproject.toml's import-linter contract (checked by lint-imports)",
            ha="center", fontsize=8, color="#868e96")
    fig.savefig(out, metadata=NO_DATE)


def benchmark_charts(engines_out: Path, gemm_out: Path) -> None:
    """Bar charts of two tables of benchmarks/README.md: the engines without a GPU, and the GEMM variants."""
    text = (REPO / "benchmarks" / "README.md").read_text()
    header, *rows = markdown_table(text, "Engines on a machine without a GPU")
    engines = header[3:]
    fig = Figure(figsize=(9, 4.2))
    ax = fig.add_subplot()
    bar = 0.8 / len(engines)
    for k, engine in enumerate(engines):
        ratios = [first_number(row[3 + k]) / first_number(row[3]) for row in rows]
        ax.bar([i + k * bar for i in range(len(rows))], ratios, bar, label=engine)
    ax.axhline(1.0, color="#868e96", lw=0.8)
    ax.set_xticks([i + bar for i in range(len(rows))],
                  [f"{r[0].split(',')[0]}\n{r[1]}, {r[2]}" for r in rows], fontsize=7.5)
    ax.set_ylabel("tokens/s relative to the NumPy engine")
    ax.set_title("One LoRA step on a 2-core machine without a GPU (wgpu-train bench --only engines)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(engines_out, metadata=NO_DATE)

    header, *rows = markdown_table(text, "Variants: `benchmarks/gemm_variants.py`")
    fig = Figure(figsize=(9, 3.8))
    ax = fig.add_subplot()
    names = [row[0] for row in rows]
    ax.bar(names, [first_number(row[2]) for row in rows], color="#4c6ef5", label=header[2])
    ax.set_ylabel("GFLOP/s, 1024³ fp32")
    ax.set_title("GEMM variants on lavapipe (benchmarks/gemm_variants.py); above each bar its share of the FMA peak",
                 fontsize=10)
    for i, row in enumerate(rows):
        ax.text(i, first_number(row[2]) + 0.8, row[3], ha="center", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(gemm_out, metadata=NO_DATE)


FIGURES = {
    "loss": lambda: loss_curve(IMAGES / "loss-embedded.png"),
    "architecture": lambda: architecture(IMAGES / "architecture.svg"),
    "benchmarks": lambda: benchmark_charts(IMAGES / "engines-without-gpu.svg", IMAGES / "gemm-variants.svg"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description="Draw the documentation site's pictures into docs/images/.")
    parser.add_argument("--only", default=",".join(FIGURES), help=f"comma-separated, of {', '.join(FIGURES)}")
    args = parser.parse_args()
    IMAGES.mkdir(parents=True, exist_ok=True)
    for name in args.only.split(","):
        FIGURES[name]()


if __name__ == "__main__":
    main()
