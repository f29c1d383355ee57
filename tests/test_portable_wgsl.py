"""Portable WGSL: every kernel descriptor (each tuned family's whole catalogue, and every kernel this test session
compiled) within WebGPU's default limits, and valid for Dawn's Tint (Chrome's and Dawn's WGSL compiler) as well as
naga. These tests run last (conftest.py), so that the session's kernels are all compiled by then."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from wgpu_train.errors import DeviceError

from wgpu_train.engines.webgpu.device.launch import DEFAULT_LIMITS, Kernel, parse_params, prepare
from wgpu_train.engines.webgpu.tuned import attention_kernels
from wgpu_train.engines.webgpu.tuned.catalogue import tuned_kernels

ROOT = Path(__file__).resolve().parent.parent
TINT = ROOT / "tools" / "tint"
NODE = shutil.which("node")
# .ci/run installs tools/tint's package and sets this: there a missing Node or package fails instead of skipping
REQUIRE_TINT = os.environ.get("WGPU_TRAIN_REQUIRE_TINT") == "1"


def every_kernel(rt) -> list[Kernel]:
    """The tuned families' catalogues and the kernels compiled on rt so far, by label."""
    return sorted(set(tuned_kernels() + rt.compiled_kernels()), key=lambda k: k.label)


def beyond_defaults_with_a_twin(k: Kernel, kernels) -> bool:
    """Whether k is a tuner candidate allowed past WebGPU's default limits: a workgroup-tiled attention kernel
    (a GPU's first guess, up to 32 KiB of workgroup memory), which the tuner leaves out where the adapter offers
    less, with a register-blocked twin of the same pass and head dim within the defaults."""
    if k.shader != "attention_tiles":
        return False
    _, _, pass_, head_dim = k.source[:4]          # then its tensors' storage formats
    return any(t.shader == "attention_regs" and t.source[2:4] == (pass_, head_dim) and not t.over_limits(DEFAULT_LIMITS)
               for t in kernels)


def _value(expr: str, k: Kernel, text: str) -> int:
    """A workgroup size term: literals, override constants the kernel gives, and const / override declarations
    of the text, combined with + - * / ( )."""
    given = dict(k.constants)

    def name(m):
        word = m.group(0)
        if word in given:
            return str(int(given[word]))
        decl = re.search(rf"(?:const|override)\s+{word}\s*(?::\s*\w+)?\s*=\s*([^;]+);", text)
        if decl is None:
            raise AssertionError(f"{k.label}: cannot evaluate the workgroup size term {word!r}")
        return f"({_value(decl.group(1), k, text)})"

    arithmetic = re.sub(r"\b(\d+)u\b", r"\1", re.sub(r"\b[A-Za-z_]\w*\b", name, expr)).replace("/", "//")
    assert re.fullmatch(r"[\d\s+\-*/()]+", arithmetic), f"{k.label}: workgroup size {expr!r}"
    return int(eval(arithmetic))       # digits and operators only (checked above)


def workgroup_invocations(k: Kernel, text: str) -> int:
    """Invocations per workgroup of k's entry point, from its @workgroup_size."""
    m = re.search(rf"@workgroup_size\(([^)]*)\)\s*fn\s+{k.entry}\s*\(", re.sub(r"//[^\n]*", "", text))
    assert m is not None, f"{k.label}: no @workgroup_size before fn {k.entry}"
    n = 1
    for term in m.group(1).split(","):
        if term.strip():
            n *= _value(term, k, text)
    return n


def test_every_kernel_within_webgpu_default_limits(rt):
    kernels = every_kernel(rt)
    assert len(kernels) > 300           # the catalogues alone hold several hundred
    problems = []
    for k in kernels:
        text = k.text()
        over = k.over_limits(DEFAULT_LIMITS)
        invocations = workgroup_invocations(k, text)
        if invocations > DEFAULT_LIMITS["max-compute-invocations-per-workgroup"]:
            over.append(f"{invocations} invocations per workgroup")
        if k.invocations and k.invocations != invocations:
            over.append(f"declares {k.invocations} invocations, its @workgroup_size gives {invocations}")
        if 4 * len(parse_params(text)) > DEFAULT_LIMITS["max-uniform-buffer-binding-size"]:
            over.append("Params over the uniform binding size")
        if over and not (k.over_limits(DEFAULT_LIMITS) == over and beyond_defaults_with_a_twin(k, kernels)):
            problems.append(f"{k.label}: {'; '.join(over)}")
    assert not problems, "\n".join(problems)
    assert any(beyond_defaults_with_a_twin(k, kernels) for k in kernels)      # the exception is not vacuous


def test_a_kernel_over_the_limits_says_which(rt, monkeypatch):
    nine = Kernel("elementwise", "add", " ".join(f"t{i}" for i in range(9)))
    assert nine.over_limits(DEFAULT_LIMITS) == ["max-storage-buffers-per-shader-stage 9 (has 8)"]
    assert not nine.supported(type("Small", (), {"features": set(), "limits": DEFAULT_LIMITS})())
    # an op kernel past the device's limits: one line naming the kernel and the limit (the CLI exits 2)
    monkeypatch.setattr(rt, "limits", {**rt.limits, "max-storage-buffers-per-shader-stage": 2})
    monkeypatch.setattr(rt, "_compiled", {})
    x = rt.buffer(16)
    with pytest.raises(DeviceError, match=r"kernel elementwise\.add needs more than .*: "
                                          r"max-storage-buffers-per-shader-stage 3 \(has 2\)$"):
        prepare(rt, Kernel("elementwise", "add", "y! a b"), [(x, 4), (x, 4), (x, 4)], n=4)


def test_the_tuner_leaves_out_candidates_past_the_limits(rt, monkeypatch):
    """At WebGPU's default 16 KiB of workgroup storage the attention candidates that need more are left out,
    and their register-blocked twins remain."""
    B, T, H, D = 1, 64, 2, 64
    t = {name: rt.buffer(4 * B * T * H * D) for name in ("out", "q", "k", "v", "dq", "dk", "dv", "dout")}
    t.update(lse=rt.buffer(4 * B * H * T), stats=rt.buffer(8 * B * H * T), segment_ids=rt.buffer(4 * B * T))
    def names():
        return [c.name for c in attention_kernels.AttentionProblem(rt, "backward", t, B, T, H, H, D).candidates()]
    wide = names()
    monkeypatch.setattr(rt, "limits", {**rt.limits, "max-compute-workgroup-storage-size": 16384})
    narrow = names()
    rt.release(*t.values())
    dropped = set(wide) - set(narrow)
    assert dropped and all(name.startswith("tiles/") for name in dropped)
    assert any(name.startswith("regs/") for name in narrow)


# ---- Tint ---------------------------------------------------------------------------------------------

def _tint(tmp_path, items) -> subprocess.CompletedProcess:
    if NODE is None or not (TINT / "node_modules" / "webgpu").is_dir():
        why = ("Node.js is not installed" if NODE is None else
               f"tools/tint's package is not installed (npm ci --prefix {TINT.relative_to(ROOT)})")
        if REQUIRE_TINT:
            pytest.fail(why + " and WGPU_TRAIN_REQUIRE_TINT=1")
        pytest.skip(why)
    path = tmp_path / "pipelines.json"
    path.write_text(json.dumps(items))
    return subprocess.run([NODE, str(TINT / "validate.mjs"), str(path)], capture_output=True, text=True,
                          timeout=600)


def _item(k: Kernel) -> dict:
    return {"name": k.label, "wgsl": k.text(("f16", "subgroups")), "entry": k.entry,
            "constants": {name: float(value) for name, value in k.constants}}


STORAGE_OVER = re.compile(r"The total use of workgroup storage \((\d+) bytes\) is larger than the maximum allowed")


def _declared_enough(k: Kernel, error: str) -> bool:
    """Whether Tint's error is only that a kernel allowed past the defaults needs the workgroup storage it
    declares (Dawn's null adapter offers only the defaults), and no more than it declares."""
    lines = [line for line in error.splitlines() if line.strip() and not line.lstrip().startswith("- ")]
    found = [STORAGE_OVER.search(line) for line in lines]
    return bool(found) and all(m and int(m.group(1)) <= k.workgroup_bytes for m in found)


def test_tint_accepts_every_kernel(rt, tmp_path):
    kernels = every_kernel(rt)
    proc = _tint(tmp_path, [_item(k) for k in kernels])
    assert proc.returncode in (0, 1), proc.stderr
    by_label = {k.label: k for k in kernels}
    failures = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    allowed = [f for f in failures if beyond_defaults_with_a_twin(by_label[f["name"]], kernels)
               and _declared_enough(by_label[f["name"]], f["error"])]
    report = "\n".join(f"{f['name']}: {f['error']}" for f in failures if f not in allowed)
    assert not report, report
    assert (proc.returncode == 0) == (not failures)


def test_tint_names_a_broken_kernel(tmp_path):
    good = Kernel("elementwise", "copy", "y! x")
    broken = {"name": "broken.main", "wgsl": "@compute @workgroup_size(1) fn main() { let x: f32 = 1u; }",
              "entry": "main", "constants": {}}
    nine = {"name": "nine.main", "entry": "main", "constants": {},
            "wgsl": "".join(f"@group(0) @binding({i}) var<storage, read_write> b{i}: array<f32>;\n" for i in range(9))
            + "@compute @workgroup_size(1) fn main() {" + "".join(f" b{i}[0] = 1.0;" for i in range(9)) + " }"}
    proc = _tint(tmp_path, [_item(good), broken, nine])
    failures = {f["name"]: f["error"] for f in map(json.loads, proc.stdout.splitlines())}
    assert proc.returncode == 1 and set(failures) == {"broken.main", "nine.main"}, proc.stdout + proc.stderr
    assert "f32" in failures["broken.main"] and "u32" in failures["broken.main"]
    assert "storage buffers" in failures["nine.main"]
