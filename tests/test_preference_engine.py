"""The engine primitives preference objectives stand on, on both engines: per-token losses (sequence
log-probabilities), per-token gradient weights in forward_backward and train_step, and the adapter switched off
(the reference model), against the NumPy engine, finite differences and transformers."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import wgpu_train as wt
from wgpu_train.data.preference_batching import kl_partners
from wgpu_train.data.preference_tokenize import PreferenceExample, UnpairedExample
from wgpu_train.engines.shared.labels import shift_labels
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.training.objectives import PreferenceSettings
from wgpu_train.training.preference_scoring import ADAPTER_OFF, PreferenceScorer
from wgpu_train.training.preference_trainer import PreferenceTrainer

from tiny_models import build_model, save_model
from tolerances import assert_close

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    hf = build_model("llama", seed=4)
    path = tmp_path_factory.mktemp("pref_engine")
    save_model(hf, path)
    return path, hf


def _batch(seed=0, vocab=83):
    """Three rows of 11 tokens, the last right-padded; a prompt of 4 tokens carries no loss."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (3, 11)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[2, 8:] = 0
    labels = ids.astype(np.int64)
    labels[:, :4] = -100
    labels[mask == 0] = -100
    pos = np.broadcast_to(np.arange(11, dtype=np.int32), ids.shape).copy()
    return ids, shift_labels(labels), mask.astype(np.int32), pos


def _models(path, rt, lora=True):
    """The same LoRA model (B random, so that the adapter changes the outputs) on both engines."""
    lora_cfg = wt.LoraConfig(r=3, alpha=6, target_modules="all-linear")
    ref = wt.load_model(path, backend="numpy")
    gpu = wt.load_model(path, backend="wgpu", device=str(rt.info.index))
    if lora:
        ref.add_lora(lora_cfg, seed=2)
        rng = np.random.default_rng(7)
        modules = {p: (a, rng.normal(0, 0.2, b.shape).astype(np.float32))
                   for p, (a, b) in ref.engine.lora_tensors().items()}
        ref._set_lora(lora_cfg, modules, seed=2)
        gpu._set_lora(lora_cfg, ref.engine.lora_tensors(), seed=2)
    return ref, gpu


def test_token_losses_are_minus_log_probabilities(folder, rt):
    """token_losses equals -log_softmax(logits)[target] of transformers' model, on both engines, 0 where ignored."""
    path, hf = folder
    ref, gpu = _models(path, rt, lora=False)
    ids, targets, seg, pos = _batch()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor(ids.astype(np.int64)),
                                    attention_mask=torch.tensor(seg)).logits.double(), -1).numpy()
    valid = targets != -100
    want = np.where(valid, -np.take_along_axis(logp, np.where(valid, targets, 0)[..., None], -1)[..., 0], 0.0)
    for model in (ref, gpu):
        got = model.engine.token_losses(ids, targets, seg, pos)
        assert got.shape == ids.shape and np.all(got[~valid] == 0)
        assert_close(got, want, "gpu_logits", model.backend)
    loss_sum, count = ref.engine.loss(ids, targets, seg, pos)
    assert count == int(valid.sum())
    assert_close(np.float64(ref.engine.token_losses(ids, targets, seg, pos).sum()), np.float64(loss_sum), "gpu_loss")


def test_adapter_switched_off_is_the_base_model(folder, rt):
    """set_adapter_enabled(False): the losses of the model without LoRA; on again: the adapter's."""
    path, _ = folder
    ids, targets, seg, pos = _batch(1)
    base = wt.load_model(path, backend="numpy").engine.token_losses(ids, targets, seg, pos)
    for model in _models(path, rt):
        with_adapter = model.engine.token_losses(ids, targets, seg, pos)
        assert np.abs(with_adapter - base).max() > 1e-3, model.backend      # the adapter matters here
        model.engine.set_adapter_enabled(False)
        assert_close(model.engine.token_losses(ids, targets, seg, pos), base, "gpu_logits", model.backend)
        model.engine.set_adapter_enabled(True)
        assert_close(model.engine.token_losses(ids, targets, seg, pos), with_adapter, "gpu_logits", model.backend)


def test_reference_losses_in_the_same_call(folder, rt):
    """token_losses(reference=True): the losses with the adapter on and switched off, as two calls give them (bit
    for bit on the GPU: the same kernels on the same inputs), in one submission and one readback there; the
    adapter stays on afterwards. Two batches: one whose loss head gathers its trained rows (a prompt carries no
    loss), one whose head takes every row (2 x 8 tokens, each but the last trained)."""
    path, _ = folder
    short = np.random.default_rng(8).integers(0, 83, (2, 8)).astype(np.int32)
    every = (short, shift_labels(short.astype(np.int64)), np.ones_like(short),
             np.broadcast_to(np.arange(8, dtype=np.int32), short.shape).copy())
    for model, (ids, targets, seg, pos) in itertools.product(_models(path, rt), (_batch(1), every)):
        engine = model.engine
        with_adapter = engine.token_losses(ids, targets, seg, pos)
        engine.set_adapter_enabled(False)
        without = engine.token_losses(ids, targets, seg, pos)
        engine.set_adapter_enabled(True)
        before = dict(engine.counters)
        policy, reference = engine.token_losses(ids, targets, seg, pos, reference=True)
        if model.backend == "wgpu":
            assert [engine.counters[k] - before[k] for k in ("submits", "readbacks")] == [1, 1]
        np.testing.assert_array_equal(policy, with_adapter, err_msg=model.backend)
        np.testing.assert_array_equal(reference, without, err_msg=model.backend)
        assert np.abs(policy - reference).max() > 1e-3, model.backend      # the adapter matters here
        np.testing.assert_array_equal(engine.token_losses(ids, targets, seg, pos), with_adapter, err_msg=model.backend)


def _examples(objective: str, n: int = 4, vocab: int = 83) -> list:
    """n tokenized preference pairs (KTO: unpaired examples, both labels) of random tokens and uneven lengths."""
    rng = np.random.default_rng(6)

    def tokens(k):
        return rng.integers(1, vocab, k).astype(np.int32)
    if objective == "kto":
        return [UnpairedExample(tokens(3 + i % 3), tokens(2 + i % 2), bool(i % 2)) for i in range(n)]
    return [PreferenceExample(tokens(3 + i % 3), tokens(2 + i % 2), tokens(3 - i % 2)) for i in range(n)]


def _scored_apart(scorer, engine, examples, partners):
    """The adapter-off reference scored in calls of its own (the adapter switched off around them)."""
    def reference(indices, mismatched: bool):
        engine.set_adapter_enabled(False)
        try:
            return scorer.score(engine, examples, indices, partners if mismatched else None).logps
        finally:
            engine.set_adapter_enabled(True)
    return reference


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_step_scores_the_reference_with_the_policy(folder, rt, monkeypatch, objective):
    """A preference step of two micro-batches with the adapter switched off as the reference (ADAPTER_OFF): the
    policy and the reference of a micro-batch scored in one submission and one readback on the GPU (DPO's step:
    2 per micro-batch, the optimizer step's included, where scoring them apart takes 3; KTO's KL rows alike),
    with bit for bit the objective, its metrics and the parameters after the step of scoring them apart on the
    GPU (the same kernels on the same inputs), and exactly those on NumPy."""
    monkeypatch.setenv("WGPU_TRAIN_MAX_SUBMIT_S", "inf")       # the optimizer step in one submission
    path, _ = folder
    examples = _examples(objective)
    scorer = PreferenceScorer(PreferenceSettings(objective), batch_size=2, pad_id=0)
    partners = kl_partners(len(examples), 2) if objective == "kto" else None
    indices = np.arange(len(examples))
    n_micro = 2                                                 # 4 examples, batch_size 2
    runs = {}
    for how in ("apart", "joint"):
        for model in _models(path, rt):
            engine = model.engine
            reference = _scored_apart(scorer, engine, examples, partners) if how == "apart" else ADAPTER_OFF
            before = dict(engine.counters)
            result, scored = scorer.objective(engine, examples, indices, reference, partners)
            engine.train_step(PreferenceTrainer.weighted_micro_batches(result, scored), OptimizerParams(lr=1e-2), 1)
            calls = [engine.counters[k] - before[k] for k in ("submits", "readbacks")]
            runs[how, model.backend] = result, engine.trainable(), calls
            if how == "joint":      # the adapter matters here
                assert np.abs(scored.logps - scored.reference_logps).max() > 1e-3, model.backend
    scorings = 2 if objective == "kto" else 1                   # KTO scores its mismatched rows too
    for backend in ("numpy", "wgpu"):
        (apart, apart_params, apart_calls), (joint, joint_params, joint_calls) = (runs[h, backend]
                                                                                  for h in ("apart", "joint"))
        if backend == "wgpu":
            assert apart_calls == [2 * scorings * n_micro + 1] * 2
            assert joint_calls == [scorings * n_micro + 1] * 2
        assert joint.loss == apart.loss and joint.metrics == apart.metrics, backend
        np.testing.assert_array_equal(joint.dlogps, apart.dlogps, err_msg=backend)
        for k, v in joint_params.items():
            np.testing.assert_array_equal(v, apart_params[k], err_msg=f"{backend} {k}")


def test_weighted_gradients_match_finite_differences_and_the_gpu(folder, rt):
    """forward_backward with a weight per token: the gradient of sum(w * token loss), checked by central
    differences of that sum on the NumPy engine in float64, and the GPU engine against the NumPy one."""
    path, _ = folder
    batch = ids, targets, seg, pos = _batch(2)
    rng = np.random.default_rng(3)
    weights = rng.normal(0, 1, ids.shape).astype(np.float32)        # signed, as preference coefficients are
    ref, gpu = _models(path, rt)
    grads = {}
    for model in (ref, gpu):
        model.engine.zero_grads()
        model.engine.forward_backward(ids, targets, seg, pos, weights)
        grads[model.backend] = model.engine.gradients()
    for k in grads["numpy"]:
        assert_close(grads["wgpu"][k], grads["numpy"][k], "gpu_grads", k)

    ref64 = wt.load_model(path, backend="numpy", dtype=np.float64)
    ref64._set_lora(ref.lora_config, ref.engine.lora_tensors(), seed=2)
    eng = ref64.engine
    name = next(k for k in eng.trainable() if k.endswith("lora_B"))
    eng.zero_grads()
    eng.forward_backward(ids, targets, seg, pos, weights.astype(np.float64))
    analytic = eng.gradients()[name]
    tensor = eng.trainable()[name]
    for idx in [(0, 0), (tensor.shape[0] - 1, tensor.shape[1] - 1), (tensor.shape[0] // 2, 1)]:
        saved, h = tensor[idx], 1e-6
        numeric = (_weighted(eng, batch, weights, tensor, idx, saved + h)
                   - _weighted(eng, batch, weights, tensor, idx, saved - h)) / (2 * h)
        tensor[idx] = saved
        assert_close(np.float64(analytic[idx]), np.float64(numeric), "finite_difference_f64", f"{name}{idx}")


def _weighted(eng, batch, weights, tensor, idx, value) -> float:
    """sum(w * token loss) in float64 with one trainable element set to value (token_losses is float32)."""
    from wgpu_train.engines.numpy import ops

    ids, targets, seg, pos = batch
    tensor[idx] = value
    logits = eng.forward(ids, seg, pos)[0]
    rows, _ = ops.cross_entropy_rows(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return float((weights.reshape(-1).astype(np.float64) * rows).sum())


def test_weighted_train_step_matches_between_engines(folder, rt):
    """train_step with weighted micro-batches (two of them, one submission on the GPU): the same parameters
    after two AdamW steps on both engines; weights of 1 give the unweighted step exactly."""
    path, _ = folder
    ids, targets, seg, pos = _batch(4)
    w = np.random.default_rng(5).uniform(-2, 2, ids.shape).astype(np.float32)
    micro = [(ids[:2], targets[:2], seg[:2], pos[:2], w[:2]), (ids[2:], targets[2:], seg[2:], pos[2:], w[2:])]
    hp = OptimizerParams(lr=1e-2)
    params = {}
    for model in _models(path, rt):
        for step in (1, 2):
            loss_sum, count, norm, applied = model.engine.train_step(micro, hp, step)
            assert applied and count == int((targets != -100).sum())
        params[model.backend] = model.engine.trainable()
    for k in params["numpy"]:
        assert_close(params["wgpu"][k], params["numpy"][k], "gpu_params_after_steps_lr1e-2", k)

    plain = [m[:4] for m in micro]
    ones = [m[:4] + (np.ones_like(m[4]),) for m in micro]
    runs = {}
    for batches in (plain, ones):
        for model in _models(path, rt):
            out = model.engine.train_step(batches, hp, 1)
            runs.setdefault(model.backend, []).append((out[:2], model.engine.trainable()))
    for backend, ((out_plain, after_plain), (out_ones, after_ones)) in runs.items():
        assert out_ones == out_plain, backend
        for k, v in after_ones.items():
            np.testing.assert_array_equal(v, after_plain[k], err_msg=f"{backend} {k}")
