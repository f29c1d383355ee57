"""merge --dtype: the merged folder's weights and config.json in the base checkpoint's dtype (auto) or the one asked
for, against PEFT's merge_and_unload on the base model loaded in that dtype; a float16 that cannot hold a merged
weight is one line, and no model is left in --out."""
from __future__ import annotations

import json

import numpy as np
import pytest

from finetune_helpers import build_tokenizer, folder_state, one_line_error, peft_random_b
from tiny_models import build_model, save_model
from tolerances import assert_close
from wgpu_train.cli.main import main

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# how close a merged weight of each dtype is to PEFT's (tests/tolerances.py says why)
TOLERANCE = {"float32": "merged_weights", "bfloat16": "merged_weights_bf16", "float16": "merged_weights_f16"}


@pytest.fixture(scope="module")
def bf16_base(tmp_path_factory):
    """(a tiny Llama saved in bfloat16, a PEFT adapter on it with random A and B)."""
    root = tmp_path_factory.mktemp("merge_dtype")
    folder = root / "model"
    vocab = build_tokenizer(folder)
    save_model(build_model("llama", seed=5, vocab_size=vocab), folder, dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    peft_random_b(pm, seed=1).save_pretrained(root / "adapter")
    return folder, root / "adapter"


def _tensors(folder) -> dict:
    """name -> torch tensor, as stored in the folder's model.safetensors (its own dtype)."""
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _peft_merged(base, adapter, out, dtype: str):
    """PEFT's merge_and_unload of the adapter on the base loaded in `dtype` (auto: as transformers loads it),
    saved as transformers saves it."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=TORCH_DTYPES.get(dtype, "auto"))
    merged = peft.PeftModel.from_pretrained(hf, adapter).merge_and_unload()
    merged.save_pretrained(out)
    return out


@pytest.mark.parametrize("dtype", ["auto", "float32", "float16"])
def test_merged_dtype_is_peft_merge_and_unloads(bf16_base, tmp_path, capsys, dtype):
    """auto keeps the bf16 checkpoint's dtype, as PEFT's merge_and_unload keeps the loaded model's; float32 and
    float16 store every tensor so. Same tensors, same stored dtypes, same config dtype, values within the dtype's
    rounding of PEFT's."""
    base, adapter = bf16_base
    ours = tmp_path / "ours"
    assert main(["merge", "--model", str(base), "--adapter-path", str(adapter), "--out", str(ours),
                 "--dtype", dtype]) == 0
    stored = "bfloat16" if dtype == "auto" else dtype
    assert capsys.readouterr().out.strip() == f"wrote the merged model to {ours} ({stored})"
    theirs = _peft_merged(base, adapter, tmp_path / "peft", dtype)
    got, want = _tensors(ours), _tensors(theirs)
    assert sorted(got) == sorted(want)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    assert {v.dtype for v in got.values()} == {TORCH_DTYPES[stored]}
    config = json.loads((ours / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == json.loads((theirs / "config.json").read_text())["dtype"] \
        == stored
    for name in got:
        assert_close(got[name].float().numpy(), want[name].float().numpy(), TOLERANCE[stored], name)
    merged = [n for n in got if "q_proj" in n]
    base_weights = _tensors(base)
    assert not any(torch.equal(got[n].float(), base_weights[n].float()) for n in merged)   # the update is in


def test_float16_out_of_range_is_one_line_and_leaves_no_model(bf16_base, tmp_path, capsys):
    """A merged weight beyond float16's range (a bf16 base holds 1e5 in a norm): --dtype float16 is one line,
    --out holds no model afterwards (and keeps its other files), and the default dtype then writes it."""
    from safetensors.torch import load_file, save_file

    base, adapter = bf16_base
    wide = tmp_path / "wide"
    wide.mkdir()
    for f in base.iterdir():
        (wide / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(wide / "model.safetensors"))
    tensors["model.norm.weight"][0] = 1e5
    save_file(tensors, str(wide / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = folder_state(out)
    argv = ["merge", "--model", str(wide), "--adapter-path", str(adapter), "--out", str(out)]
    one_line_error(capsys, argv + ["--dtype", "float16"], "model.norm.weight has values up to 99840, beyond "
                                                          "float16's range (65504): save it as bfloat16 or float32")
    assert folder_state(out) == before
    assert main(argv) == 0
    assert _tensors(out)["model.norm.weight"].dtype == torch.bfloat16
    assert np.isclose(float(_tensors(out)["model.norm.weight"][0]), 99840.0)
