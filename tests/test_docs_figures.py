"""tools/docs/figures.py still draws the site's diagram and charts from their sources, so a renamed table is caught."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the figures need matplotlib (the docs or plot extra)")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "docs"))
import figures  # noqa: E402  (tools/docs is not a package)


def test_tables_are_read_from_benchmarks_readme():
    text = (REPO / "benchmarks" / "README.md").read_text(encoding="utf-8")
    header, *rows = figures.markdown_table(text, "Engines on a machine without a GPU")
    assert header[3] == "NumPy engine" and len(rows) >= 2
    assert figures.first_number(rows[0][3]) > 0 and figures.first_number("3,688 tok/s (1x)") == 3688.0
    header, *rows = figures.markdown_table(text, "Variants: `benchmarks/gemm_variants.py`")
    assert [row[0] for row in rows][:2] == ["v1", "v2"]


def test_architecture_and_benchmark_figures_are_drawn(tmp_path):
    figures.architecture(tmp_path / "architecture.svg")
    figures.benchmark_charts(tmp_path / "engines.svg", tmp_path / "gemm.svg")
    for name in ("architecture.svg", "engines.svg", "gemm.svg"):
        assert (tmp_path / name).read_text().lstrip().startswith("<?xml"), name
    # a layer of the contract; matplotlib notes each text of an SVG in a comment
    assert "harness" in (tmp_path / "architecture.svg").read_text()
