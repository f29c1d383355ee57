"""A broken WGSL shader surfaces as wgpu_train.errors.ShaderError naming the file, line and column of
the problem, from given source and from a file on the shader path; the shipped op shaders compile."""
from __future__ import annotations

import re

import pytest

from wgpu_train.errors import ShaderError, WgpuTrainError
from wgpu_train.engines.webgpu.device import runtime, shaders, storage

BROKEN = {  # kind: (source, line, column) of the first diagnostic naga reports
    "missing-semicolon": ("@compute @workgroup_size(1)\nfn main() {\n    let x = 1.0\n    let y = 2.0;\n}\n", 4, 5),
    "type-mismatch": ("@group(0) @binding(0) var<storage, read_write> a: array<f32>;\n\n@compute @workgroup_size(1)\n"
                      "fn main() {\n    a[0] = 1u;\n}\n", 5, 5),
    "store-to-read-only": ("@group(0) @binding(0) var<storage, read> a: array<f32>;\n@compute @workgroup_size(1)\n"
                           "fn main() {\n    a[0] = 1.0;\n}\n", 4, 5),   # a validation (not parse) error
    "unknown-identifier": ("@compute @workgroup_size(1)\nfn main() {\n\n\n    let y = undefined_thing + 1.0;\n}\n", 5, 13),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_broken_source_names_file_and_line(rt, kind):
    source, line, col = BROKEN[kind]
    with pytest.raises(ShaderError) as info:
        rt.pipeline(f"broken_{kind}", "main", source=source)
    msg = str(info.value)
    assert msg.startswith(f"broken_{kind}.wgsl:{line}:{col}: "), msg
    assert "\n" not in msg, "one clear line"
    assert isinstance(info.value, WgpuTrainError)


def test_broken_file_names_its_path(rt, tmp_path, monkeypatch):
    path = tmp_path / "broken_on_disk.wgsl"
    path.write_text("// a shader with an error on line 6\n\n@compute @workgroup_size(1)\nfn main() {\n"
                    "    var x: f32 = 0.0;\n    x = x + true;\n}\n")
    monkeypatch.setattr(shaders, "shader_dirs", lambda: [tmp_path])
    with pytest.raises(ShaderError, match=re.escape(f"{path}:6:9: ") + ".*Operation Add"):
        rt.pipeline("broken_on_disk", "main")


def test_missing_entry_point_names_the_file(rt):
    with pytest.raises(ShaderError, match=re.escape(str(runtime.shader_path("elementwise")))):
        rt.pipeline("elementwise", "no_such_entry_point")


# The op shaders of wgpu_train/engines/webwebgpu/kernels.py (others' shaders have their own tests).
OP_SHADERS = {
    "elementwise": ["add", "add_inplace", "scale", "scale_inplace", "softcap_forward", "softcap_forward_inplace", "copy", "fill",
                    "columns_get", "columns_put"],
    "swiglu": ["swiglu_forward", "swiglu_backward", "swiglu_backward_inplace", "geglu_forward", "geglu_backward",
               "sigmoid_gate_forward", "sigmoid_gate_backward", "mul_forward", "mul_backward",
               "sigmoid_gate_elems_forward", "sigmoid_gate_elems_backward", "gelu_forward",
               "gelu_backward"],
    "rmsnorm": ["rmsnorm_forward", "rmsnorm_backward", "rmsnorm_forward_row", "rmsnorm_backward_row",
                "rmsnorm_forward_row4", "rmsnorm_backward_row4", "rmsnorm_backward_partial4",
                "rmsnorm_backward_partial4v", "rmsnorm_backward_weight", "layernorm_forward_row", "layernorm_forward",
                "layernorm_backward_row"],
    "rope": ["rope_forward", "rope_backward", "rope_forward_inplace", "rope_backward_inplace"],
    "attention": ["attention_forward", "attention_backward_delta", "attention_backward", "attention_backward_dkv",
                  "attention_forward_vec4", "attention_backward_vec4", "attention_backward_dkv_vec4"],
    "cross_entropy": ["cross_entropy_forward", "softmax_entropy_forward", "cross_entropy_reduce",
                      "cross_entropy_backward", "cross_entropy_backward_inplace"],
    "token_objective": ["token_objective_backward"],
    "embedding": ["embedding_forward", "embedding_backward_links", "embedding_backward", "row_gather_backward"],
    "adamw": ["adamw_update", "grad_norm_partial", "grad_norm_finalize"],
}


def test_op_shaders_compile(rt):
    for name, entries in OP_SHADERS.items():
        found = set(re.findall(r"@compute[^\n]*\n\s*fn (\w+)", runtime.shader_path(name).read_text()))
        assert found == set(entries), f"{name}.wgsl entry points {sorted(found)}"
        # vec4 views and tensor markers (device/storage.py) declared for float32 tensors, as a launch does
        source = storage.expand(storage.views(runtime.shader_text(name), ()), {})
        for entry in entries:
            rt.pipeline(name, entry, {"D": 128} if name == "attention" else None, source=source)
