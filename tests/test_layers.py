"""The layering of ARCHITECTURE.md as import-linter checks it (contracts in pyproject.toml): kept by the package,
and broken, with the contract's message, by an import that runs back up a layer."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = shutil.which("lint-imports")
pytestmark = pytest.mark.skipif(LINT is None, reason="import-linter is not installed (the test extra installs it)")


def lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([LINT, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_package_keeps_every_contract():
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout and "BROKEN" not in proc.stdout


def test_an_upward_import_breaks_the_layers_contract(tmp_path):
    shutil.copytree(ROOT / "wgpu_train", tmp_path / "wgpu_train",
                    ignore=shutil.ignore_patterns("__pycache__", "*.safetensors", "*.json*"))   # the code only
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    ops = tmp_path / "wgpu_train" / "engines" / "numpy" / "ops.py"
    ops.write_text(ops.read_text() + "\nfrom wgpu_train.training.config import TrainConfig  # an engine reaching up\n")
    proc = lint(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())        # the report wraps long lines
    assert "Layers: imports only go down" in out and "BROKEN" in out
    assert "wgpu_train.engines is not allowed to import wgpu_train.training" in out
    assert "wgpu_train.engines.numpy.ops -> wgpu_train.training.config" in out
