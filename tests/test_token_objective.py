"""One policy forward per step (engines/protocol.py TokenObjective and SequenceObjective): the loss head's gradient
weights from its own log-probabilities equal GRPO.step_loss's derivatives (the NumPy op pair against step_loss, the
WGSL kernel against the NumPy op), train_step with either objective equals train_step with those weights
precomputed on both engines, and GRPO (beta > 0, mu 2), DPO and ORPO runs take one policy forward per step with
the same adapter as the two-pass path."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

import wgpu_train as wt
from wgpu_train.training.config import TrainConfig
from wgpu_train.adapters.files import read_adapter
from wgpu_train.engines.numpy import ops
from wgpu_train.engines.protocol import OptimizerParams, TokenObjective
from wgpu_train.engines.shared.labels import shift_labels
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.training.grpo_trainer import GRPOTrainer
from wgpu_train.training.preference_trainer import PreferenceTrainer
from wgpu_train.training.objectives.grpo import GRPO, GRPO_LOSSES, GRPOSettings

from finetune_helpers import make_model_dir, write_jsonl
from tiny_models import build_model, save_model
from tolerances import assert_close

LEVELS = list(itertools.product(GRPO_LOSSES, (0.0, 0.3), (False, True)))     # loss type, beta, old log-probs


def _step(seed=0, rows=4, width=7):
    """A step's random (logps, old, ref, advantages, mask) (R, T), old and ref near logps, some ratios clipped."""
    rng = np.random.default_rng(seed)
    logps = rng.uniform(-4, -0.1, (rows, width))
    old = logps + rng.normal(0, 0.3, logps.shape)
    ref = logps + rng.normal(0, 0.5, logps.shape)
    adv = rng.normal(0, 1, rows)
    mask = rng.uniform(size=logps.shape) < 0.8
    mask[:, 0] = True
    return logps, old, ref, adv, mask


@pytest.mark.parametrize("loss_type,beta,with_old", LEVELS)
def test_numpy_pair_is_step_loss(loss_type, beta, with_old):
    """token_objective_backward gives -N * step_loss's dlogps (N the step's tokens), token_objective_forward its
    per-token loss, for every loss type, with and without the KL term and the old log-probabilities."""
    logps, old, ref, adv, mask = _step(1)
    unit = GRPO(GRPOSettings(loss_type=loss_type, beta=beta, epsilon=0.1, epsilon_high=0.15, max_completion_length=7))
    old = old if with_old else None
    items = int(mask.sum())
    result = unit.step_loss(logps, old, ref, adv, mask, 2, items)
    objective = unit.token_objective(old, ref, adv, mask, 2, items)
    loss_rows = np.where(mask, -logps, 0.0).reshape(-1).astype(np.float32)     # the loss head's -logp
    weights = ops.token_objective_backward(loss_rows, objective.terms(), objective)
    want = np.where(mask, -items * result.dlogps, 0.0).reshape(-1)
    np.testing.assert_allclose(weights, want, rtol=2e-5, atol=1e-6)
    per_token = ops.token_objective_forward(loss_rows, objective.terms(), objective)
    scale = objective.terms()[:, 0].astype(np.float64)
    np.testing.assert_allclose((scale * per_token).sum() / items, result.loss, rtol=1e-5, atol=1e-7)


def test_sequence_level_is_not_a_token_objective():
    """GSPO's ratio is a row's mean: no TokenObjective, the trainer scores first."""
    logps, old, ref, adv, mask = _step()
    unit = GRPO(GRPOSettings(importance_sampling_level="sequence"))
    assert unit.token_objective(old, ref, adv, mask, 2, int(mask.sum())) is None


@pytest.mark.parametrize("loss_type,beta,with_old", [(t, b, o) for t, b, o in LEVELS if t in ("dapo", "cispo", "sapo")])
def test_gpu_kernel_matches_numpy(rt, loss_type, beta, with_old):
    """shaders/token_objective.wgsl against the NumPy op, on a chunk of rows at an offset (the head's chunks)."""
    logps, old, ref, adv, mask = _step(2, rows=6, width=50)
    unit = GRPO(GRPOSettings(loss_type=loss_type, beta=beta, epsilon=0.1, max_completion_length=50))
    objective = unit.token_objective(old if with_old else None, ref, adv, mask, 3, int(mask.sum()))
    loss_rows = np.where(mask, -logps, 0.0).reshape(-1).astype(np.float32)       # (N,)
    terms = objective.terms()                                                    # (N, 4)
    want = ops.token_objective_backward(loss_rows, terms, objective)
    n, r0 = loss_rows.size, 37
    out = rt.upload(np.full(n, 7.0, np.float32))
    loss_buf, terms_buf = rt.upload(loss_rows), rt.upload(terms.reshape(-1))
    rec = rt.recorder()
    K.token_objective_backward(rec, out, loss_buf, terms_buf, objective, r0)              # rows [0, r0)
    K.token_objective_backward(rec, out, loss_buf, terms_buf, objective, n - r0, r0)      # rows [r0, n)
    rec.submit()
    np.testing.assert_allclose(rt.read(out, np.float32, (n,)), want, rtol=2e-5, atol=1e-6)


# ---- the engines' train_step --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("token_objective")
    save_model(build_model("llama", seed=4), path)
    return path


def _batch(seed=0, vocab=83):
    """Four rows of 11 tokens, the last right-padded; a prompt of 4 tokens carries no loss."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (4, 11)).astype(np.int32)
    seg = np.ones_like(ids)
    seg[3, 8:] = 0
    labels = ids.astype(np.int64)
    labels[:, :4] = -100
    labels[seg == 0] = -100
    pos = np.broadcast_to(np.arange(11, dtype=np.int32), ids.shape).copy()
    return ids, shift_labels(labels), seg, pos


def _models(path, rt):
    """The same LoRA model (B random) on both engines."""
    lora_cfg = wt.LoraConfig(r=3, alpha=6, target_modules="all-linear")
    ref = wt.load_model(path, backend="numpy")
    gpu = wt.load_model(path, backend="wgpu", device=str(rt.info.index))
    ref.add_lora(lora_cfg, seed=2)
    rng = np.random.default_rng(7)
    modules = {p: (a, rng.normal(0, 0.2, b.shape).astype(np.float32)) for p, (a, b) in ref.engine.lora_tensors().items()}
    ref._set_lora(lora_cfg, modules, seed=2)
    gpu._set_lora(lora_cfg, ref.engine.lora_tensors(), seed=2)
    return ref, gpu


@pytest.mark.parametrize("loss_type", ["bnpo", "sapo"])
def test_train_step_with_an_objective_equals_its_weights(folder, rt, loss_type):
    """Two micro-batches with TokenObjectives (old and reference log-probabilities, beta > 0): on each engine the
    same step as with the weights computed from token_losses beforehand, step_logps its head's log-probabilities;
    both engines the same parameters."""
    ids, targets, seg, pos = _batch(3)
    mask = targets != -100
    rng = np.random.default_rng(8)
    old_gap, ref_gap, adv = rng.normal(0, 0.1, ids.shape), rng.normal(0, 0.3, ids.shape), rng.normal(0, 1, ids.shape[0])
    unit = GRPO(GRPOSettings(loss_type=loss_type, beta=0.2, epsilon=0.05, max_completion_length=11))
    hp = OptimizerParams(lr=1e-2)
    params = {}
    for model in _models(folder, rt):
        engine = model.engine
        logps = -engine.token_losses(ids, targets, seg, pos).astype(np.float64)            # (B, T)
        old, ref = np.where(mask, logps + old_gap, 0.0), np.where(mask, logps + ref_gap, 0.0)
        items = int(mask.sum())
        objective = unit.token_objective(old, ref, adv, mask, 2, items)
        halves = [slice(0, 2), slice(2, 4)]
        cut = [TokenObjective(objective.scale[h], objective.advantages[h], objective.old_logps[h],
                              objective.ref_logps[h], **{k: getattr(objective, k) for k in
                                                        ("loss", "epsilon_low", "epsilon_high", "beta")})
               for h in halves]
        state = {k: v.copy() for k, v in engine.trainable().items()}
        moments = {k: np.array(v) for k, v in engine.optimizer_state().items()}
        out = engine.train_step([(ids[h], targets[h], seg[h], pos[h], o) for h, o in zip(halves, cut)], hp, 1)
        got = np.concatenate(engine.step_logps)
        assert_close(np.where(mask, got, 0.0), np.where(mask, logps, 0.0), "gpu_logits", model.backend)
        one_pass = {k: v.copy() for k, v in engine.trainable().items()}
        params[model.backend] = one_pass
        engine.set_trainable(state)
        engine.load_optimizer_state(moments)
        result = unit.step_loss(logps, old, ref, adv, mask, 2, items)
        weights = np.where(mask, -items * result.dlogps, 0.0).astype(np.float32)
        again = engine.train_step([(ids[h], targets[h], seg[h], pos[h], weights[h]) for h in halves], hp, 1)
        assert out[:2] == pytest.approx(again[:2], rel=1e-6)
        for k, v in engine.trainable().items():
            assert_close(one_pass[k], v, "gpu_params_after_steps_lr1e-2", f"{model.backend} {k}")
    for k in params["numpy"]:
        assert_close(params["wgpu"][k], params["numpy"][k], "gpu_params_after_steps_lr1e-2", k)


def _pair_weights(mask):
    """A SequenceObjective's host function coupling rows: rows 0 and 1, 2 and 3 are pairs, each token of a pair
    weighted by the sigmoid of the pair's summed log-probability margin (DPO's shape)."""
    def weights(logps):
        seq = (np.asarray(logps, np.float64) * mask).sum(axis=1)                 # (B,)
        margin = np.repeat(seq[0::2] - seq[1::2], 2) * np.tile([1.0, -1.0], len(seq) // 2)
        return (mask / (1.0 + np.exp(margin))[:, None]).astype(np.float32)
    return weights


@pytest.mark.parametrize("chunks", ["one", "many"])
def test_train_step_with_a_sequence_objective_equals_its_weights(folder, rt, monkeypatch, chunks):
    """A SequenceObjective (the host's weights of the head's own log-probabilities, coupling rows): one policy
    forward, and on each engine the same step as with the weights computed from token_losses beforehand; the
    WebGPU head in one chunk (its logits kept across the host's part) or in many (recomputed)."""
    from wgpu_train.engines.protocol import SequenceObjective
    from wgpu_train.engines.webgpu import memory

    if chunks == "many":
        monkeypatch.setattr(memory, "HEAD_CHUNK_BYTES", 3 * 83 * 4)
    ids, targets, seg, pos = _batch(5)
    mask = targets != -100
    hp = OptimizerParams(lr=1e-2)
    for model in _models(folder, rt):
        engine = model.engine
        state = {k: v.copy() for k, v in engine.trainable().items()}
        moments = {k: np.array(v) for k, v in engine.optimizer_state().items()}
        logps = -engine.token_losses(ids, targets, seg, pos)
        before = engine.counters["policy_forwards"]
        out = engine.train_step([(ids, targets, seg, pos, SequenceObjective(_pair_weights(mask)))], hp, 1)
        assert engine.counters["policy_forwards"] == before + 1
        assert_close(np.where(mask, engine.step_logps[0], 0.0), np.where(mask, logps, 0.0), "gpu_logits",
                     model.backend)
        one_pass = {k: v.copy() for k, v in engine.trainable().items()}
        engine.set_trainable(state)
        engine.load_optimizer_state(moments)
        again = engine.train_step([(ids, targets, seg, pos, _pair_weights(mask)(logps))], hp, 1)
        assert out[:2] == pytest.approx(again[:2], rel=1e-6)
        for k, v in engine.trainable().items():
            assert_close(one_pass[k], v, "gpu_params_after_steps_lr1e-2", f"{model.backend} {k}")


# ---- a GRPO run: one policy forward per step ----------------------------------------------------------

@pytest.fixture(scope="module")
def grpo_workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_one_pass")
    model = make_model_dir(root / "model")
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]
    (root / "data").mkdir()
    write_jsonl(root / "data" / "train.jsonl",
                [{"prompt": f"after {words[i % 8]} {i}?", "answer": f"{words[(i + 1) % 8]} {i}"} for i in range(8)])
    return root, model


def _length_reward(prompts, completions, **kw):
    return [len(c) / 10 for c in completions]


def _run(workspace, out, backend, **kw) -> GRPOTrainer:
    root, model = workspace
    cfg = TrainConfig(model=str(model), data=str(root / "data"), out=str(out), backend=backend, no_progress=True,
                         lr=2e-2, log_every=1, objective="grpo", batch_size=4, grad_accum=2, max_steps=4,
                         valid_split=0.0, lr_schedule="constant", num_generations=4, max_completion_length=6,
                         eval_generate=False, seed=3, beta=0.1, num_iterations=2, temperature=0.8, **kw)
    trainer = GRPOTrainer(cfg, log=lambda m: None, reward_funcs=[_length_reward]).setup()
    trainer.train()
    return trainer


@pytest.mark.parametrize("backend,level", [("numpy", "token"), ("wgpu", "token"), ("numpy", "sequence"),
                                           ("wgpu", "sequence")])
def test_one_policy_forward_per_grpo_step(grpo_workspace, tmp_path, monkeypatch, backend, level):
    """beta 0.1, mu 2, two micro-batches a step, four steps (two generations), the token and GSPO's sequence
    importance-sampling levels: each micro-batch's step is the only policy forward (the reference, adapter off, scored once per generation); the adapter equals the
    two-pass path's, which scores the policy at each generation and before each reused step."""
    if backend == "wgpu":
        from conftest import require_adapter

        require_adapter()
    one = _run(grpo_workspace, tmp_path / "one", backend, importance_sampling_level=level)
    steps, micro, generations = 4, 2, 2
    assert one.engine.counters["policy_forwards"] == steps * micro
    assert one.engine.counters["reference_forwards"] == generations * micro
    monkeypatch.setattr(GRPOTrainer, "_one_pass", lambda self: False)
    two = _run(grpo_workspace, tmp_path / "two", backend, importance_sampling_level=level)
    # the generation's scoring, each step, and each reused step's scoring
    assert two.engine.counters["policy_forwards"] == (generations + steps + steps // 2) * micro
    assert two.engine.counters["reference_forwards"] == generations * micro
    after_one, after_two = read_adapter(tmp_path / "one")[1], read_adapter(tmp_path / "two")[1]
    for k, v in after_two.items():
        assert_close(after_one[k], v, "gpu_params_after_steps_lr1e-2", k)


# ---- a preference run: one policy forward per step --------------------------------------------------------

@pytest.fixture(scope="module")
def pair_workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs_one_pass")
    model = make_model_dir(root / "model")
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]
    (root / "data").mkdir()
    write_jsonl(root / "data" / "train.jsonl",
                [{"prompt": f"after {words[i % 8]} {i}?", "chosen": f" {words[(i + 1) % 8]} {i}",
                  "rejected": f" {words[(i + 3) % 8]} and {words[i % 5]} {i}"} for i in range(12)])
    return root, model


def _pair_run(workspace, out, backend, objective) -> PreferenceTrainer:
    root, model = workspace
    cfg = TrainConfig(model=str(model), data=str(root / "data"), out=str(out), backend=backend, no_progress=True,
                      lr=1e-2, eval_generate=False, log_every=1, objective=objective, batch_size=2, grad_accum=2,
                      max_steps=3, valid_split=0.0, lr_schedule="constant")
    trainer = PreferenceTrainer(cfg, log=lambda m: None).setup()
    trainer.train()
    return trainer


@pytest.mark.parametrize("backend,objective", [("numpy", "dpo"), ("numpy", "orpo"), ("wgpu", "dpo")])
def test_one_policy_forward_per_pair_step(pair_workspace, tmp_path, monkeypatch, backend, objective):
    """DPO (the reference the adapter switched off) and ORPO (no reference, the chosen rows' NLL), two
    micro-batches of two pairs a step: each micro-batch's step is the only policy forward, and the adapter and the
    logged losses equal the two-pass path's (the policy scored, then the weighted step), whose micro-batches hold
    every chosen row, then every rejected row."""
    if backend == "wgpu":
        from conftest import require_adapter

        require_adapter()
    one = _pair_run(pair_workspace, tmp_path / "one", backend, objective)
    steps, micro = 3, 2
    assert one.engine.counters["policy_forwards"] == steps * micro
    assert one.engine.counters["reference_forwards"] == (steps * micro if objective == "dpo" else 0)
    monkeypatch.setattr(PreferenceTrainer, "_one_pass", lambda self: False)
    two = _pair_run(pair_workspace, tmp_path / "two", backend, objective)
    assert two.engine.counters["policy_forwards"] == 2 * steps * micro
    after_one, after_two = read_adapter(tmp_path / "one")[1], read_adapter(tmp_path / "two")[1]
    for k, v in after_two.items():
        assert_close(after_one[k], v, "gpu_params_after_steps_lr1e-2", k)
    rows = [[r for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())
             if "grad_norm" in r] for run in ("one", "two")]
    for a, b in zip(*rows):
        for key in ("loss", "rewards/margins", "logps/chosen", "nll_loss"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
