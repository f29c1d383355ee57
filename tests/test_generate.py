"""Batched generation (generate_batch) on both engines: rows stop independently, seeded sampling per row,
one-line errors, the model's positions respected, and exact match (the same whatever its batch size, reasoning
blocks left out of the comparison, prompts too long for the positions skipped and counted)."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from wgpu_train.data.sources import load_records
from wgpu_train.errors import ConfigError, DeviceError
from wgpu_train.training.evaluate import answer_text, exact_match, generation_prompt
from wgpu_train.engines.generate import generate, generate_batch, sample_next
from wgpu_train.formats.tokenizer import load_tokenizer
from wgpu_train.training.config import default_data_dir, default_model_dir

from tiny_models import build_model, save_model

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A saved tiny random Llama (vocabulary 83)."""
    return save_model(build_model("llama", seed=1), tmp_path_factory.mktemp("llama"))


def _models(path, rt):
    """The tiny model on the NumPy engine and on the adapter rt, with the same random LoRA (B nonzero)."""
    lora = wt.LoraConfig(r=4, alpha=16, target_modules="all-linear")
    ref = wt.load_model(path, backend="numpy")
    ref.add_lora(lora, seed=2)
    rng = np.random.default_rng(3)
    ref._set_lora(lora, {p: (a, rng.normal(0, 0.1, b.shape).astype(np.float32))
                         for p, (a, b) in ref.engine.lora_tensors().items()}, seed=2)
    gpu = wt.load_model(path, backend="wgpu", device=str(rt.info.index))
    gpu._set_lora(lora, ref.engine.lora_tensors(), seed=2)
    return ref, gpu


def _prompts(seed=6, lengths=(4, 7, 2)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 83, n) for n in lengths]


def test_rows_stop_independently(tiny, rt):
    """One row ends at a stop token (included), another at its budget, a third runs on; each row gives what
    generate() gives for its prompt alone."""
    ref, gpu = _models(tiny, rt)
    prompts = _prompts()
    free = [ref.generate(p, max_new_tokens=10) for p in prompts]
    # a stop token that row 0 meets before its budget and rows 1 and 2 never produce
    stop = next(t for t in free[0][1:] if t not in free[1] + free[2])
    budgets = [10, 4, 10]
    expected = [ref.generate(p, max_new_tokens=b, stop_token_ids=[stop]) for p, b in zip(prompts, budgets)]
    assert expected[0][-1] == stop and len(expected[0]) < 10
    assert len(expected[1]) == 4 and stop not in expected[1] and len(expected[2]) == 10
    for m in (ref, gpu):
        assert m.generate_batch(prompts, max_new_tokens=budgets, stop_token_ids=[stop]) == expected, m.backend
    # a shared max_len ends every row whose cache row fills first, as it does for generate()
    short = [generate(ref.engine, p, max_new_tokens=10, max_len=9) for p in prompts]
    assert [len(s) for s in short] == [10 - p.size for p in prompts]
    assert generate_batch(gpu.engine, prompts, max_new_tokens=10, max_len=9) == short


@pytest.mark.parametrize("kernel", ["decode/single", "decode/split32"])
def test_long_generation_on_either_cached_attention_pass(tiny, rt, kernel, monkeypatch):
    """Greedy tokens of rows that grow past several 32-position chunks of the cache equal the NumPy engine's,
    with the cached attention's single pass and with its split one (decode_kernels) forced."""
    from wgpu_train.engines.webgpu.tuned import decode_kernels, tune

    ref, gpu = _models(tiny, rt)
    prompts = _prompts(lengths=(40, 9, 23))
    expected = ref.generate_batch(prompts, max_new_tokens=30)
    ran = []
    for cls in (decode_kernels.Single, decode_kernels.Split):
        original = cls.dispatches
        monkeypatch.setattr(cls, "dispatches", lambda self, p, original=original: ran.append(self.name) or
                            original(self, p))
    with tune.pinned(kernel):
        assert gpu.generate_batch(prompts, max_new_tokens=30) == expected
    assert kernel in ran        # the decoding steps ran the pinned pass


def test_seeded_sampling_per_row(tiny, rt):
    """Row i samples from default_rng(seed_i): the batch repeats itself, gives generate()'s tokens with the same
    seed, agrees across engines, and distinct seeds give distinct samples of one prompt."""
    ref, gpu = _models(tiny, rt)
    prompts = _prompts(seed=8)
    kw = dict(max_new_tokens=8, temperature=1.3, top_k=20, top_p=0.9)
    batch = gpu.generate_batch(prompts, seed=11, **kw)
    assert batch == gpu.generate_batch(prompts, seed=11, **kw) == ref.generate_batch(prompts, seed=11, **kw)
    assert batch == [gpu.generate(p, seed=11, **kw) for p in prompts]
    seeds = [11, 12, 13, 14]
    same_prompt = ref.generate_batch([prompts[0]] * 4, seed=seeds, **kw)
    assert same_prompt == [ref.generate(prompts[0], seed=s, **kw) for s in seeds]
    assert len({tuple(s) for s in same_prompt}) > 1


def test_generate_batch_refuses_bad_input_in_one_line(tiny):
    model = wt.load_model(tiny, backend="numpy")
    cases = [(dict(prompts=[]), "at least one prompt"),
             (dict(prompts=[[1, 2], []]), "at least one token"),
             (dict(prompts=[[1, 2]], max_new_tokens=[3, 4]), "2 values for 1 prompts"),
             (dict(prompts=[[1, 2]], max_new_tokens=[-1]), ">= 0"),
             (dict(prompts=[[1, 2]], seed=[1, 2]), "seed"),
             (dict(prompts=[[1, 2, 3, 4]], max_len=3), "prompt 0 has 4 tokens, more than max_len 3"),
             (dict(prompts=[[1, 2]], top_p=-0.1), "top_p"),
             (dict(prompts=[[1, 2]], temperature=float("nan")), "finite temperature"),
             (dict(prompts=[[1, 83]]), r"token ids must lie in \[0, 83\)")]
    for kw, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            model.generate_batch(**kw)
        assert "\n" not in str(info.value)
    assert model.generate_batch([[1, 2], [3]], max_new_tokens=0) == [[], []]


def test_tiny_temperatures_and_top_p_0_sample_the_likeliest_token(tiny):
    """A temperature whose division overflows (5e-324) is the softmax's limit, the argmax (ties shared), not NaN
    probabilities; top_p 0 keeps the smallest nucleus, the one likeliest token; generate answers both greedily."""
    rng = np.random.default_rng(0)
    logits = np.array([1.0, 3.0, -2.0, 3.0, 0.5], np.float32)
    draws = {sample_next(logits, 5e-324, 0, 1.0, rng) for _ in range(50)}
    assert draws == {1, 3}                                      # the two tied maxima, nothing else
    assert {sample_next(logits, 1e-300, 2, 1.0, rng) for _ in range(20)} <= {1, 3}
    assert {sample_next(logits[:3], 1.5, 0, 0.0, rng) for _ in range(20)} == {1}
    model = wt.load_model(tiny, backend="numpy")
    greedy = model.generate([1, 2, 3], max_new_tokens=6)
    assert model.generate([1, 2, 3], max_new_tokens=6, temperature=5e-324, seed=1) == greedy
    assert model.generate([1, 2, 3], max_new_tokens=6, temperature=1.5, top_p=0.0, seed=1) == greedy


def test_kv_cache_over_the_binding_limit_is_refused(tiny, rt):
    gpu = wt.load_model(tiny, backend="wgpu", device=str(rt.info.index))
    with pytest.raises(DeviceError, match="KV cache of 100000 x 4096 positions"):
        gpu.engine.new_kv_cache(100000, 4096)


def test_kv_caches_are_freed_and_calls_checked(tiny, rt, monkeypatch):
    """Each generate_batch frees its KV cache when it returns (also when it fails); forward_rows refuses ids
    outside the vocabulary and two tokens writing one cache slot, on both engines."""
    ref, gpu = _models(tiny, rt)
    released = []
    real = rt.release
    monkeypatch.setattr(rt, "release", lambda *bufs: (released.extend(bufs), real(*bufs))[1])
    for _ in range(2):
        gpu.generate_batch(_prompts(), max_new_tokens=3)
    caches = [b for b in released if b.label in ("k_cache", "v_cache")]
    assert len(caches) == 2 * 2 * gpu.config.num_hidden_layers            # 2 calls x (k, v) x layers
    for model in (ref, gpu):
        kv = model.engine.new_kv_cache(2, 8)
        with pytest.raises(ValueError, match="token ids must lie in"):
            model.engine.forward_rows(np.array([5, 83]), np.array([0, 1]), np.array([0, 0]), kv, np.array([1]))
        with pytest.raises(ValueError, match="same cache row and position"):
            model.engine.forward_rows(np.array([5, 6]), np.array([1, 1]), np.array([3, 3]), kv, np.array([1]))
        model.engine.free_kv_cache(kv)


def test_full_finetune_of_stored_weights_is_refused_by_the_engine(tiny, rt):
    gpu = wt.load_model(tiny, backend="wgpu", device=str(rt.info.index), base_dtype="nf4")
    with pytest.raises(ConfigError, match="full fine-tuning needs float32 weights, but lm_head.weight is stored as "
                                          "float16"):
        gpu.engine.set_full_finetune(True)


def test_exact_match_is_the_same_at_any_batch_size(rt):
    """Exact match over held-out records of the embedded model with batch sizes 1 and 8 (ragged prompts, a last
    partial batch): the same outputs, on both engines. Six references are set to the model's own greedy answer
    (generate(), one prompt at a time), so those six must match."""
    tok = load_tokenizer(default_model_dir())
    records = [list(r) for r in load_records(default_data_dir() / "test.jsonl")[0][:11]]
    ref = wt.load_model(default_model_dir(), backend="numpy")
    stops = set(tok.stop_token_ids)
    for r in records[:6]:
        out = ref.generate(generation_prompt(tok, r), max_new_tokens=8, stop_token_ids=tok.stop_token_ids)
        r[-1] = {"role": "assistant", "content": tok.decode([t for t in out if t not in stops],
                                                            skip_special_tokens=False)}
    gpu = wt.load_model(default_model_dir(), backend="wgpu", device=str(rt.info.index))
    results = [exact_match(m, tok, records, max_new_tokens=8, keep_samples=len(records), batch_size=bs)
               for m in (ref, gpu) for bs in (1, 8)]
    assert all(r == results[0] for r in results[1:])
    assert results[0]["n"] == 11 and results[0]["correct"] >= 6
    assert all(s["match"] for s in results[0]["samples"][:6])
    with pytest.raises(ConfigError, match="batch size"):
        exact_match(ref, tok, records, batch_size=0)


def test_generate_refuses_a_batch_of_prompts(tiny):
    """Model.generate answers one prompt: a (1, T) array is that prompt, several rows are refused (pointing to
    generate_batch) instead of being read as one long prompt."""
    model = wt.load_model(tiny, backend="numpy")
    prompt = _prompts(lengths=(5,))[0]
    assert model.generate(prompt[None], max_new_tokens=4) == model.generate(prompt, max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"one prompt of shape \(T,\), got shape \(2, 5\); use generate_batch"):
        model.generate(np.stack([prompt, prompt]), max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"prompt 1 has shape \(1, 5\)"):
        model.generate_batch([prompt, prompt[None]], max_new_tokens=4)


def test_generation_stays_within_max_position_embeddings(tiny):
    """The tiny model has 128 positions: a prompt whose length plus max_new_tokens exceeds them is refused in
    one line (generate and generate_batch); exactly 128 is fine, and so is a max_len that ends the row in time."""
    model = wt.load_model(tiny, backend="numpy")
    prompt = np.arange(120) % 83
    assert len(model.generate(prompt, max_new_tokens=8)) == 8
    with pytest.raises(ConfigError, match=r"^the prompt has 120 tokens and max_new_tokens 9: more than the model's "
                                          r"max_position_embeddings 128 \(at most 8 new tokens fit\)$"):
        model.generate(prompt, max_new_tokens=9)
    with pytest.raises(ConfigError, match="prompt 1 has 120 tokens and max_new_tokens 30"):
        model.generate_batch([prompt[:3], prompt], max_new_tokens=30)
    with pytest.raises(ConfigError, match=r"\(the prompt alone fills them\)"):
        model.generate(np.arange(130) % 83, max_new_tokens=1)
    # a full cache row ends a row with max_len - length + 1 tokens (the last one is never fed back)
    assert [len(o) for o in model.generate_batch([prompt[:3], prompt], max_new_tokens=30, max_len=127)] == [30, 8]
    with pytest.raises(ConfigError, match="max_position_embeddings 128"):
        model.generate_batch([prompt[:3], prompt], max_new_tokens=30, max_len=128)


class _Answers:
    """A stand-in model that answers every prompt with the same text, then the stop token."""

    def __init__(self, tok, text):
        self.ids = tok.encode(text) + [tok.stop_token_ids[0]]

    def generate_batch(self, prompts, max_new_tokens, temperature, stop_token_ids):
        return [self.ids[:budget] for budget in max_new_tokens]


def test_exact_match_leaves_a_reasoning_block_out():
    """Qwen3's template trains an empty <think> block before every answer; the comparison leaves a leading
    one out of the output and of the reference (and the whitespace around it), nothing else."""
    tok = load_tokenizer(default_model_dir())
    question = {"role": "user", "content": "Reverse the order of these words: red fox moon"}
    records = [[question, {"role": "assistant", "content": "moon fox red"}],
               [question, {"role": "assistant", "content": "<think>three words</think> moon fox red"}]]
    for output in ("<think>\n\n</think>\n\nmoon fox red", " moon fox red\n", "<think>x\ny</think>moon fox red"):
        result = exact_match(_Answers(tok, output), tok, records)
        assert (result["correct"], result["n"]) == (2, 2), output
        assert result["samples"][0]["output"] == output
    for output in ("moon fox red <think></think>", "<think>moon fox red", "fox <think></think> moon fox red"):
        assert exact_match(_Answers(tok, output), tok, records)["correct"] == 0, output
    assert answer_text("  <think>\n</think>\n\n a b \n") == "a b" and answer_text("a <think></think>") == \
        "a <think></think>"


def test_exact_match_skips_prompts_too_long_for_the_positions():
    """A prompt that leaves no room for its reference (and an end token) within max_seq_len or the model's
    max_position_embeddings is not asked but counted in skipped_too_long; one that leaves some room is asked
    with its budget cut to fit (here the embedded model, 256 positions, answers the short prompts right)."""
    tok = load_tokenizer(default_model_dir())
    model = wt.load_model(default_model_dir(), backend="numpy")
    records = [list(r) for r in load_records(default_data_dir() / "test.jsonl")[0][:3]]
    for r in records:
        out = model.generate(generation_prompt(tok, r), max_new_tokens=12, stop_token_ids=tok.stop_token_ids)
        r[-1] = {"role": "assistant", "content": tok.decode([t for t in out if t not in tok.stop_token_ids])}
    long = [{"role": "user", "content": "Reverse the order of these words: " + "red " * 300},
            {"role": "assistant", "content": "red"}]
    result = exact_match(model, tok, records + [long], max_new_tokens=12)
    assert (result["n"], result["skipped_too_long"], result["correct"]) == (3, 1, 3)
    lengths = [len(generation_prompt(tok, r)) for r in records]
    wanted = [len(tok.encode(r[-1]["content"])) for r in records]
    tight = max(lengths) + max(wanted) + 1          # every prompt fits with room for its answer and end token
    result = exact_match(model, tok, records + [long], max_new_tokens=12, max_seq_len=tight)
    assert (result["n"], result["skipped_too_long"], result["correct"]) == (3, 1, 3)
    result = exact_match(model, tok, records, max_new_tokens=12, max_seq_len=min(lengths) + 1)
    assert (result["n"], result["skipped_too_long"]) == (0, 3) and result["exact_match"] is None
    assert exact_match(model, tok, records + [long], max_new_tokens=12, max_samples=2)["n"] == 2
