"""The WebGPU engine against the NumPy engine (and transformers + PEFT): logits, loss, gradients,
AdamW steps, one submission per step, generation (ragged batches too), full fine-tuning, non-finite steps,
gradient checkpointing."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.engines.webgpu.buffers import loss_head_size
from wgpu_train.engines.shared.labels import shift_labels

from tiny_models import build_model, in_arch, save_model
from tolerances import assert_close

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma2", "gemma3", "phi3"])
def folder(request, tmp_path_factory):
    """A saved tiny model per architecture (llama: untied, llama3 RoPE; qwen3: tied, q/k norms; gemma3: the
    sandwich-norm layer plan, GeGLU, a sliding and a global layer, a padding row; gemma2: that plan without q/k
    norms, with soft-capped attention scores and logits; phi3: fused q/k/v and gate/up projections, a partial
    rotary under longrope, whose long factors these 13-token batches take)."""
    hf = build_model(request.param, seed=1)
    path = tmp_path_factory.mktemp(request.param)
    save_model(hf, path)
    return path, hf


def _lora(path, target_modules=("q_proj", "v_proj"), **kw):
    """A LoraConfig whose targets (Llama's names) are spelled as the model at `path` names them."""
    arch = wt.ModelConfig.from_folder(path).family
    return wt.LoraConfig(target_modules=in_arch(arch, target_modules), **kw)


def _batch(seed=0, vocab=83):
    """Two rows, the second right-padded; labels mask a prompt and the padding."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (2, 13))
    mask = np.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.copy()
    labels[:, :3] = -100
    labels[mask == 0] = -100
    return ids, labels, mask


def _pair(path, rt, lora=None, b_seed=None):
    """The same model on both engines, with the same LoRA (B random when b_seed is given)."""
    ref = wt.load_model(path, backend="numpy")
    gpu = wt.load_model(path, backend="wgpu", device=str(rt.info.index))
    if lora is not None:
        ref.add_lora(lora, seed=5)
        if b_seed is not None:
            rng = np.random.default_rng(b_seed)
            modules = {}
            for p, (a, b) in ref.engine.lora_tensors().items():
                modules[p] = (a, rng.normal(0, 0.1, b.shape).astype(np.float32))
            ref._set_lora(lora, modules, seed=5)
        gpu._set_lora(lora, ref.engine.lora_tensors(), seed=5)
    return ref, gpu


def _micro_batches(ids, labels, mask, rows_per_micro):
    out = []
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    for r in range(0, ids.shape[0], rows_per_micro):
        s = slice(r, r + rows_per_micro)
        out.append((ids[s].astype(np.int32), shift_labels(labels[s]), mask[s].astype(np.int32), pos[s].copy()))
    return out


def test_logits_match_numpy_and_transformers(folder, rt):
    path, hf = folder
    ref, gpu = _pair(path, rt)
    ids, _, mask = _batch()
    ours = gpu.logits(ids, mask)
    real = mask.astype(bool)
    assert_close(ours[real], ref.logits(ids, mask)[real], "gpu_logits")
    with torch.no_grad():
        expected = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert_close(ours[real], expected[real], "gpu_logits")


@pytest.mark.parametrize("targets", ["q_proj,v_proj", "all-linear"])
def test_lora_loss_and_gradients_match_numpy(folder, rt, targets):
    path, _ = folder
    lora = _lora(path, r=3, alpha=7, target_modules=targets, use_rslora=targets == "all-linear")
    ref, gpu = _pair(path, rt, lora, b_seed=2)
    ids, labels, mask = _batch()
    loss_ref, grads_ref = ref.loss_and_grads(ids, labels, mask)
    loss_gpu, grads_gpu = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_gpu), np.float64(loss_ref), "gpu_loss")
    assert set(grads_gpu) == set(grads_ref) and len(grads_ref) == 2 * len(gpu.lora_config.target_modules) * 2
    for k in grads_ref:
        assert np.abs(grads_ref[k]).max() > 1e-4, k
        assert_close(grads_gpu[k], grads_ref[k], "gpu_grads", k)


def test_lora_gradients_match_peft_autograd(folder, rt, tmp_path):
    """The GPU gradients against torch autograd on the PEFT model (the oracle itself)."""
    peft = pytest.importorskip("peft")
    path, hf = folder
    lora = _lora(path, r=4, alpha=8, target_modules="all-linear")
    ref, gpu = _pair(path, rt, lora, b_seed=3)
    ref.save_adapter(tmp_path / "adapter")
    peft_model = peft.PeftModel.from_pretrained(build_model(gpu.config.family, seed=1), tmp_path / "adapter",
                                                is_trainable=True)
    ids, labels, mask = _batch(1)
    out = peft_model(torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {n.replace(".default", ""): p.grad.numpy() for n, p in peft_model.named_parameters() if p.requires_grad}
    loss, grads = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss), np.float64(out.loss.item()), "gpu_loss")
    assert set(grads) == set(expected)
    for k, g in expected.items():
        assert_close(grads[k], g, "gpu_grads", k)


def test_loraplus_steps_match_peft_optimizer(folder, rt, tmp_path):
    """LoRA+ (B at 4x the learning rate): two AdamW steps on both engines against PEFT's
    create_loraplus_optimizer with torch AdamW on the PEFT model."""
    peft = pytest.importorskip("peft")
    from peft.optimizers import create_loraplus_optimizer

    path, _ = folder
    lora = _lora(path, r=4, alpha=8, target_modules="all-linear")
    ref, gpu = _pair(path, rt, lora, b_seed=3)
    ref.save_adapter(tmp_path / "adapter")
    peft_model = peft.PeftModel.from_pretrained(build_model(gpu.config.family, seed=1), tmp_path / "adapter",
                                                is_trainable=True)
    opt = create_loraplus_optimizer(peft_model, torch.optim.AdamW, lr=1e-2, loraplus_lr_ratio=4.0,
                                    loraplus_weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    ids, labels, mask = _batch(4)
    micro = _micro_batches(ids, labels, mask, 2)
    hp = OptimizerParams(lr=1e-2, weight_decay=0.01, max_grad_norm=None, lora_b_lr_ratio=4.0)
    for step in (1, 2):
        opt.zero_grad()
        peft_model(torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels)).loss.backward()
        opt.step()
        ref.engine.train_step(micro, hp, step)
        gpu.engine.train_step(micro, hp, step)
    want = {n.replace(".default", ""): p.detach().numpy() for n, p in peft_model.named_parameters() if p.requires_grad}
    for model in (ref, gpu):
        got = model.lora_state_dict()
        assert set(got) == set(want)
        for k, w in want.items():
            assert_close(got[k], w, "params_vs_torch_adamw", k)
    plain = OptimizerParams(lr=1e-2, weight_decay=0.01, max_grad_norm=None)
    ref2, _ = _pair(path, rt, lora, b_seed=3)
    ref2.engine.train_step(micro, plain, 1)
    b_key = next(k for k in want if "lora_B" in k)
    assert not np.allclose(ref2.lora_state_dict()[b_key], ref.lora_state_dict()[b_key])   # the ratio mattered


def test_adamw_steps_with_clipping_match_numpy(folder, rt):
    """10 optimizer steps (2 micro-batches each, clipping active) give the same LoRA parameters."""
    path, _ = folder
    lora = _lora(path, r=4, alpha=8, target_modules="all-linear")
    ref, gpu = _pair(path, rt, lora)
    ids, labels, mask = _batch(2)
    micro = _micro_batches(ids, labels, mask, 1)
    hp = OptimizerParams(lr=1e-2, weight_decay=0.01, max_grad_norm=0.3)
    for step in range(1, 11):
        loss_r, count_r, norm_r, _ = ref.engine.train_step(micro, hp, step)
        loss_g, count_g, norm_g, applied = gpu.engine.train_step(micro, hp, step)
        assert applied and count_r == count_g
        assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss", f"step {step}")
        assert_close(np.float64(norm_g), np.float64(norm_r), "gpu_loss", f"grad norm, step {step}")
    assert norm_r > 0.3, "clipping should have been active"
    after_ref, after_gpu = ref.lora_state_dict(), gpu.lora_state_dict()
    for k in after_ref:
        assert_close(after_gpu[k], after_ref[k], "gpu_params_after_steps", k)
    state_r, state_g = ref.engine.optimizer_state(), gpu.engine.optimizer_state()
    for k in state_r:
        assert_close(state_g[k][0], state_r[k][0], "gpu_params_after_steps", k + " m")


def test_one_submit_per_step_and_uploads_only_the_batch(folder, rt):
    path, _ = folder
    _, gpu = _pair(path, rt, _lora(path, r=2, alpha=4))
    ids, labels, mask = _batch(3)
    micro = _micro_batches(ids, labels, mask, 1)
    hp = OptimizerParams(lr=1e-3)
    gpu.engine.train_step(micro, hp, 1)        # warm-up: pipelines, buffers, moments
    gpu.engine.train_step(micro, hp, 2)
    last = gpu.engine.last_step
    # per micro-batch: ids, segment ids and positions (i32 each), then the loss head's rows: its targets and
    # their row indices (i32 each), or only the targets when the head takes every row
    batch_bytes = 0
    for ids_m, targets, *_ in micro:
        n = ids_m.size
        head = loss_head_size(int((targets != -100).sum()), n)
        batch_bytes += 3 * n * 4 + (n * 4 if head == n else 2 * head * 4)
    # beyond the batch: the 4-byte gradient scale and one 32-byte AdamW hyper-parameter row (new step number)
    assert last["submits"] == 1 and last["readbacks"] == 1
    assert last["bytes_uploaded"] == batch_bytes + 4 + 32
    assert last["bytes_read"] <= 64


def test_gradient_accumulation_equals_full_batch(folder, rt):
    path, _ = folder
    lora = _lora(path, r=4, alpha=8)
    _, one = _pair(path, rt, lora, b_seed=4)
    _, two = _pair(path, rt, lora, b_seed=4)
    ids, labels, mask = _batch(4)
    hp = OptimizerParams(lr=1e-2, max_grad_norm=None)
    r1 = one.engine.train_step(_micro_batches(ids, labels, mask, 2), hp, 1)
    r2 = two.engine.train_step(_micro_batches(ids, labels, mask, 1), hp, 1)
    assert r1[1] == r2[1]
    assert_close(np.float64(r2[0]), np.float64(r1[0]), "gpu_loss")
    assert_close(np.float64(r2[2]), np.float64(r1[2]), "gpu_loss")
    a, b = one.lora_state_dict(), two.lora_state_dict()
    for k in a:
        assert_close(b[k], a[k], "gpu_params_after_steps", k)


def test_full_finetune_gradients_match_numpy(folder, rt, tmp_path):
    path, hf = folder
    ref, gpu = _pair(path, rt)
    ref.set_full_finetune()
    gpu.set_full_finetune()
    ids, labels, mask = _batch(5)
    loss_ref, grads_ref = ref.loss_and_grads(ids, labels, mask)
    loss_gpu, grads_gpu = gpu.loss_and_grads(ids, labels, mask)
    assert_close(np.float64(loss_gpu), np.float64(loss_ref), "gpu_loss")
    assert set(grads_gpu) == set(grads_ref) == set(ref.engine.weights())
    for k in grads_ref:
        assert_close(grads_gpu[k], grads_ref[k], "gpu_grads", k)
    gpu.engine.train_step(_micro_batches(ids, labels, mask, 2), OptimizerParams(lr=1e-3), 1)
    gpu.save_pretrained(tmp_path / "full")
    reloaded = wt.load_model(tmp_path / "full", backend="numpy")
    assert_close(reloaded.logits(ids, mask)[mask.astype(bool)], gpu.logits(ids, mask)[mask.astype(bool)], "gpu_logits")


def test_nonfinite_step_is_skipped_and_counted(folder, rt):
    path, _ = folder
    lora = _lora(path, r=2, alpha=4)
    _, gpu = _pair(path, rt, lora, b_seed=6)
    params = gpu.engine.trainable()
    bad = dict(params)
    name = next(iter(bad))
    bad[name] = bad[name].copy()
    bad[name][0, 0] = np.inf
    gpu.engine.set_trainable(bad)
    ids, labels, mask = _batch(6)
    loss, _, norm, applied = gpu.engine.train_step(_micro_batches(ids, labels, mask, 2), OptimizerParams(lr=1e-2), 1)
    assert not applied and gpu.engine.counters["nonfinite_skipped"] == 1
    after = gpu.engine.trainable()
    for k in params:
        np.testing.assert_array_equal(after[k], bad[k])


def test_lora_dropout_matches_numpy(folder, rt):
    path, _ = folder
    lora = _lora(path, r=3, alpha=6, dropout=0.3, target_modules="q_proj,v_proj,down_proj")
    ref, gpu = _pair(path, rt, lora, b_seed=7)
    ids, labels, mask = _batch(7)
    for _ in range(2):   # the mask changes with each call, identically on both engines
        loss_ref, grads_ref = ref.loss_and_grads(ids, labels, mask)
        loss_gpu, grads_gpu = gpu.loss_and_grads(ids, labels, mask)
        assert_close(np.float64(loss_gpu), np.float64(loss_ref), "gpu_loss")
        for k in grads_ref:
            assert_close(grads_gpu[k], grads_ref[k], "gpu_grads", k)


def test_greedy_generation_matches_transformers(folder, rt, tmp_path):
    path, hf = folder
    ref, gpu = _pair(path, rt)
    prompt = np.random.default_rng(8).integers(0, 83, 6)
    with torch.no_grad():
        expected = hf.generate(torch.tensor(prompt)[None], max_new_tokens=10, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, 6:].tolist()
    assert gpu.generate(prompt, max_new_tokens=10) == expected
    # with an adapter: the PEFT model's greedy output
    peft = pytest.importorskip("peft")
    lora = _lora(path, r=4, alpha=16, target_modules="all-linear")
    ref, gpu = _pair(path, rt, lora, b_seed=9)
    ref.save_adapter(tmp_path / "a")
    pm = peft.PeftModel.from_pretrained(build_model(gpu.config.family, seed=1), tmp_path / "a")
    with torch.no_grad():
        expected = pm.generate(input_ids=torch.tensor(prompt)[None], max_new_tokens=10, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, 6:].tolist()
    assert gpu.generate(prompt, max_new_tokens=10) == expected


def test_seeded_sampling_is_reproducible(folder, rt):
    path, _ = folder
    ref, gpu = _pair(path, rt)
    prompt = [1, 2, 3]
    kw = dict(max_new_tokens=8, temperature=1.3, top_k=20, top_p=0.9)
    a = gpu.generate(prompt, seed=11, **kw)
    assert a == gpu.generate(prompt, seed=11, **kw) == ref.generate(prompt, seed=11, **kw)
    assert any(gpu.generate(prompt, seed=s, **kw) != a for s in range(12, 16))


def test_forward_rows_packs_ragged_prompts(folder, rt):
    """Ragged prompts packed into one forward_rows call (tokens shuffled: every key is written before any query
    reads) give each prompt's forward_cached logits; then one call advances every row by a token."""
    path, _ = folder
    ref, gpu = _pair(path, rt, _lora(path, r=4, alpha=16, target_modules="all-linear"), b_seed=3)
    rng = np.random.default_rng(4)
    lengths = np.array([5, 1, 7])    # all in one call: within longrope's short factors (phi3's 8 positions)
    prompts = [rng.integers(0, 83, n) for n in lengths]
    nxt = rng.integers(0, 83, 3)                                          # one more token per row
    ids, pos = np.concatenate(prompts), np.concatenate([np.arange(n) for n in lengths])
    rows = np.repeat(np.arange(3), lengths)
    perm = rng.permutation(ids.size)
    last = np.argsort(perm)[np.cumsum(lengths) - 1]                       # where each prompt's last token went
    order = np.array([2, 0, 1])                                           # the decoding step's rows, in any order
    alone = {}
    for m in (ref, gpu):
        e = m.engine
        per_prompt = []
        for p, t in zip(prompts, nxt):
            kv = e.new_kv_cache(1, 12)
            per_prompt.append(np.concatenate([e.forward_cached(p[None], kv), e.forward_cached(np.array([[t]]), kv)]))
        alone[m.backend] = np.stack(per_prompt, axis=1)                   # (2 calls, 3 prompts, V)
        kv = e.new_kv_cache(3, 12)
        packed = e.forward_rows(ids[perm], rows[perm], pos[perm], kv, last)
        step = e.forward_rows(nxt[order], order, lengths[order], kv, np.argsort(order))
        tol = "batched_logits_f32" if m is ref else "gpu_logits"
        assert_close(packed, alone[m.backend][0], tol, f"{m.backend} packed prefill")
        assert_close(step, alone[m.backend][1], tol, f"{m.backend} decoding step")
        assert e.forward_rows(ids[:0], rows[:0], pos[:0], kv, last[:0]).shape == (0, gpu.config.vocab_size)
    assert_close(alone["wgpu"], alone["numpy"], "gpu_logits")
    assert np.abs(alone["numpy"][0, 0] - alone["numpy"][0, 2]).max() > 1e-2   # the prompts' logits differ


def test_generate_batch_equals_generate_per_prompt(folder, rt, monkeypatch):
    """Greedy generate_batch over ragged prompts with per-row budgets gives generate()'s tokens for each prompt,
    also when the prefill cuts prompts across calls; both engines agree."""
    from wgpu_train.engines import generate as gen

    path, _ = folder
    ref, gpu = _pair(path, rt, _lora(path, r=4, alpha=16, target_modules="all-linear"), b_seed=9)
    rng = np.random.default_rng(10)
    prompts = [rng.integers(0, 83, n) for n in (6, 1, 9, 3)]
    budgets = [7, 10, 3, 0]
    outs = {}
    for m in (ref, gpu):
        alone = [m.generate(p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
        assert [len(a) for a in alone] == budgets
        outs[m.backend] = m.generate_batch(prompts, max_new_tokens=budgets)
        assert outs[m.backend] == alone
        monkeypatch.setattr(gen, "PREFILL_TOKENS", 4)
        assert m.generate_batch(prompts, max_new_tokens=budgets) == alone
        monkeypatch.undo()
    assert outs["wgpu"] == outs["numpy"]


def test_auto_backend_takes_wgpu(folder, rt):
    path, _ = folder
    assert wt.load_model(path, backend="auto").backend == "wgpu"


def _allocated(acts) -> int:
    """Bytes of a bucket's activation buffers, each counted once (checkpointed layers share most of theirs)."""
    bufs = {id(b): b for layer in acts.layers.values() for b in layer.values()}
    batch_inputs = ("ids", "segments", "positions", "targets", "head_index")   # the uploaded batch, not activations
    bufs.update({id(v): v for k, v in vars(acts).items() if hasattr(v, "destroy") and k not in batch_inputs})
    return sum(b.size for b in bufs.values())


def test_memory_estimate_matches_allocation_and_limits_are_refused(folder, rt):
    path, _ = folder
    lora = _lora(path, r=4, alpha=8, dropout=0.1, target_modules="all-linear")
    _, gpu = _pair(path, rt, lora)
    ids, labels, mask = _batch(9)
    gpu.loss_and_grads(ids, labels, mask)
    est = wt.estimate_memory(gpu.config, ids.shape[0], ids.shape[1], lora=lora)
    assert est["activations"] + est["logits"] == _allocated(gpu.engine._activations(*ids.shape, train=True))
    assert est["total"] == est["weights"] + est["trainable_state"] + est["activations"] + est["logits"]
    # with gradient checkpointing: every layer's input, and one set of the other buffers for all layers
    gpu.set_gradient_checkpointing(True)
    gpu.loss_and_grads(ids, labels, mask)
    acts = gpu.engine._activations(*ids.shape, train=True)
    assert acts.checkpoint and len(gpu.engine.buckets.acts) == 1   # the plain bucket was released
    first, last = acts.layers[0], acts.layers[gpu.config.num_hidden_layers - 1]
    assert first["x_in"] is not last["x_in"] and all(first[k] is last[k] for k in first if k != "x_in")
    ckpt = wt.estimate_memory(gpu.config, ids.shape[0], ids.shape[1], lora=lora, gradient_checkpointing=True)
    assert ckpt["activations"] + ckpt["logits"] == _allocated(acts)
    assert gpu.config.num_hidden_layers >= 2 and ckpt["activations"] < est["activations"]
    assert ckpt.keys() == est.keys() and ckpt["weights"] == est["weights"]
    # forward only (logits, loss, generation): one set of layer buffers, the input included, for all layers
    gpu.logits(ids)
    fwd = gpu.engine._activations(*ids.shape, train=False)
    last_layer = fwd.layers[gpu.config.num_hidden_layers - 1]
    assert all(fwd.layers[0][k] is last_layer[k] for k in fwd.layers[0]) and "x_in" in fwd.layers[0]
    assert _allocated(fwd) < _allocated(acts)
    # a bucket whose activations cannot fit one storage binding is refused before anything is allocated
    tokens = rt.max_binding // (4 * gpu.config.intermediate_size) + 1
    with pytest.raises(wt.DeviceError, match="max storage binding.*reduce the batch size"):
        gpu.logits(np.zeros((1, tokens), dtype=np.int64))
    with pytest.raises(wt.DeviceError, match="max-buffer-size"):
        rt.buffer(rt.max_buffer + 4)


def test_activation_allocation_failure_names_what_to_reduce(folder, rt, monkeypatch):
    """A device that runs out of memory for a training bucket's activations: one DeviceError saying what
    to reduce, gradient checkpointing included until it is on."""
    path, _ = folder
    _, gpu = _pair(path, rt, _lora(path, r=2, alpha=4))
    ids, labels, mask = _batch(11)
    real = rt.buffer

    def buffer(nbytes, label="", usage=None):
        if label.endswith("gate"):           # "layer.gate" when checkpointed
            raise wt.DeviceError(f"could not allocate {nbytes} bytes for gate: out of memory")
        return real(nbytes, label, usage)

    monkeypatch.setattr(rt, "buffer", buffer)
    with pytest.raises(wt.DeviceError, match=r"out of memory, for the activations of batch 2 x \d+ tokens: reduce "
                                             r"the batch size or --max-seq-len, or pass --gradient-checkpointing$"):
        gpu.loss_and_grads(ids, labels, mask)
    gpu.set_gradient_checkpointing(True)
    with pytest.raises(wt.DeviceError, match="--max-seq-len$"):
        gpu.loss_and_grads(ids, labels, mask)


def test_profile_reports_gpu_time_per_op_group(folder, rt):
    path, _ = folder
    _, gpu = _pair(path, rt, _lora(path, r=2, alpha=4))
    ids, labels, mask = _batch(10)
    micro = _micro_batches(ids, labels, mask, 2)
    hp = OptimizerParams(lr=1e-3)
    loss_plain = gpu.engine.train_step(micro, hp, 1)[0]
    assert gpu.engine.last_profile == {}                       # nothing measured when off
    gpu.engine.train_step(micro, hp, 2, profile=True)
    prof = gpu.engine.last_profile
    if not rt.has_timestamps:
        assert len(prof) == 1 and "wall clock" in next(iter(prof))
        return
    n_layers = gpu.config.num_hidden_layers
    for i in range(n_layers):
        for part in ("forward gemm", "forward attention", "forward norm", "backward gemm", "backward attention"):
            assert f"layer {i} {part}" in prof
    assert "loss head (lm_head, cross-entropy)" in prof and "optimizer (grad norm, AdamW)" in prof
    assert all(v >= 0 for v in prof.values()) and sum(prof.values()) > 0
    assert np.isfinite(loss_plain)
    assert not any("recompute" in k for k in prof)
    # checkpointed: every layer but the last (whose activations the forward leaves in place) is recomputed
    gpu.set_gradient_checkpointing(True)
    gpu.engine.train_step(micro, hp, 3, profile=True)
    prof = gpu.engine.last_profile
    for i in range(n_layers - 1):
        for part in ("norm", "gemm", "attention", "swiglu"):
            assert f"layer {i} recompute {part}" in prof
    assert not any(k.startswith(f"layer {n_layers - 1} recompute") for k in prof)


def test_gradient_checkpointing_is_bit_identical(folder, rt):
    """Recomputed activations come from the same kernels on the same inputs, dropout masks included: the
    loss and every gradient equal those without checkpointing bit for bit, also through accumulated steps."""
    path, _ = folder
    lora = _lora(path, r=3, alpha=6, dropout=0.25, target_modules="all-linear")
    _, plain = _pair(path, rt, lora, b_seed=13)
    _, ckpt = _pair(path, rt, lora, b_seed=13)
    ckpt.set_gradient_checkpointing(True)
    ids, labels, mask = _batch(13)                 # the second row is padded
    for _ in range(2):                             # a new dropout mask per call
        loss_p, grads_p = plain.loss_and_grads(ids, labels, mask)
        loss_c, grads_c = ckpt.loss_and_grads(ids, labels, mask)
        assert loss_c == loss_p and grads_c.keys() == grads_p.keys()
        for k in grads_p:
            assert np.abs(grads_p[k]).max() > 0, k
            np.testing.assert_array_equal(grads_c[k], grads_p[k], err_msg=k)
    micro = _micro_batches(ids, labels, mask, 1)   # two micro-batches per step
    hp = OptimizerParams(lr=1e-2, max_grad_norm=0.5)
    for step in (1, 2):
        assert ckpt.engine.train_step(micro, hp, step) == plain.engine.train_step(micro, hp, step)
        assert ckpt.engine.last_step["submits"] == 1
    after_p, after_c = plain.lora_state_dict(), ckpt.lora_state_dict()
    for k in after_p:
        np.testing.assert_array_equal(after_c[k], after_p[k], err_msg=k)
    # evaluation does not checkpoint: the same numbers from the forward-only bucket
    assert ckpt.logits(ids, mask).tobytes() == plain.logits(ids, mask).tobytes()


def test_gradient_checkpointing_full_finetune_is_bit_identical(folder, rt):
    path, _ = folder
    _, plain = _pair(path, rt)
    _, ckpt = _pair(path, rt)
    for m in (plain, ckpt):
        m.set_full_finetune()
    ckpt.set_gradient_checkpointing(True)
    ids, labels, mask = _batch(14)
    loss_p, grads_p = plain.loss_and_grads(ids, labels, mask)
    loss_c, grads_c = ckpt.loss_and_grads(ids, labels, mask)
    assert loss_c == loss_p and grads_c.keys() == grads_p.keys()
    for k in grads_p:                              # norm weights, embedding and lm_head included
        np.testing.assert_array_equal(grads_c[k], grads_p[k], err_msg=k)


def test_activation_buckets_are_evicted_and_reused_correctly(folder, rt):
    """More (batch, length) shapes than buckets kept, visited twice, in training and evaluation."""
    path, _ = folder
    ref, gpu = _pair(path, rt, _lora(path, r=2, alpha=4), b_seed=11)
    rng = np.random.default_rng(12)
    shapes = [(b, t) for b in (1, 2, 3) for t in (5, 8, 13)]   # 9 > both limits
    for _ in range(2):
        for b, t in shapes:
            ids = rng.integers(0, gpu.config.vocab_size, (b, t))
            assert_close(np.float64(gpu.loss_and_grads(ids, ids)[0]), np.float64(ref.loss_and_grads(ids, ids)[0]),
                         "gpu_loss", f"{b}x{t}")
            assert_close(gpu.logits(ids), ref.logits(ids), "gpu_logits", f"{b}x{t}")
    kept = list(gpu.engine.buckets.acts)
    assert sum(k[2] for k in kept) <= gpu.engine.buckets.MAX_BUCKETS              # training buckets
    assert sum(not k[2] for k in kept) <= gpu.engine.buckets.MAX_FORWARD_BUCKETS   # forward-only ones


def test_long_steps_split_across_submissions(folder, rt):
    """A step whose GPU time exceeds max_submit_s is cut at layer boundaries into several submissions
    (counted at queue.submit), with the same parameters afterwards as the step in one submission."""
    path, _ = folder
    lora = _lora(path, r=2, alpha=4)
    _, one = _pair(path, rt, lora, b_seed=4)
    _, split = _pair(path, rt, lora, b_seed=4)
    ids, labels, mask = _batch(3)
    micro = _micro_batches(ids, labels, mask, 1)
    hp = OptimizerParams(lr=1e-2)
    split.engine.steps.max_submit_s = 1e-9            # every step "too long": the next ones are split
    for step in (1, 2, 3):
        one.engine.train_step(micro, hp, step)
        split.engine.train_step(micro, hp, step)
    assert one.engine.last_step["submits"] == 1
    assert split.engine.last_step["submits"] > 2 and split.engine.last_step["readbacks"] == 1
    a, b = one.lora_state_dict(), split.lora_state_dict()
    for k in a:
        assert_close(b[k], a[k], "exact", k)
