"""DoRA (PEFT's use_dora) against PEFT and torch autograd: logits, loss and the gradients of A, B and the
magnitudes on the NumPy engine (LoRA dropout included, with PEFT given the same masks), adapters both ways,
the merge; the WebGPU engine against the NumPy engine (gradients, AdamW steps, gradient checkpointing, NF4)."""
from __future__ import annotations

import copy

import numpy as np
import peft
import pytest
import torch

from conftest import require_adapter
from finetune_helpers import padded_batch
from tiny_models import build_model, save_model
from tolerances import assert_close
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.adapters.dora import magnitude_key
from wgpu_train.errors import ConfigError
from wgpu_train.engines.loading import load_model
from wgpu_train.engines.numpy import ops
from wgpu_train.engines.shared.labels import shift_labels

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Qwen2 (q/k/v biases: DoRA scales W x, not the bias)."""
    hf = build_model("qwen2", seed=5)
    folder = tmp_path_factory.mktemp("qwen2")
    save_model(hf, folder)
    return hf, folder


def peft_dora(hf, seed=0, dropout=0.0):
    """A PEFT DoRA model on every linear module, B random and the magnitudes moved off their initial norms."""
    cfg = peft.LoraConfig(r=3, lora_alpha=5, lora_dropout=dropout, target_modules=TARGETS, use_dora=True)
    pm = peft.get_peft_model(copy.deepcopy(hf), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    return pm.eval()


def batch():
    return padded_batch(3, 9, 6, 2)


def peft_grads(pm, ids, labels, mask):
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    grads = {}
    for n, p in pm.named_parameters():
        if p.requires_grad:
            key = n.replace(".default.", ".")
            grads[key[:-len(".weight")] if "magnitude" in key else key] = p.grad.numpy()
    return out.loss.item(), grads


class FixedMask(torch.nn.Module):
    """PEFT's lora_dropout replaced by the mask the NumPy engine drew."""

    def __init__(self, mask):
        super().__init__()
        self.mask = torch.tensor(mask)

    def forward(self, x):
        return x * self.mask.reshape(x.shape)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_numpy_matches_peft(tiny, tmp_path, dropout):
    """A PEFT DoRA adapter loads here: logits, loss and the gradients of A, B and m equal PEFT's (with
    dropout: PEFT's dropout modules apply the masks this engine drew)."""
    hf, folder = tiny
    pm = peft_dora(hf, seed=1)
    pm.save_pretrained(tmp_path)
    ids, labels, mask = batch()
    model = load_model(folder)
    model.load_adapter(tmp_path, dropout=dropout)
    assert model.lora_config.use_dora
    real = mask.astype(bool)
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert_close(model.logits(ids, mask)[real], want[real], "logits_f32")
    loss, grads = model.loss_and_grads(ids, labels, mask)
    if dropout:
        eng, n = model.engine, ids.size      # dropout_calls still counts the call just made
        for name, module in pm.base_model.model.named_modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                layer, mod = int(name.split(".")[2]), name.rsplit(".", 1)[1]
                m = ops.dropout_mask(eng.dropout_module_seed(layer, mod), (n, module.in_features), dropout)
                module.lora_dropout["default"] = FixedMask(m)
        pm.train()
    theirs_loss, expected = peft_grads(pm, ids, labels, mask)
    assert_close(loss, theirs_loss, "loss_f32", "loss")
    assert set(grads) == set(expected) and len(grads) == 3 * 7 * 2
    for name, g in expected.items():
        assert np.abs(g).max() > 1e-4, name
        assert_close(grads[name], g, "grads_f32", name)


def test_our_adapter_loads_in_peft_and_merges(tiny, tmp_path):
    """Ours in PEFT: the same tensors (use_dora, lora_magnitude_vector) and logits; our merge equals PEFT's
    merge_and_unload."""
    hf, folder = tiny
    model = load_model(folder)
    model.add_lora(LoraConfig(r=3, alpha=5, target_modules="all-linear", use_dora=True), seed=2)
    rng = np.random.default_rng(0)
    current = model.engine.trainable()
    model.engine.set_trainable({k: (0.3 * rng.standard_normal(v.shape) if k.endswith("lora_B") else
                                    v * (1 + 0.2 * rng.standard_normal(v.shape)) if "magnitude" in k else v)
                                for k, v in current.items()})
    model.save_adapter(tmp_path)
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    assert pm.peft_config["default"].use_dora
    ours = model.lora_state_dict()
    assert any(k == magnitude_key("model.layers.1.mlp.down_proj") for k in ours)
    for k, v in peft.get_peft_model_state_dict(pm).items():
        assert_close(v.numpy(), ours[k], "exact", k)
    ids, _, mask = batch()
    real = mask.astype(bool)
    with torch.no_grad():
        want = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert_close(model.logits(ids, mask)[real], want[real], "logits_f32")
    merged = pm.merge_and_unload().state_dict()
    for name, w in model.merged_weights().items():
        if name.endswith("_proj.weight"):
            assert_close(w, merged[name].numpy(), "merged_dora_weights", name)


def test_magnitude_starts_at_the_weight_norm(tiny):
    """add_lora: m = ||W|| per output row (B = 0), as PEFT initialises it; the model's output is unchanged."""
    hf, folder = tiny
    model = load_model(folder)
    ids, _, mask = batch()
    before = model.logits(ids, mask)
    model.add_lora(LoraConfig(r=2, alpha=4, target_modules="q_proj,down_proj", use_dora=True), seed=0)
    w = model.engine.weights()
    for path, m in model._magnitudes().items():
        assert_close(m, np.linalg.norm(w[path + ".weight"].astype(np.float64), axis=1).astype(np.float32), "exact", path)
    assert_close(model.logits(ids, mask), before, "dora_identity", "a fresh DoRA adapter changes nothing")


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_refused_combinations(init):
    with pytest.raises(ConfigError, match="DoRA"):
        LoraConfig(use_dora=True, init=init)


# ---- the kernels (shaders/dora.wgsl) against engines/numpy/ops.py in float64: odd sizes, element offsets ----

def _padded(rt, a, lead):
    """(buffer, element offset) holding `lead` junk elements, then a, then junk."""
    a = np.ascontiguousarray(a, np.float32).ravel()
    junk = np.full(lead + a.size + 5, 7, np.float32)
    junk[lead:lead + a.size] = a
    return rt.upload(junk), lead


def _read(rt, t, shape):
    return rt.read(t[0], np.float32, shape, offset=t[1] * 4)


@pytest.mark.parametrize("n,out_f,r", [(1, 1, 1), (37, 45, 3), (130, 67, 7)])
def test_dora_kernels(rt, n, out_f, r):
    from wgpu_train.engines.webgpu import kernels as K

    g = np.random.default_rng(n + out_f)
    f32 = lambda *s: g.standard_normal(s).astype(np.float32)      # noqa: E731
    w, a, b = f32(out_f, 11), 0.3 * f32(r, 11), 0.3 * f32(out_f, r)
    wsq = (w.astype(np.float64) ** 2).sum(1)
    pt, gg = a.astype(np.float64) @ w.T, a.astype(np.float64) @ a.T
    z, dy, m, bias, dm0 = f32(n, out_f), f32(n, out_f), 1 + 0.1 * f32(out_f), f32(out_f), f32(out_f)
    t = {k: _padded(rt, v, lead) for lead, (k, v) in enumerate(
        {"wsq": wsq, "pt": pt, "g": gg, "b": b, "z": z, "dy": dy, "m": m, "bias": bias, "dm": dm0}.items(), 3)}
    rn, y, y2, dz = ((rt.buffer(4 * (size + 6)), 6) for size in (out_f, n * out_f, n * out_f, n * out_f))
    y0 = f32(n, out_f)
    y2 = _padded(rt, y0, 2)
    rec = rt.recorder()
    K.dora_norm(rec, rn, t["wsq"], t["pt"], t["g"], t["b"], 0.7, out_f, r)
    K.dora_forward(rec, y, t["z"], t["m"], rn, t["bias"], n, out_f)
    K.dora_forward(rec, y2, t["z"], t["m"], rn, None, n, out_f, offset=1.0, accumulate=True)
    K.dora_backward(rec, dz, t["dm"], t["dy"], t["z"], t["m"], rn, n, out_f, offset=1.0)
    rec.submit()
    want_rn = ops.dora_norm(wsq, pt, gg, b.astype(np.float64), 0.7)
    assert_close(want_rn, 1 / np.linalg.norm(w + 0.7 * (b.astype(np.float64) @ a), axis=1), "k_elementwise",
                 "the reference's norm")
    assert_close(_read(rt, rn, (out_f,)), want_rn, "k_dora", "dora_norm")
    rn64 = _read(rt, rn, (out_f,)).astype(np.float64)
    m64, z64, dy64 = m.astype(np.float64), z.astype(np.float64), dy.astype(np.float64)
    assert_close(_read(rt, y, (n, out_f)), ops.dora_forward(z64, m64, rn64, bias.astype(np.float64)), "k_dora",
                 "dora_forward")
    assert_close(_read(rt, y2, (n, out_f)), y0 + ops.dora_forward(z64, m64, rn64, None, 1.0), "k_dora",
                 "dora_forward, accumulated, offset 1")
    want_dz, want_dm = ops.dora_backward(dy64, z64, m64, rn64, 1.0)
    assert_close(_read(rt, dz, (n, out_f)), want_dz, "k_dora", "dora_backward dz")
    assert_close(_read(rt, t["dm"], (out_f,)), dm0 + want_dm, "k_dora_sum", "dora_backward dm (added)")


# ---- the WebGPU engine against the NumPy engine ----------------------------------------------------

def _dora_model(folder, backend="numpy", rt=None, base_dtype="float32", dropout=0.0, targets="all-linear"):
    """A DoRA model (B random, the magnitudes moved off their initial norms; the same on both engines)."""
    lora = LoraConfig(r=3, alpha=5, dropout=dropout, target_modules=targets, use_dora=True)
    model = load_model(folder, backend=backend, base_dtype=base_dtype,
                       **({"device": str(rt.info.index)} if backend == "wgpu" else {}))
    model.add_lora(lora, seed=5)
    rng = np.random.default_rng(7)
    model.engine.set_trainable({
        k: (0.2 * rng.standard_normal(v.shape) if k.endswith("lora_B") else
            v * (1 + 0.2 * rng.standard_normal(v.shape)) if "magnitude" in k else v).astype(np.float32)
        for k, v in model.engine.trainable().items()})
    return model


def _dora_pair(folder, rt, base_dtype="float32", dropout=0.0, targets="all-linear"):
    """The same DoRA model on the NumPy and the WebGPU engine."""
    ref = _dora_model(folder, "numpy", None, base_dtype, dropout, targets)
    gpu = _dora_model(folder, "wgpu", rt, base_dtype, dropout, targets)
    gpu.engine.set_trainable(ref.engine.trainable())
    return ref, gpu


def _steps(model, micro, hp, n=3):
    return [model.engine.train_step(micro, hp, step) for step in range(1, n + 1)]


@pytest.mark.parametrize("base_dtype,dropout", [("float32", 0.0), ("nf4", 0.0), ("float32", 0.3)])
def test_wgpu_matches_numpy(tiny, rt, base_dtype, dropout):
    """Loss and the gradients of A, B and m, then three AdamW steps (LoRA+ ratio 2, the magnitudes at B's
    rate), on both engines: the GPU recomputes the norms from the moved A, B before every step's forward."""
    require_adapter()
    _, folder = tiny
    ref, gpu = _dora_pair(folder, rt, base_dtype, dropout)
    ids, labels, mask = batch()
    for _ in range(2 if dropout else 1):     # with dropout: a new mask per call, the same on both engines
        loss_ref, grads_ref = ref.loss_and_grads(ids, labels, mask)
        loss_gpu, grads_gpu = gpu.loss_and_grads(ids, labels, mask)
        assert_close(np.float64(loss_gpu), np.float64(loss_ref), "gpu_loss", "loss")
        assert len(grads_ref) == 3 * 7 * 2
        for k, g in grads_ref.items():
            assert np.abs(g).max() > 1e-5, k
            assert_close(grads_gpu[k], g, "gpu_grads", k)
    assert_close(gpu.logits(ids, mask), ref.logits(ids, mask), "gpu_logits", "logits")
    hp = OptimizerParams(lr=1e-2, weight_decay=0.01, lora_b_lr_ratio=2.0)
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
    micro = [(ids[:1].astype(np.int32), shift_labels(labels[:1]), mask[:1].astype(np.int32), pos[:1]),
             (ids[1:].astype(np.int32), shift_labels(labels[1:]), mask[1:].astype(np.int32), pos[1:])]
    for (l_ref, _, n_ref, _), (l_gpu, _, n_gpu, _) in zip(_steps(ref, micro, hp), _steps(gpu, micro, hp)):
        assert_close(np.float64(l_gpu), np.float64(l_ref), "gpu_loss", "step loss")
        assert_close(np.float64(n_gpu), np.float64(n_ref), "gpu_loss", "grad norm")
    after_ref, after_gpu = ref.engine.trainable(), gpu.engine.trainable()
    for k, v in after_ref.items():
        assert_close(after_gpu[k], v, "gpu_params_after_steps", k)
    assert gpu.engine.last_step["submits"] == 1
    assert_close(gpu.logits(ids, mask), ref.logits(ids, mask), "gpu_logits", "logits after the steps")


def test_wgpu_loads_peft_adapter_and_generates(tiny, rt, tmp_path):
    """A PEFT DoRA adapter on the WebGPU engine: PEFT's logits and loss; greedy generation (the KV-cache path)
    equals PEFT's."""
    require_adapter()
    hf, folder = tiny
    pm = peft_dora(hf, seed=3)
    pm.save_pretrained(tmp_path)
    model = load_model(folder, backend="wgpu", device=str(rt.info.index))
    model.load_adapter(tmp_path)
    ids, labels, mask = batch()
    real = mask.astype(bool)
    with torch.no_grad():
        out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
        prompt = ids[0, :5]
        want = pm.generate(input_ids=torch.tensor(prompt)[None], max_new_tokens=8, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    assert_close(model.logits(ids, mask)[real], out.logits.numpy()[real], "gpu_logits")
    assert_close(np.float64(model.loss_and_grads(ids, labels, mask)[0]), np.float64(out.loss.item()), "gpu_loss")
    assert model.generate(prompt, max_new_tokens=8) == want


def test_wgpu_checkpointing_is_bit_identical(tiny, rt):
    """Gradient checkpointing recomputes z = W x_d + s B A x_d of the layer's last module too: the same bits."""
    require_adapter()
    _, folder = tiny
    runs = []
    for checkpointing in (False, True):
        gpu = _dora_model(folder, "wgpu", rt, dropout=0.2, targets="q_proj,v_proj,o_proj,down_proj")
        gpu.set_gradient_checkpointing(checkpointing)
        ids, labels, mask = batch()
        pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
        micro = [(ids.astype(np.int32), shift_labels(labels), mask.astype(np.int32), pos)]
        losses = [s[0] for s in _steps(gpu, micro, OptimizerParams(lr=2e-2))]
        runs.append((losses, gpu.engine.trainable()))
    assert runs[0][0] == runs[1][0]
    for k, v in runs[0][1].items():
        assert_close(runs[1][1][k], v, "exact", k)


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_loraplus_steps_match_peft_optimizer(tiny, tmp_path, request, backend):
    """Two AdamW steps with LoRA+ (ratio 4) against torch AdamW under PEFT's create_loraplus_optimizer on
    the PEFT DoRA model, which gives the magnitudes (1-D) B's learning rate."""
    from peft.optimizers import create_loraplus_optimizer

    hf, folder = tiny
    model = _dora_model(folder, backend, request.getfixturevalue("default_rt") if backend == "wgpu" else None)
    model.save_adapter(tmp_path)
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path, is_trainable=True)
    opt = create_loraplus_optimizer(pm, torch.optim.AdamW, lr=1e-2, loraplus_lr_ratio=4.0,
                                    loraplus_weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    ids, labels, mask = batch()
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
    micro = [(ids.astype(np.int32), shift_labels(labels), mask.astype(np.int32), pos)]
    hp = OptimizerParams(lr=1e-2, weight_decay=0.01, max_grad_norm=None, lora_b_lr_ratio=4.0)
    for step in (1, 2):
        opt.zero_grad()
        pm(torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels)).loss.backward()
        opt.step()
        model.engine.train_step(micro, hp, step)
    got = model.lora_state_dict()
    want = {k: v.numpy() for k, v in peft.get_peft_model_state_dict(pm).items()}
    assert set(got) == set(want) and any("magnitude" in k for k in want)
    for k, w in want.items():
        assert_close(got[k], w, "params_vs_torch_adamw", k)


# ---- training runs: finetune --dora, resume, --adapter-path, memory estimate, the command line ----------

@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from finetune_helpers import make_data_dir, make_model_dir

    root = tmp_path_factory.mktemp("ft_dora")
    return make_model_dir(root / "model"), make_data_dir(root / "data")


def _config(workspace, out, **kw):
    from wgpu_train.training.config import TrainConfig

    model, data = workspace
    base = dict(model=str(model), data=str(data), out=str(out), backend="numpy", no_progress=True, lr=1e-2,
                eval_generate=False, dora=True, lora_targets="q_proj,v_proj,down_proj")
    return TrainConfig(**{**base, **kw})


def test_finetune_resume_and_continue(workspace, tmp_path):
    """finetune with dora trains the magnitudes, writes use_dora and lora_magnitude_vector; a resume from
    the middle (optimizer state with the magnitudes' moments, dropout) equals the uninterrupted run; an
    adapter continues with --adapter-path; --dora against a plain adapter is refused."""
    import json

    from wgpu_train.adapters.files import read_adapter
    from wgpu_train.distributed.dispatch import finetune

    kw = dict(max_steps=4, batch_size=2, grad_accum=2, lora_dropout=0.2, weight_decay=0.05, keep_checkpoints=0)
    full = finetune(_config(workspace, tmp_path / "full", save_every=2, **kw))
    assert json.loads((tmp_path / "full" / "adapter_config.json").read_text())["use_dora"] is True
    cfg, tensors = read_adapter(tmp_path / "full")
    assert cfg.use_dora and sum(k.endswith("lora_magnitude_vector") for k in tensors) == 3 * 2
    base = load_model(workspace[0])
    w = base.engine.weights()
    key = magnitude_key("model.layers.0.mlp.down_proj")
    assert not np.allclose(tensors[key], np.linalg.norm(w["model.layers.0.mlp.down_proj.weight"], axis=1)), \
        "the magnitudes moved"
    ckpt = tmp_path / "full" / "checkpoints" / "step-000002"
    resumed = finetune(_config(workspace, tmp_path / "resumed", resume=str(ckpt), **kw))
    assert resumed["steps"] == full["steps"] == 4
    again = read_adapter(tmp_path / "resumed")[1]
    for k in tensors:
        assert np.array_equal(tensors[k], again[k]), k
    cont = finetune(_config(workspace, tmp_path / "cont", max_steps=1, adapter_path=str(tmp_path / "full"),
                            dora=False, lora_targets="q_proj,v_proj"))
    assert cont["steps"] == 1 and read_adapter(tmp_path / "cont")[0].use_dora
    finetune(_config(workspace, tmp_path / "plain", max_steps=1, dora=False))
    with pytest.raises(ConfigError, match="--dora True contradicts the adapter's use_dora=False"):
        finetune(_config(workspace, tmp_path / "bad", max_steps=1, adapter_path=str(tmp_path / "plain")))


def test_memory_and_trainable_count(tiny):
    """The magnitudes (and their gradient, moments, norm buffers, z activations) are counted."""
    from wgpu_train.models.config import ModelConfig
    from wgpu_train.engines.webgpu.memory import estimate_memory
    from wgpu_train.engines.webgpu.memory import count_trainable

    _, folder = tiny
    cfg = ModelConfig.from_folder(folder)
    plain, dora = (LoraConfig(r=3, target_modules="q_proj,down_proj", use_dora=d) for d in (False, True))
    outs = cfg.linear_shape("q_proj")[0] + cfg.linear_shape("down_proj")[0]
    assert count_trainable(cfg, dora) - count_trainable(cfg, plain) == cfg.num_hidden_layers * outs
    model = load_model(folder)
    model.add_lora(dora)
    assert count_trainable(cfg, dora) == sum(v.size for v in model.engine.trainable().values())
    a, b = (estimate_memory(cfg, 2, 9, lora) for lora in (plain, dora))
    norms = 2 * cfg.num_hidden_layers * outs + 3 * cfg.linear_shape("q_proj")[0] + 9
    assert b["trainable_state"] - a["trainable_state"] == 4 * (4 * cfg.num_hidden_layers * outs + norms)
    assert b["activations"] > a["activations"]


def test_memory_estimate_is_what_the_engine_allocates(tiny, rt):
    """The WebGPU engine's DoRA buffers and activations are the sizes estimate_memory counts."""
    require_adapter()
    from wgpu_train.models.config import ModelConfig
    from wgpu_train.engines.webgpu.memory import estimate_memory

    _, folder = tiny
    cfg = ModelConfig.from_folder(folder)
    for dropout in (0.0, 0.2):
        lora = LoraConfig(r=3, dropout=dropout, target_modules="q_proj,k_proj,v_proj,down_proj", use_dora=True)
        model = load_model(folder, backend="wgpu", device=str(rt.info.index))
        model.add_lora(lora)
        eng = model.engine
        state = (sum(b.size for b in eng.optimizer.state_buffers if b is not eng.optimizer.partials)      # moments
                 + sum(p.buf.size for p in eng._lora_packed)                             # parameters, gradients
                 + sum(b.size for b in eng.dora.buffers))
        acts = eng._activations(1, 64, train=True)
        allocated = sum({id(b): b.size for layer in acts.layers.values() for b in layer.values()}.values())
        allocated += sum(v.size for k, v in vars(acts).items() if hasattr(v, "destroy") and k != "logits" and k
                         not in ("ids", "segments", "positions", "targets", "head_index"))
        est = estimate_memory(cfg, 1, 64, lora)
        assert est["trainable_state"] == state
        assert est["activations"] == allocated


def test_cli_dora_and_refusals(workspace, tmp_path, capsys):
    """--dora on the command line; --dora with --lora-init pissa is one line, exit 2."""
    from wgpu_train.cli.main import main

    model, data = workspace
    common = ["finetune", "--model", str(model), "--data", str(data), "--backend", "numpy", "--max-steps", "1",
              "--no-progress", "--no-eval-generate"]
    assert main(common + ["--out", str(tmp_path / "a"), "--dora"]) == 0
    assert (tmp_path / "a" / "adapter_model.safetensors").is_file()
    # merge folds it in: (m / ||W + s B A||) (W + s B A)
    assert main(["merge", "--adapter-path", str(tmp_path / "a"), "--out", str(tmp_path / "m"), "--model",
                 str(model)]) == 0
    from wgpu_train.adapters.dora import merged
    from wgpu_train.adapters.files import read_adapter
    from wgpu_train.formats.safetensors import read_safetensors

    cfg, tensors = read_adapter(tmp_path / "a")
    base, out = read_safetensors(model / "model.safetensors"), read_safetensors(tmp_path / "m" / "model.safetensors")
    path = "model.layers.1.self_attn.v_proj"
    want = merged(base[path + ".weight"], tensors[f"base_model.model.{path}.lora_A.weight"],
                  tensors[f"base_model.model.{path}.lora_B.weight"], cfg.scale, tensors[magnitude_key(path)])
    assert_close(out[path + ".weight"], want, "exact", "merged v_proj")
    assert not np.array_equal(want, base[path + ".weight"])
    capsys.readouterr()
    assert main(common + ["--out", str(tmp_path / "b"), "--dora", "--lora-init", "pissa"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DoRA with LoRA init pissa" in err[0]
    assert main(common + ["--out", str(tmp_path / "c"), "--dora", "--method", "full"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dora trains a LoRA adapter's magnitudes: method lora" in err[0]


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_data_parallel_reduce_covers_the_magnitudes(tiny, request, backend):
    """train_step's `reduce` (data parallelism) gets the magnitudes' gradients with A's and B's: an identity
    reduce gives the plain step, a zero one leaves every tensor, magnitudes included, where it was."""
    _, folder = tiny
    rt = request.getfixturevalue("default_rt") if backend == "wgpu" else None
    ids, labels, mask = batch()
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
    micro = [(ids.astype(np.int32), shift_labels(labels), mask.astype(np.int32), pos)]
    hp = OptimizerParams(lr=1e-2)
    results, seen = [], []
    for reduce in (None, lambda g, total: (seen.append(g.size), g)[1], lambda g, total: 0 * g):
        model = _dora_model(folder, backend, rt, targets="q_proj,down_proj")
        before = {k: v.copy() for k, v in model.engine.trainable().items()}    # the NumPy engine's are live
        model.engine.train_step(micro, hp, 1, reduce=reduce)
        results.append((before, model.engine.trainable()))
    assert seen == [sum(v.size for v in results[0][0].values())]
    for k, v in results[0][1].items():
        assert_close(results[1][1][k], v, "exact", f"{k} through an identity reduce")
        assert_close(results[2][1][k], results[2][0][k], "exact", f"{k} after a zero reduce")
        if "magnitude" in k:
            assert not np.array_equal(v, results[0][0][k]), k


def test_dora_beside_modules_to_save(tiny, rt, tmp_path):
    """DoRA and a modules_to_save copy of the (tied) head in one adapter: the same loss and gradients (LoRA, the
    magnitudes and the copy) on both engines, and the adapter saved by one engine loads in the other exactly."""
    require_adapter()
    _, folder = tiny
    lora = LoraConfig(r=3, alpha=6, target_modules="q_proj,v_proj,down_proj", use_dora=True,
                      modules_to_save=("lm_head",))
    ids = np.random.default_rng(0).integers(0, 83, (2, 9))
    ref, gpu = load_model(folder), load_model(folder, backend="wgpu", device=str(rt.info.index))
    ref.add_lora(lora, seed=2)
    gpu.add_lora(lora, seed=2)
    loss_ref, grads_ref = ref.loss_and_grads(ids, ids)
    loss_gpu, grads_gpu = gpu.loss_and_grads(ids, ids)
    assert_close(np.float64(loss_gpu), np.float64(loss_ref), "gpu_loss")
    assert any("lora_magnitude_vector" in k for k in grads_ref) and "base_model.model.lm_head.weight" in grads_ref
    assert set(grads_gpu) == set(grads_ref)
    for k in grads_ref:
        assert_close(grads_gpu[k], grads_ref[k], "gpu_grads", k)
    # a few steps move B, the magnitudes and the copy away from their start; the saved adapter carries them all
    targets = shift_labels(ids)
    micro = [(ids.astype(np.int32), targets, np.ones_like(ids, np.int32),
              np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy())]
    for step in (1, 2, 3):
        gpu.engine.train_step(micro, OptimizerParams(lr=1e-2), step)
    gpu.save_adapter(tmp_path / "a")
    again = load_model(folder)
    again.load_adapter(tmp_path / "a")
    assert_close(again.logits(ids), gpu.logits(ids), "gpu_logits")
    assert not np.allclose(again.logits(ids), ref.logits(ids), atol=1e-3)
