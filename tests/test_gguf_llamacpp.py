"""merge --gguf checked by llama.cpp itself (llama-cpp-python): each exported architecture's file loads, and its
logits over a few token ids equal transformers' on the merged folder (f32 file tightly, f16 within its rounding).
Skipped without llama_cpp: PyPI has no binary wheel of llama-cpp-python for this machine and building it from the
sdist takes 10+ minutes on 2 cores, so CI does not build it (docs/guides/merging.md says how to run these)."""
from __future__ import annotations

import numpy as np
import pytest

from test_gguf import _model_and_adapter as dense_model
from test_gguf_hybrid import _model as hybrid_model, lfm2_moe_model
from test_gguf_moe import _model_and_adapter as moe_model
from tolerances import assert_close
from wgpu_train.cli.main import main

llama_cpp = pytest.importorskip("llama_cpp")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

IDS = [1, 5, 9, 2, 7, 11, 3, 4, 30, 8]
GGML_F32 = 0               # ggml_type of the KV cache: float32, so that the f32 file's check has no f16 rounding
DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")
HYBRID = ("smollm3", "lfm2", "lfm2_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next")


def llama_cpp_logits(path, ids) -> np.ndarray:
    """(T, V) logits of llama.cpp evaluating `ids` (no BOS added) with the GGUF at `path` (CPU, float32 KV cache)."""
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=32, n_batch=32, n_threads=2, verbose=False,
                          type_k=GGML_F32, type_v=GGML_F32, flash_attn=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)], dtype=np.float32)
    finally:
        llm.close()


def transformers_logits(folder, ids) -> np.ndarray:
    """(T, V) logits of the merged folder in transformers (float32, eager attention and experts)."""
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def _build(root, kind):
    if kind in DENSE:
        folder, adapter, _ = dense_model(root, kind)
    elif kind in MOE:
        folder, adapter = moe_model(root, kind)
    elif kind == "lfm2_moe":
        folder, adapter, _ = lfm2_moe_model(root)
    else:
        folder, adapter, _ = hybrid_model(root, kind)
    return folder, adapter


@pytest.mark.parametrize("kind", DENSE + MOE + HYBRID)
def test_llama_cpp_gives_the_merged_logits(tmp_path, kind):
    folder, adapter = _build(tmp_path, kind)
    merged = tmp_path / "merged"
    f32 = "llamacpp_f32_logits_qwen35moe" if kind == "qwen3_5_moe" else "llamacpp_f32_logits"
    for gguf_type, tolerance in (("f32", f32), ("f16", "llamacpp_f16_logits")):
        out = tmp_path / f"{kind}-{gguf_type}.gguf"
        assert main(["merge", "--model", str(folder), "--adapter-path", str(adapter), "--out", str(merged),
                     "--overwrite", "--gguf", str(out), "--gguf-type", gguf_type]) == 0
        want = transformers_logits(merged, IDS)
        assert_close(llama_cpp_logits(out, IDS), want, tolerance, f"{kind} {gguf_type}")
