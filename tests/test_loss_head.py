"""The loss head over trained rows only: with mostly ignored labels the WebGPU engine's loss and gradients
equal the NumPy engine's, a head split into many chunks equals one chunk, a batch with no trained token runs,
chunk sizes follow the device's binding limit, and float32 weight chunks are multiples of 8 rows."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import wgpu_train as wt
from wgpu_train.engines.webgpu import memory
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.buffers import loss_head_size
from wgpu_train.engines.webgpu.tensors import Matrix
from wgpu_train.engines.webgpu.memory import base_weight_bytes, head_rows
from wgpu_train.engines.numpy import ops
from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.engines.shared.labels import shift_labels

from tolerances import assert_close

torch = pytest.importorskip("torch")
F32 = np.float32
VOCAB = 83          # tests/tiny_models.py


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def folder(request, tmp_path_factory):
    """llama: untied lm_head; qwen3: tied embedding (the head's weight gradient lands in the embedding)."""
    from tiny_models import build_model, save_model

    path = tmp_path_factory.mktemp(request.param)
    save_model(build_model(request.param, seed=1), path)
    return path


def _sparse_batch(seed=0):
    """Three rows of 24 tokens, two right-padded, where only a short answer per row is trained (9 of 72
    targets), the answers at different places in each row."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (3, 24))
    mask = np.ones_like(ids)
    mask[1, 17:] = 0
    mask[2, 10:] = 0
    labels = np.full_like(ids, IGNORE_INDEX)
    for row, (a, b) in enumerate([(20, 24), (14, 17), (8, 10)]):
        labels[row, a:b] = ids[row, a:b]
    return ids, labels, mask


def _inputs(ids, labels, mask):
    """(ids, targets, segment ids, positions) as the engines take them."""
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
    return ids.astype(np.int32), shift_labels(labels), mask.astype(np.int32), pos


def _pair(path, rt, method, b_seed=2):
    """The same model on both engines, LoRA (B random, so every gradient is non-zero) or full fine-tuning."""
    ref = wt.load_model(path, backend="numpy")
    gpu = wt.load_model(path, backend="wgpu", device=str(rt.info.index))
    if method == "full":
        ref.set_full_finetune()
        gpu.set_full_finetune()
        return ref, gpu
    lora = wt.LoraConfig(r=3, alpha=7, target_modules="all-linear")
    ref.add_lora(lora, seed=5)
    rng = np.random.default_rng(b_seed)
    modules = {p: (a, rng.normal(0, 0.1, b.shape).astype(F32)) for p, (a, b) in ref.engine.lora_tensors().items()}
    ref._set_lora(lora, modules, seed=5)
    gpu._set_lora(lora, ref.engine.lora_tensors(), seed=5)
    return ref, gpu


def test_loss_head_size_pads_a_little_and_stays_within_the_batch():
    assert loss_head_size(0, 50) == 0
    assert [loss_head_size(m, 1000) for m in (1, 8, 9, 64, 65, 100, 129)] == [8, 8, 16, 64, 72, 104, 144]
    assert loss_head_size(60, 61) == 61 and loss_head_size(9, 12) == 12
    for m in range(1, 3000, 7):
        got = loss_head_size(m, 10**6)
        assert m <= got <= max(m + 7, m * 9 // 8) and got % 8 == 0
    assert len({loss_head_size(m, 8192) for m in range(1, 8193)}) < 80   # few distinct dispatch sizes


@pytest.mark.parametrize("method", ["lora", "full"])
def test_mostly_ignored_labels_match_numpy(folder, rt, method):
    """Training gradients (LoRA, or full fine-tuning with the lm_head / tied embedding gradient) and the
    evaluation loss when only 9 of 72 targets are trained: the head takes the 16 rows loss_head_size pads
    them to, gathered from the final norm's output and scattered back."""
    ref, gpu = _pair(folder, rt, method)
    ids, labels, mask = _sparse_batch()
    loss_ref, grads_ref = ref.loss_and_grads(ids, labels, mask)
    loss_gpu, grads_gpu = gpu.loss_and_grads(ids, labels, mask)
    acts = gpu.engine._activations(*ids.shape, train=True)
    assert acts.head_index is not None and acts.n_head == 16 < acts.n
    assert_close(np.float64(loss_gpu), np.float64(loss_ref), "gpu_loss")
    assert set(grads_gpu) == set(grads_ref)
    for k in grads_ref:
        assert np.abs(grads_ref[k]).max() > 1e-5, k
        assert_close(grads_gpu[k], grads_ref[k], "gpu_grads", k)
    batch = _inputs(ids, labels, mask)
    (sum_ref, count_ref), (sum_gpu, count_gpu) = ref.engine.loss(*batch), gpu.engine.loss(*batch)
    assert count_gpu == count_ref == 9
    assert_close(np.float64(sum_gpu), np.float64(sum_ref), "gpu_loss")


@pytest.mark.parametrize("method", ["lora", "full"])
def test_head_in_many_chunks_equals_one_chunk(folder, rt, monkeypatch, method):
    """A loss head budget of 3 rows of logits: the trained rows of each micro-batch span several chunks
    (and one micro-batch takes every row); the step, its gradients and the evaluation loss equal those of
    the head in one chunk."""
    _, one = _pair(folder, rt, method)
    _, many = _pair(folder, rt, method)
    ids, labels, mask = _sparse_batch(1)
    labels[0] = np.where(mask[0] == 1, ids[0], IGNORE_INDEX)            # a fully trained row
    micro = [_inputs(ids[:1], labels[:1], mask[:1]), _inputs(ids[1:], labels[1:], mask[1:])]
    hp = OptimizerParams(lr=1e-2, max_grad_norm=None)
    r_one = one.engine.train_step(micro, hp, 1)
    eval_one = [one.engine.loss(*m) for m in micro]
    monkeypatch.setattr(memory, "HEAD_CHUNK_BYTES", 3 * VOCAB * 4)
    heads = []                   # (gathered, n_head, n, head_rows) of each micro-batch as it is uploaded
    upload = many.engine.buckets.upload_batch

    def spy(acts, *args, **kw):
        upload(acts, *args, **kw)
        heads.append((acts.head_index is not None, acts.n_head, acts.n, acts.head_rows))

    monkeypatch.setattr(many.engine.buckets, "upload_batch", spy)
    r_many = many.engine.train_step(micro, hp, 1)
    assert heads == [(False, 24, 24, 3),         # every row, in 8 chunks
                     (True, 8, 48, 3)]           # 5 of 48 trained, padded to 8, in 3 chunks
    eval_many = [many.engine.loss(*m) for m in micro]
    assert one.engine._activations(*micro[1][0].shape, train=True).head_rows >= 48   # one chunk
    assert r_many[1] == r_one[1] == 23 + 5 and r_many[3] and r_one[3]
    assert_close(np.float64(r_many[0]), np.float64(r_one[0]), "gpu_loss", "loss sum")
    assert_close(np.float64(r_many[2]), np.float64(r_one[2]), "gpu_loss", "grad norm")
    after_one, after_many = one.engine.trainable(), many.engine.trainable()
    for k in after_one:
        assert_close(after_many[k], after_one[k], "gpu_params_after_steps", k)
    for m, (s1, c1), (s2, c2) in zip(micro, eval_one, eval_many):
        assert c1 == c2 and many.engine._activations(*m[0].shape, train=False).head_rows == 3
        assert_close(np.float64(s2), np.float64(s1), "gpu_loss", "evaluation loss")


def test_no_trained_token_gives_zero_loss_and_gradients(folder, rt):
    """A micro-batch whose labels are all -100 (a prompt cut before its answer): loss 0, count 0, zero
    gradients; beside a micro-batch with tokens, the step equals the NumPy engine's."""
    ref, gpu = _pair(folder, rt, "lora")
    ids, labels, mask = _sparse_batch(2)
    empty = _inputs(ids[:2], np.full_like(labels[:2], IGNORE_INDEX), mask[:2])
    gpu.engine.zero_grads()
    assert gpu.engine.forward_backward(*empty, 1.0) == (0.0, 0)
    assert gpu.engine._activations(*empty[0].shape, train=True).n_head == 0
    assert all(not g.any() for g in gpu.engine.gradients().values())
    assert gpu.engine.loss(*empty) == (0.0, 0)
    hp = OptimizerParams(lr=1e-2, weight_decay=0.0, max_grad_norm=1.0)   # step 1 (no tokens) moves nothing
    loss, count, norm, applied = gpu.engine.train_step([empty], hp, 1)
    assert (loss, count, norm, applied) == (0.0, 0, 0.0, True)
    micro = [empty, _inputs(ids[2:], labels[2:], mask[2:])]
    got, want = gpu.engine.train_step(micro, hp, 2), ref.engine.train_step(micro, hp, 2)
    assert got[1] == want[1] == 2 and got[3]
    assert_close(np.float64(got[0]), np.float64(want[0]), "gpu_loss")
    assert_close(np.float64(got[2]), np.float64(want[2]), "gpu_loss")


def test_row_gather_pair_matches_numpy(rt):
    """The head's gather of trained rows and the scatter of their gradient back (zero elsewhere, or added)."""
    rng = np.random.default_rng(3)
    M, N, C = 40, 11, 7
    x = rng.standard_normal((M, C)).astype(F32)
    rows = rng.permutation(M)[:N].astype(np.int32)
    dout = rng.standard_normal((N, C)).astype(F32)
    dx0 = rng.standard_normal((M, C)).astype(F32)
    out, dx, dx_acc = rt.buffer(N * C * 4), rt.upload(dx0), rt.upload(dx0)
    trows, tdout = rt.upload(rows), rt.upload(dout)
    rec = rt.recorder()
    K.row_gather_forward(rec, out, rt.upload(x), trows, N, C, M)
    K.row_gather_backward(rec, dx, tdout, trows, N, C, M)
    K.row_gather_backward(rec, dx_acc, tdout, trows, N, C, M, accumulate=True)
    rec.submit()
    assert_close(rt.read(out, F32, (N, C)), ops.row_gather_forward(x, rows), "exact")
    want = ops.row_gather_backward(dout, rows, M)
    assert_close(rt.read(dx, F32, (M, C)), want, "exact", "dx")
    assert_close(rt.read(dx_acc, F32, (M, C)), want + dx0, "k_elementwise", "accumulated")


def test_head_rows_follow_the_binding_limit_and_budget():
    big, small = SimpleNamespace(vocab_size=151_936), SimpleNamespace(vocab_size=VOCAB)
    assert head_rows(big, 10**6) == (32 << 20) // (151_936 * 4) == 55             # the 32 MiB default budget
    assert head_rows(big, 10**6, max_binding=16 << 20) == (16 << 20) // (151_936 * 4)
    assert head_rows(big, 10**6, max_binding=2 << 30, budget=1 << 30) == (1 << 30) // (151_936 * 4)
    assert head_rows(big, 10**6, max_binding=64 << 20, budget=1 << 30) == (64 << 20) // (151_936 * 4)
    assert head_rows(small, 10**6, max_binding=2 << 30, budget=1 << 30) == 65535
    assert head_rows(big, 7) == 7 and head_rows(big, 10, budget=1) == 1
    # memory.py plans without a device: wgpu cannot even be imported here
    code = ("import sys; sys.modules['wgpu'] = None\n"
            "from wgpu_train.models.config import ModelConfig\nfrom wgpu_train.engines.webgpu.memory import estimate_memory\n"
            "cfg = ModelConfig('LlamaForCausalLM', 151936, 896, 4864, 2, 14, 2, 64)\n"
            "a = estimate_memory(cfg, 4, 256)['logits']\nb = estimate_memory(cfg, 4, 256, max_binding=16 << 20)['logits']\n"
            "assert (a, b) == (55 * 151936 * 4, 27 * 151936 * 4), (a, b)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_float32_chunks_are_multiples_of_8_rows_and_as_planned(folder, rt):
    """Under a 4 KiB storage binding every float32 weight splits into chunks of a multiple of 8 rows (vec4
    column offsets into y and dy), the allocation equals memory.base_weight_bytes, and the chunked model
    still computes the NumPy engine's logits and full fine-tuning gradients."""
    binding = 4096
    saved = rt.max_binding
    rt.max_binding = binding
    try:
        gpu = wt.load_model(folder, backend="wgpu", device=str(rt.info.index), base_dtype="float32")
        m = Matrix(rt, 300, 30, "w")
        ref = wt.load_model(folder, backend="numpy")
        mats = {k: t for k, t in gpu.engine.w.items() if isinstance(t, Matrix)}
        assert max(len(t.chunks) for t in mats.values()) >= 3
        for k, t in [*mats.items(), ("w", m)]:
            assert [c[1] for c in t.chunks] == list(range(0, t.rows, t.chunks[0][2])), k
            assert all(r0 % 8 == 0 and n * t.cols * 4 <= binding for _, r0, n in t.chunks), k
            assert all(n % 8 == 0 for _, _, n in t.chunks[:-1]) and sum(n for *_, n in t.chunks) == t.rows, k
        assert [n for _, _, n in m.chunks] == [32] * 9 + [12]                    # 34 rows fit: 32 a chunk
        assert gpu.engine.base_weight_bytes == base_weight_bytes(gpu.config, "float32", "float32", binding)["total"]
        ids = np.random.default_rng(4).integers(0, VOCAB, (1, 9))
        assert_close(gpu.logits(ids), ref.logits(ids), "gpu_logits")
        ref.set_full_finetune()
        gpu.set_full_finetune()
        labels = ids.copy()
        labels[:, :2] = IGNORE_INDEX
        (loss_r, grads_r), (loss_g, grads_g) = ref.loss_and_grads(ids, labels), gpu.loss_and_grads(ids, labels)
        assert_close(np.float64(loss_g), np.float64(loss_r), "gpu_loss")
        for k in grads_r:
            assert_close(grads_g[k], grads_r[k], "gpu_grads", k)
    finally:
        rt.max_binding = saved


def test_loss_temperature_through_a_capped_head_matches_torch(rt, tmp_path):
    """set_loss_temperature(0.7) on Gemma 2 (its logits soft-capped at 3): the loss and every full fine-tuning
    gradient of the NumPy engine equal torch autograd of the cross-entropy of transformers' (capped) logits / 0.7,
    as TRL's GRPOTrainer scores them; the WebGPU engine's equal the NumPy engine's, token_losses too."""
    import copy

    from tiny_models import build_model, save_model

    hf = build_model("gemma2", seed=1)
    save_model(hf, tmp_path)
    temperature = 0.7
    ids, labels, mask = _sparse_batch(3)
    torch_model = copy.deepcopy(hf)
    logits = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits / temperature
    targets = torch.tensor(shift_labels(labels))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=IGNORE_INDEX)
    loss.backward()
    expected = {n: p.grad.numpy() for n, p in torch_model.named_parameters()}
    models = {}
    for backend in ("numpy", "wgpu"):
        model = wt.load_model(tmp_path, backend=backend, device=None if backend == "numpy" else str(rt.info.index))
        model.set_full_finetune()
        model.engine.set_loss_temperature(temperature)
        models[backend] = model
    ours, grads = models["numpy"].loss_and_grads(ids, labels, mask)
    assert_close(ours, loss.item(), "loss_f32", "loss at temperature 0.7")
    for name, g in expected.items():
        assert_close(grads[name], g, "grads_f32", name)
    gpu_loss, gpu_grads = models["wgpu"].loss_and_grads(ids, labels, mask)
    assert_close(np.float64(gpu_loss), np.float64(ours), "gpu_loss", "loss")
    for name, g in grads.items():
        assert_close(gpu_grads[name], g, "gpu_grads", name)
    inputs = _inputs(ids, labels, mask)
    assert_close(models["wgpu"].engine.token_losses(*inputs), models["numpy"].engine.token_losses(*inputs),
                 "gpu_loss", "token losses at temperature 0.7")
    models["numpy"].engine.set_loss_temperature(1.0)
    untempered = models["numpy"].engine.token_losses(*inputs)
    assert np.abs(untempered - models["wgpu"].engine.token_losses(*inputs)).max() > 1e-3   # it changes them
