"""The server's running batch (engines/generate.py's DecodeBatch) on both engines: rows that join at different
steps, their prompts prefilled a few tokens a step beside the decoding rows, each with its own sampling, give
the tokens generate() gives each prompt alone; prompt log-probabilities across chunks are a whole forward
pass's; a removed row frees its slot while the others run on."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from tiny_models import build_model, save_model
from tolerances import assert_close
from wgpu_train.engines.generate import DecodeBatch, Sampling, log_probs, penalised

SETTINGS = [Sampling(), Sampling(temperature=1.2, top_k=9, seed=4), Sampling(temperature=0.8, top_p=0.7, seed=8),
            Sampling(frequency_penalty=1.0, presence_penalty=0.5), Sampling(temperature=1.0, seed=1)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_model(build_model("llama", seed=1), tmp_path_factory.mktemp("llama"))


def _model(tiny, rt=None):
    """The tiny model on the NumPy engine, or on the adapter rt."""
    return wt.load_model(tiny, backend="wgpu", device=str(rt.info.index)) if rt else wt.load_model(tiny, backend="numpy")


def _alone(model, prompt, budget, sampling: Sampling) -> list:
    """The row's tokens from a batch of its own (the penalties need one: generate() has none)."""
    batch = DecodeBatch(model.engine, 1, 64)
    try:
        batch.add(prompt, budget, sampling)
        out = []
        while len(batch):
            out += [t.id for t in batch.step()]
        return out
    finally:
        batch.close()


def _staggered(model, prompts, budget: int) -> list:
    """Each prompt joins a 3-row batch of 3-token steps one step after the one before it, when a slot is free."""
    batch = DecodeBatch(model.engine, 3, 64, token_budget=3)
    out, slot_of, waiting = [[] for _ in prompts], {}, list(range(len(prompts)))
    try:
        while waiting or len(batch):
            if waiting and batch.free_slots():
                i = waiting.pop(0)
                slot_of[batch.add(prompts[i], budget, SETTINGS[i % len(SETTINGS)])] = i
            for token in batch.step():
                out[slot_of[token.slot]].append(token.id)
        return out
    finally:
        batch.close()


def _prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 83, n) for n in (7, 2, 11, 5, 4)]


def test_rows_joining_at_any_step_answer_as_alone_on_numpy(tiny):
    _rows_join(_model(tiny))


def test_rows_joining_at_any_step_answer_as_alone_on_webgpu(tiny, rt):
    _rows_join(_model(tiny, rt))


def _rows_join(model):
    prompts = _prompts()
    together = _staggered(model, prompts, 9)
    alone = [_alone(model, p, 9, SETTINGS[i % len(SETTINGS)]) for i, p in enumerate(prompts)]
    assert together == alone
    greedy = model.generate(prompts[0], max_new_tokens=9)
    assert alone[0] == greedy
    sampled = SETTINGS[1]
    assert alone[1] == model.generate(prompts[1], max_new_tokens=9, temperature=sampled.temperature,
                                      top_k=sampled.top_k, seed=sampled.seed)


def test_prompt_logprobs_across_prefill_chunks_are_a_whole_forwards_on_numpy(tiny):
    _prompt_logprobs(_model(tiny))


def test_prompt_logprobs_across_prefill_chunks_are_a_whole_forwards_on_webgpu(tiny, rt):
    _prompt_logprobs(_model(tiny, rt))


def _prompt_logprobs(model):
    prompt = _prompts()[2]                                                       # 11 tokens: 4 chunks of 3
    batch = DecodeBatch(model.engine, 2, 32, token_budget=3)
    try:
        batch.add(prompt, 2, logprobs=3, prompt_logprobs=True)
        first = []
        while not first:
            first = batch.step()
    finally:
        batch.close()
    token = first[0]
    z = model.logits(prompt[None])[0].astype(np.float64)                         # (T, V)
    lp = z - z.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    assert [e[0] for e in token.prompt] == prompt[1:].tolist()
    assert_close(np.array([e[1] for e in token.prompt]), lp[np.arange(10), prompt[1:]], "serve_logprobs",
                 f"prompt log-probabilities ({model.backend})")
    assert token.id == int(np.argmax(z[-1])) and token.top[0][0] == token.id and len(token.top) == 3
    assert_close(np.array([token.logprob]), lp[-1, token.id:token.id + 1], "serve_logprobs", "the token's")


def test_a_removed_row_frees_its_slot_and_the_others_run_on(tiny):
    model = _model(tiny)
    prompts = _prompts()
    batch = DecodeBatch(model.engine, 2, 64)
    try:
        kept = batch.add(prompts[0], 6)
        gone = batch.add(prompts[1], 6)
        with pytest.raises(ValueError, match="0 free slots"):
            batch.add(prompts[2], 6)
        out = [t.id for t in batch.step() if t.slot == kept]
        batch.remove(gone)
        assert batch.free_slots() == 1 and len(batch) == 1
        again = batch.add(prompts[3], 6)
        assert again == gone
        while len(batch):
            out += [t.id for t in batch.step() if t.slot == kept]
    finally:
        batch.close()
    assert out == model.generate(prompts[0], max_new_tokens=6)


def test_log_probs_and_penalties():
    logits = np.array([1.0, 3.0, 3.0, -2.0, 0.5], np.float32)
    lp, top = log_probs(logits, 4, 3)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    assert lp == pytest.approx(ref[4], abs=1e-12)
    assert [i for i, _ in top] == [1, 2, 0]                     # a tie: the lower id first
    out = penalised(logits, {1: 3, 4: 1}, Sampling(presence_penalty=0.5, frequency_penalty=1.0))
    assert out.tolist() == [1.0, 3.0 - 3.5, 3.0, -2.0, 0.5 - 1.5]
    assert penalised(logits, {1: 3}, Sampling()) is logits


def _prefix_reuse(model):
    """A row of the same key whose prompt begins as a finished row's did takes its slot and prefills only the
    rest, and answers as alone; another key reuses nothing."""
    rng = np.random.default_rng(7)
    shared = rng.integers(0, 83, 12)
    first, second, other = (np.concatenate([shared, tail]) for tail in ([5, 6], [7, 8, 9], [7, 8, 9]))
    fed = []
    inner = model.engine.forward_rows
    model.engine.forward_rows = lambda ids, *a, **kw: fed.append(len(ids)) or inner(ids, *a, **kw)
    batch = DecodeBatch(model.engine, 2, 64)
    try:
        slot = batch.add(first, 4, prefix_key="a")
        out = _drain(batch)
        assert out == model.generate(first, max_new_tokens=4)
        fed.clear()
        assert batch.add(second, 4, prefix_key="a") == slot and batch.reused == 12
        assert _drain(batch) == model.generate(second, max_new_tokens=4)
        assert fed[0] == 3                              # its prompt's last 3 tokens, not 15
        batch.add(other, 4, prefix_key="b")
        assert batch.reused == 12
        assert _drain(batch) == model.generate(other, max_new_tokens=4)
    finally:
        batch.close()
        del model.engine.forward_rows


def _drain(batch) -> list:
    out = []
    while len(batch):
        out += [t.id for t in batch.step()]
    return out


def test_prefix_reuse_on_numpy(tiny):
    _prefix_reuse(_model(tiny))


def test_prefix_reuse_on_webgpu(tiny, rt):
    _prefix_reuse(_model(tiny, rt))
