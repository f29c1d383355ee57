"""LoRA initialisations against PEFT (init_lora_weights): the same PiSSA / OLoRA A, B and residual base,
gaussian's distribution, PEFT's conversion of a trained PiSSA / OLoRA adapter into a rank-2r LoRA on the
original base (both ways), unconverted adapters (the residual rebuilt on loading), training, resuming and
merging them, and the combinations refused."""
from __future__ import annotations

import copy
import json

import numpy as np
import peft
import pytest
import torch

from conftest import require_adapter
from finetune_helpers import make_data_dir, make_model_dir, one_line_error
from tiny_models import build_model, save_model
from tolerances import assert_close
from wgpu_train.cli.main import main
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.errors import ConfigError
from wgpu_train.adapters.inits import decompose
from wgpu_train.engines.loading import load_model
from wgpu_train.engines.shared.labels import shift_labels
from wgpu_train.engines.shared.quant import round_weights

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

R, ALPHA = 3, 5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = build_model("llama", seed=31)
    folder = tmp_path_factory.mktemp("llama_init")
    save_model(hf, folder)
    return hf, folder


def batch():
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 83, (2, 10))
    labels = ids.copy()
    labels[:, :3] = -100
    return ids, labels


def logits(pm, ids):
    with torch.no_grad():
        return pm(input_ids=torch.tensor(ids)).logits.numpy()


def peft_init(hf, init, **kw):
    cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=init, **kw)
    return peft.get_peft_model(copy.deepcopy(hf), cfg).eval()


def lora_tensors(pm) -> dict:
    return {n.replace(".default.", "."): p.detach().numpy().copy() for n, p in pm.named_parameters() if "lora_" in n}


def base_weights(pm) -> dict:
    """A PEFT model's (possibly residual) base weights by our names."""
    return {n.replace(".base_layer", ""): p.detach().numpy() for n, p in pm.base_model.model.named_parameters()
            if ".base_layer.weight" in n}


def train_steps(model, steps=2):
    """Real AdamW steps on the model's engine (B moves off its init, A too)."""
    ids, labels = batch()
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
    micro = [(ids.astype(np.int32), shift_labels(labels), np.ones_like(ids, dtype=np.int32), pos)]
    for step in range(1, steps + 1):
        model.engine.train_step(micro, OptimizerParams(lr=2e-2), step=step)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_init_matches_peft(tiny, init):
    """The same A, B and residual base as PEFT (PiSSA's singular vectors up to their sign, which no SVD fixes),
    and the model is unchanged by the init."""
    hf, folder = tiny
    pm = peft_init(hf, init)
    model = load_model(folder)
    model.add_lora(LoraConfig(r=R, alpha=ALPHA, target_modules="all-linear", init=init))
    theirs, mine = lora_tensors(pm), model.lora_state_dict()
    assert set(theirs) == set(mine)
    for k, v in theirs.items():
        if init == "pissa":      # flip each rank component of ours to PEFT's sign (A's rows, B's columns)
            a_key = k.replace("lora_B", "lora_A")
            sign = np.sign(np.sum(mine[a_key] * theirs[a_key], axis=1))          # (r,)
            ours = mine[k] * (sign[:, None] if "lora_A" in k else sign[None, :])
            assert np.all(sign != 0)
        else:
            ours = mine[k]
        assert_close(ours, v, "init_factors", k)
    residual = model.engine.weights()
    for name, w in base_weights(pm).items():
        assert_close(residual[name], w, "init_residual", name)
    ids, _ = batch()
    assert_close(model.logits(ids), logits(hf, ids), "init_logits")
    assert_close(logits(pm, ids), logits(hf, ids), "init_logits", "PEFT's own")


def test_pissa_niter_matches_full_svd_and_peft():
    """pissa_niter_K (randomised SVD, K subspace iterations) on a weight whose top singular values stand apart:
    B A and the residual agree with full-SVD PiSSA and with PEFT's pissa_niter_K."""
    rng = np.random.default_rng(0)
    u = np.linalg.qr(rng.standard_normal((37, 37)))[0]
    v = np.linalg.qr(rng.standard_normal((29, 29)))[0]
    s = np.concatenate([[9.0, 6.0, 4.0], 0.05 * rng.random(26)])
    w = (u[:, :29] * s) @ v.T                                                  # (37, 29)
    scale = ALPHA / R
    a0, b0, res0 = decompose(w.astype(np.float32), R, scale, "pissa", rng)
    a, b, res = decompose(w.astype(np.float32), R, scale, "pissa_niter_4", np.random.default_rng(1))
    assert_close(b @ a, b0 @ a0, "init_niter")
    assert_close(res, res0, "init_niter")

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(29, 37, bias=False)

        def forward(self, x):
            return self.proj(x)

    net = One()
    with torch.no_grad():
        net.proj.weight.copy_(torch.tensor(w, dtype=torch.float32))
    torch.manual_seed(0)
    pm = peft.get_peft_model(net, peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["proj"],
                                                  init_lora_weights="pissa_niter_4"))
    layer = pm.base_model.model.proj
    ba = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight).detach().numpy()
    assert_close(b @ a, ba, "init_niter", "PEFT's pissa_niter_4")
    assert_close(res, layer.base_layer.weight.detach().numpy(), "init_niter", "PEFT's residual")


def test_gaussian(tiny, tmp_path):
    hf, folder = tiny
    model = load_model(folder)
    model.add_lora(LoraConfig(r=4, alpha=8, target_modules="all-linear", init="gaussian"), seed=3)
    state = model.lora_state_dict()
    a = np.concatenate([v.reshape(-1) for k, v in state.items() if ".lora_A." in k])
    assert not any(v.any() for k, v in state.items() if ".lora_B." in k)
    assert abs(a.mean()) < 0.02 and abs(a.std() - 1 / 4) < 0.01, (a.mean(), a.std())    # PEFT: normal, std 1/r
    model.save_adapter(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["init_lora_weights"] == "gaussian"
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path)
    assert pm.peft_config["default"].init_lora_weights == "gaussian"
    assert_close(lora_tensors(pm)[next(k for k in state if ".lora_A." in k)],
                 state[next(k for k in state if ".lora_A." in k)], "exact")


@pytest.mark.parametrize("init, backend", [("pissa", "numpy"), ("olora", "numpy"), ("pissa", "wgpu")])
def test_trained_adapter_converted_for_the_original_base(tiny, tmp_path, init, backend):
    """After training over the residual, save_adapter writes PEFT's conversion: rank 2r, alpha 2 alpha,
    init_lora_weights true, and on the untouched base model PEFT computes the logits of ours; the merged
    weights equal PEFT's merge of it."""
    if backend == "wgpu":
        require_adapter()
    hf, folder = tiny
    model = load_model(folder, backend=backend)
    model.add_lora(LoraConfig(r=R, alpha=ALPHA, target_modules="all-linear", init=init))
    train_steps(model)
    model.save_adapter(tmp_path)
    raw = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (raw["r"], raw["lora_alpha"], raw["init_lora_weights"]) == (2 * R, 2 * ALPHA, True)
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path)
    ids, _ = batch()
    ours = model.logits(ids)
    assert not np.allclose(ours, logits(hf, ids), atol=1e-3), "training should have changed the model"
    assert_close(ours, logits(pm, ids), "logits_f32" if backend == "numpy" else "gpu_logits")
    merged = model.merged_weights()
    pm.merge_adapter()
    for name, w in base_weights(pm).items():
        assert_close(merged[name], w, "merged_logits", name)
    # and it loads here on the original base as a plain LoRA of rank 2r
    again = load_model(folder)
    again.load_adapter(tmp_path)
    assert (again.lora_config.r, again.lora_config.init) == (2 * R, "default")
    assert_close(again.logits(ids), ours, "logits_f32" if backend == "numpy" else "gpu_logits")


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_peft_adapters_load_here(tiny, tmp_path, init):
    """PEFT's converted adapter (path_initial_model_for_weight_conversion) and its unconverted one (init
    pissa / olora, whose residual the loader rebuilds, as PEFT does) give PEFT's logits here on the original
    base; ours unconverted loads in PEFT the same way."""
    hf, folder = tiny
    pm = peft_init(hf, init)
    pm.save_pretrained(tmp_path / "initial")
    with torch.no_grad():        # "training": move every A and B
        gen = torch.Generator().manual_seed(2)
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    ids, _ = batch()
    want = logits(pm, ids)
    pm.save_pretrained(tmp_path / "plain")
    pm.save_pretrained(tmp_path / "converted", path_initial_model_for_weight_conversion=str(tmp_path / "initial"))
    for name in ("converted", "plain"):
        model = load_model(folder)
        model.load_adapter(tmp_path / name)
        assert model.lora_config.init == (init if name == "plain" else "default"), name
        assert_close(model.logits(ids), want, "logits_f32", name)
    model.save_adapter(tmp_path / "ours_plain", convert=False)       # the one loaded from "plain"
    assert json.loads((tmp_path / "ours_plain" / "adapter_config.json").read_text())["init_lora_weights"] == init
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours_plain")
    assert_close(logits(theirs, ids), want, "logits_f32", "ours unconverted in PEFT")


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_residual_is_rounded_like_the_base(tiny, backend):
    """With an NF4 base, the residual is computed from the float32 weights, then stored as NF4."""
    if backend == "wgpu":
        require_adapter()
    _, folder = tiny
    model = load_model(folder, base_dtype="nf4", backend=backend)
    model.add_lora(LoraConfig(r=R, alpha=ALPHA, target_modules=("q_proj",), init="pissa"))
    full = load_model(folder)
    full.add_lora(LoraConfig(r=R, alpha=ALPHA, target_modules=("q_proj",), init="pissa"))
    name = "model.layers.1.self_attn.q_proj.weight"
    residual = full.engine.weights()[name]
    assert_close(model.engine.weights()[name], round_weights({name: residual}, "nf4")[name], "exact")
    # a LoRA without a residual puts the original base back
    model.add_lora(LoraConfig(r=R, alpha=ALPHA, target_modules=("q_proj",)))
    assert_close(model.engine.weights()[name], load_model(folder, base_dtype="nf4").engine.weights()[name], "exact")


def test_refused_inits(tiny):
    _, folder = tiny
    for kw, words in ((dict(init="svd"), "LoRA init must be one of"),
                      (dict(init="pissa_niter_0"), "got 'pissa_niter_0'"),
                      (dict(init="pissa", use_rslora=True, rank_pattern={"q_proj": 2}), "PEFT cannot convert")):
        with pytest.raises(ConfigError, match=words) as e:
            LoraConfig(**kw)
        assert "\n" not in str(e.value)
    model = load_model(folder)
    with pytest.raises(ConfigError, match=r"needs r <= min\(out, in\) = 10") as e:
        model.add_lora(LoraConfig(r=12, target_modules=("v_proj",), init="olora"))
    assert model.lora_config is None


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("init_cli")
    return make_model_dir(root / "model"), make_data_dir(root / "data")


def test_finetune_resume_and_merge_pissa(workspace, tmp_path, capsys):
    """wgpu-train finetune --lora-init pissa: checkpoints hold the adapter as trained (a resume rebuilds the
    residual and ends where the straight run ends), the final adapter is the converted one, and merging it
    gives the trained model's logits."""
    model_dir, data = workspace
    common = ["finetune", "--model", str(model_dir), "--data", str(data), "--backend", "numpy", "--max-steps", "3",
              "--batch-size", "4", "--lr", "0.02", "--lora-init", "pissa", "--lora-layers", "1",
              "--lora-rank-pattern", "v_proj=2", "--no-progress"]
    assert main(common + ["--out", str(tmp_path / "a"), "--save-every", "1"]) == 0
    ckpt = tmp_path / "a" / "checkpoints" / "step-000002"
    raw = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert (raw["init_lora_weights"], raw["r"], raw["layers_to_transform"]) == ("pissa", 8, [1])
    final = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (final["init_lora_weights"], final["r"], final["rank_pattern"]) == (True, 16, {"v_proj": 4})
    assert json.loads((tmp_path / "a" / "train_config.json").read_text())["lora_layers"] == "1,"
    assert main(common + ["--out", str(tmp_path / "b"), "--resume", str(ckpt)]) == 0
    from wgpu_train.formats.safetensors import read_safetensors

    first = read_safetensors(tmp_path / "a" / "adapter_model.safetensors")
    second = read_safetensors(tmp_path / "b" / "adapter_model.safetensors")
    assert set(first) == set(second) and len(first) == 4
    for k in first:
        assert_close(second[k], first[k], "exact", k)
    capsys.readouterr()
    assert main(["merge", "--model", str(model_dir), "--adapter-path", str(tmp_path / "a"),
                 "--out", str(tmp_path / "merged")]) == 0
    trained = load_model(model_dir)
    trained.load_adapter(ckpt.parent / "step-000003" / "adapter")    # unconverted: the residual rebuilt
    ids = np.arange(12).reshape(1, 12)
    assert_close(load_model(tmp_path / "merged").logits(ids), trained.logits(ids), "merged_logits")
    adapter = tmp_path / "a"
    one_line_error(capsys, ["finetune", "--model", str(model_dir), "--data", str(data), "--backend", "numpy",
                            "--adapter-path", str(adapter), "--lora-init", "olora", "--out", str(tmp_path / "c")],
                   "--lora-init olora initialises a new adapter")
    for extra, words in ((["--lora-init", "qr"], "LoRA init must be one of"),
                         (["--lora-layers", "x"], "--lora-layers 'x'"),
                         (["--lora-layers", "5"], "the model has only 2 layers"),
                         (["--lora-rank-pattern", "q_proj"], "expected PATTERN=NUMBER"),
                         (["--method", "full", "--lora-init", "pissa"], "method lora"),
                         (["--lora-init", "pissa", "--rslora", "--lora-alpha-pattern", "q_proj=3"], "PEFT cannot")):
        one_line_error(capsys, ["finetune", "--model", str(model_dir), "--data", str(data), "--backend", "numpy",
                                "--max-steps", "1", "--out", str(tmp_path / "d")] + extra, words)


def test_finetune_continues_an_unconverted_olora_adapter(workspace, tmp_path):
    """--adapter-path on an adapter saved as trained from OLoRA (init_lora_weights "olora", as PEFT's plain
    save_pretrained writes it): its residual is rebuilt, training goes on over it, and the adapter written is
    the converted one, whose logits on the original base are those of the last checkpoint (residual rebuilt)."""
    model_dir, data = workspace
    start = load_model(model_dir)
    start.add_lora(LoraConfig(r=4, alpha=8, target_modules=("q_proj", "o_proj"), init="olora"), seed=1)
    train_steps(start, 1)
    start.save_adapter(tmp_path / "start", convert=False)
    out = tmp_path / "out"
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--backend", "numpy", "--max-steps", "2",
                 "--adapter-path", str(tmp_path / "start"), "--lora-init", "olora", "--out", str(out),
                 "--no-progress"]) == 0
    assert json.loads((out / "train_config.json").read_text())["lora_init"] == "olora"
    final = json.loads((out / "adapter_config.json").read_text())
    assert (final["r"], final["lora_alpha"], final["init_lora_weights"]) == (8, 16, True)
    trained = load_model(model_dir)
    trained.load_adapter(out / "checkpoints" / "step-000002" / "adapter")
    converted = load_model(model_dir)
    converted.load_adapter(out)
    ids = np.arange(12).reshape(1, 12)
    assert_close(converted.logits(ids), trained.logits(ids), "logits_f32")
    assert not np.allclose(trained.logits(ids), start.logits(ids), atol=1e-4), "training should have moved it"
