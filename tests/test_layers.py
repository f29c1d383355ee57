"""The layering of ARCHITECTURE.md as import-linter checks it (contracts in pyproject.toml): kept by the package,
and broken, with the contract's message, by an import that runs back up a layer."""
import os
import shutil
import subprocess
import sys
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


def violated(tmp_path, module: str, line: str) -> str:
    """import-linter's report on a copy of the package whose `module` (a path under wgpu_train/) gains `line`;
    the report's lines unwrapped. Fails unless some contract is broken."""
    shutil.copytree(ROOT / "wgpu_train", tmp_path / "wgpu_train",
                    ignore=shutil.ignore_patterns("__pycache__", "*.safetensors", "*.json*"))   # the code only
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    path = tmp_path / "wgpu_train" / module
    path.write_text(path.read_text() + f"\n{line}\n")
    proc = lint(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return " ".join(proc.stdout.split())        # the report wraps long lines


def test_an_upward_import_breaks_the_layers_contract(tmp_path):
    out = violated(tmp_path, "engines/numpy/ops.py",
                   "from wgpu_train.training.config import TrainConfig  # an engine reaching up")
    assert "Layers: imports only go down" in out and "BROKEN" in out
    assert "wgpu_train.engines is not allowed to import wgpu_train.training" in out
    assert "wgpu_train.engines.numpy.ops -> wgpu_train.training.config" in out


def test_one_engine_importing_the_other_breaks_their_independence(tmp_path):
    out = violated(tmp_path, "engines/webgpu/steps.py", "from wgpu_train.engines.numpy import ops  # the oracle")
    assert "The WebGPU engine and the NumPy engine import nothing of each other: they meet at the protocol and " \
           "shared/ BROKEN" in out
    assert "wgpu_train.engines.webgpu is not allowed to import wgpu_train.engines.numpy" in out
    assert "wgpu_train.engines.webgpu.steps -> wgpu_train.engines.numpy.ops" in out


@pytest.mark.parametrize("module", ["training/trainer.py", "cli/main.py", "__init__.py"])
def test_reaching_past_the_facade_breaks_the_engine_internals_contract(tmp_path, module):
    out = violated(tmp_path, module, "from wgpu_train.engines.webgpu.memory import head_rows  # past the facade")
    assert "Above engines/, an engine is reached through loading, vision_model, model, generate, backend_choice, " \
           "resources, protocol and shared/ (bench/ alone measures its kernels) BROKEN" in out
    importer = "wgpu_train" + ("" if module == "__init__.py" else "." + module[:-3].replace("/", "."))
    assert f"{importer} is not allowed to import wgpu_train.engines.webgpu.memory" in out


def test_the_server_importing_training_breaks_its_contract(tmp_path):
    out = violated(tmp_path, "serve/app.py", "from wgpu_train.training.config import TrainConfig  # not a server's")
    assert "The server imports nothing of training/ BROKEN" in out
    assert "wgpu_train.serve is not allowed to import wgpu_train.training" in out
    assert "wgpu_train.serve.app -> wgpu_train.training.config" in out


def test_pipeline_stages_reaching_torch_break_their_contract(tmp_path):
    """The pipeline extra is Ray core alone: a stage module that reaches torch, even through another module (the
    data-parallel workers' gloo collective), breaks the contract; the extra itself lists neither torch nor Ray
    Train, which the ray extra (--num-workers) does."""
    out = violated(tmp_path, "distributed/pipeline_engine.py",
                   "from wgpu_train.distributed.ray_worker import TorchCollective  # gloo, through torch")
    assert "Pipeline stages need Ray core alone (the pipeline extra): no torch, directly or through another " \
           "module BROKEN" in out
    assert "wgpu_train.distributed.pipeline_engine -> wgpu_train.distributed.ray_worker" in out
    try:
        import tomllib
    except ImportError:     # Python 3.10: the package's own dependency
        import tomli as tomllib
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [req.split(">")[0] for req in extras["pipeline"]] == ["ray"]
    assert [req.split(">")[0] for req in extras["ray"]] == ["ray[train]", "torch"]


def test_no_module_imports_itself_back():
    """tools/import_cycles.py finds no cycle among modules (imports inside functions counted) nor packages."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "import_cycles.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("module cycles: 0 ") and "package cycles: 0 " in proc.stdout, proc.stdout
