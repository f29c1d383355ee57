"""modules_to_save (full copies of embed_tokens / lm_head trained beside LoRA) against PEFT 0.21 and torch: loss,
gradients and logits of PEFT-saved adapters on both engines, untied and in each of PEFT's tied cases; AdamW steps
(LoRA+, clipping) against PEFT's LoRA+ optimizer; the WebGPU engine against the NumPy one over float16 / NF4
storage; our adapters in PEFT; merge against merge_and_unload; resume; the memory estimate; bad input."""
from __future__ import annotations

import copy
import json

import numpy as np
import peft
import pytest
import torch
import transformers as tf

import wgpu_train as wt
from conftest import require_adapter
from finetune_helpers import build_tokenizer, make_data_dir, one_line_error, padded_batch
from tiny_models import build_model, save_model
from tolerances import assert_close
from wgpu_train.cli.main import main
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.errors import AdapterError, ConfigError
from wgpu_train.adapters.files import read_adapter
from wgpu_train.engines.webgpu.memory import count_trainable, estimate_memory
from wgpu_train.engines.shared.labels import shift_labels
from wgpu_train.adapters.saved_modules import EMBED, HEAD, trained_weights
from wgpu_train.distributed.dispatch import finetune

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")]

# name -> (architecture, modules_to_save, ensure_weight_tying); qwen2 and gemma2 tie their embeddings
CASES = {
    "untied": ("llama", ("embed_tokens", "lm_head"), False),
    "tied_embed": ("qwen2", ("embed_tokens",), False),      # the lookup trains a copy, the head keeps the original
    "tied_head": ("qwen2", ("lm_head",), False),
    "tied_both": ("qwen2", ("embed_tokens", "lm_head"), False),   # two copies trained apart
    "tied_shared": ("qwen2", ("embed_tokens",), True),      # one copy serves both
    "gemma_shared": ("gemma2", ("lm_head",), True),         # embed_scale and soft-capped logits on the copy
}
LORA = dict(r=3, lora_alpha=5, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (transformers model, its saved folder), built on first use."""
    cache = {}

    def get(arch):
        if arch not in cache:
            hf = build_model(arch, seed=7)
            cache[arch] = hf, save_model(hf, tmp_path_factory.mktemp(arch))
        return cache[arch]
    return get


def ours(case: str, **kw) -> LoraConfig:
    _, mts, ensure = CASES[case]
    return LoraConfig(**{"r": LORA["r"], "alpha": LORA["lora_alpha"], "target_modules": tuple(LORA["target_modules"]),
                         "modules_to_save": mts, "ensure_weight_tying": ensure, **kw})


def peft_name(name: str) -> str:
    """A PEFT parameter name as its adapter file key."""
    return name.replace(".modules_to_save.default", "").replace(".default.", ".")


def peft_model(hf, case: str, seed=0):
    """A PEFT model of `case`, every lora_B and copy moved off its initial value (else they hide bugs)."""
    _, mts, ensure = CASES[case]
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(**LORA, modules_to_save=list(mts),
                                                                 ensure_weight_tying=ensure))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if p.requires_grad and "lora_A" not in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return pm.eval()


def batch(seed=0, rows=2):
    return padded_batch(seed, 11, 8, 2, rows)


def micro_batches(ids, labels, mask, rows):
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    return [(ids[s].astype(np.int32), shift_labels(labels[s]), mask[s].astype(np.int32), pos[s].copy())
            for s in (slice(r, r + rows) for r in range(0, ids.shape[0], rows))]


# ---- PEFT's adapters here: logits, loss, gradients, generation ----------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_peft_adapter_loads_here(models, tmp_path, case, backend):
    """A PEFT-saved adapter with modules_to_save: PEFT's logits, loss, gradients of LoRA and of the copies
    (torch autograd), and greedy tokens; the tied cases keep PEFT's frozen original or shared copy."""
    if backend == "wgpu":
        require_adapter()
    arch, mts, ensure = CASES[case]
    hf, folder = models(arch)
    pm = peft_model(hf, case)
    pm.save_pretrained(tmp_path)
    ids, labels, mask = batch()
    out = pm(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    expected = {peft_name(n): p.grad.numpy() for n, p in pm.named_parameters() if p.requires_grad}
    model = wt.load_model(folder, backend=backend)
    model.load_adapter(tmp_path)
    assert model.lora_config.ensure_weight_tying == ensure   # PEFT rewrites a tied lm_head as model.embed_tokens
    assert model.engine.trained == trained_weights(arch != "llama", mts, ensure)[0]
    gpu = backend == "wgpu"
    real = mask.astype(bool)
    assert_close(model.logits(ids, mask)[real], out.logits.detach().numpy()[real], "gpu_logits" if gpu else "logits_f32")
    loss, grads = model.loss_and_grads(ids, labels, mask)
    assert_close(loss, out.loss.item(), "gpu_loss" if gpu else "loss_f32", "loss")
    copies = {k for k in expected if ".lora_" not in k}
    assert set(grads) == set(expected) and len(copies) == (1 if ensure else len(mts))
    for name, g in expected.items():
        assert np.abs(g).max() > 1e-4, name
        assert_close(grads[name], g, "gpu_grads" if gpu else "grads_f32", name)
    stored = model.engine.weights()
    original = hf.model.embed_tokens.weight.detach().numpy()
    if case == "tied_embed":        # the head computes with the original, frozen weight
        assert_close(stored[HEAD], original, "exact", "lm_head")
    if case == "tied_head":
        assert_close(stored[EMBED], original, "exact", "embedding")
    if ensure:
        assert HEAD not in stored
    with torch.no_grad():
        want = pm.generate(input_ids=torch.tensor(ids[:1, :6]), max_new_tokens=4, do_sample=False)[0, 6:].tolist()
    assert model.generate(ids[0, :6], max_new_tokens=4) == want


# ---- optimizer steps -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
@pytest.mark.parametrize("case", ["untied", "tied_embed", "tied_both", "tied_shared", "gemma_shared"])
def test_steps_match_peft_loraplus_optimizer(models, tmp_path, case, backend):
    """Two AdamW steps (LoRA+ ratio 4, weight decay, the global norm clipped over LoRA and the copies)
    against PEFT's create_loraplus_optimizer with torch AdamW on the PEFT model: PEFT puts the copies in its
    group A (the base lr), as we do; then our adapter, trained, loads in PEFT with our logits."""
    from peft.optimizers import create_loraplus_optimizer

    if backend == "wgpu":
        require_adapter()
    arch, _, _ = CASES[case]
    hf, folder = models(arch)
    model = wt.load_model(folder, backend=backend)
    model.add_lora(ours(case), seed=3)
    model.save_adapter(tmp_path / "init")
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "init", is_trainable=True)
    opt = create_loraplus_optimizer(pm, torch.optim.AdamW, lr=1e-2, loraplus_lr_ratio=4.0,
                                    loraplus_weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    params = [p for p in pm.parameters() if p.requires_grad]
    # a batch whose gradients stay well above eps (or are exactly 0: embedding rows it does not use): Adam's
    # first update, g / (|g| + eps), turns the fp32 error of a gradient of ~eps into an error of ~lr (batch(1)
    # gives Gemma an embedding gradient of 2.3e-8 that the engines compute 3e-9 apart; batch(3)'s smallest
    # nonzero gradient in these cases is 2.3e-6)
    ids, labels, mask = batch(3, rows=4)
    hp = OptimizerParams(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5, lora_b_lr_ratio=4.0)
    for step in (1, 2):
        opt.zero_grad()
        pm(torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels)).loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 0.5).item()
        opt.step()
        _, _, ours_norm, applied = model.engine.train_step(micro_batches(ids, labels, mask, 2), hp, step)
        assert applied and norm > 0.5          # clipping acted
        assert_close(np.float64(ours_norm), np.float64(norm), "gpu_loss", "grad norm")
    want = {peft_name(n): p.detach().numpy() for n, p in pm.named_parameters() if p.requires_grad}
    got = model.lora_state_dict()
    assert set(want) <= set(got)
    for k, w in want.items():
        assert_close(got[k], w, "params_vs_torch_adamw", k)
    model.save_adapter(tmp_path / "trained")
    raw = json.loads((tmp_path / "trained" / "adapter_config.json").read_text())
    assert raw["modules_to_save"] == list(CASES[case][1]) and raw["ensure_weight_tying"] == CASES[case][2]
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "trained").eval()
    real = mask.astype(bool)
    with torch.no_grad():
        theirs = loaded(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert_close(model.logits(ids, mask)[real], theirs[real], "logits_f32" if backend == "numpy" else "gpu_logits")


def test_gpu_steps_match_numpy_over_float16_embedding(models, rt):
    """QLoRA storage (NF4 base, float16 embedding): the copies start at the float16-rounded weights and train
    in float32 on the device; three accumulated, clipped LoRA+ steps on both engines agree, each GPU step one
    submission, and the device holds what the memory estimate says."""
    from wgpu_train.engines.webgpu.tensors import Matrix

    arch, folder = "qwen2", models("qwen2")[1]
    lora = ours("tied_both")
    ref = wt.load_model(folder, backend="numpy", base_dtype="nf4", embed_dtype="auto")
    gpu = wt.load_model(folder, backend="wgpu", device=str(rt.info.index), base_dtype="nf4", embed_dtype="auto")
    for m in (ref, gpu):
        m.add_lora(lora, seed=3)
    assert isinstance(gpu.engine.w[EMBED], Matrix) and isinstance(gpu.engine.w[HEAD], Matrix)   # float32
    start = ref.engine.trainable()
    for name in (EMBED, HEAD):
        assert_close(start[name], np.float16(models(arch)[0].model.embed_tokens.weight.detach().numpy()), "exact")
    ids, labels, mask = batch(2, rows=4)
    hp = OptimizerParams(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5, lora_b_lr_ratio=4.0)
    gpu.engine.steps.max_submit_s = float("inf")      # a slow (loaded, compiling) lavapipe must not split the step
    for step in (1, 2, 3):
        r = ref.engine.train_step(micro_batches(ids, labels, mask, 2), hp, step)
        g = gpu.engine.train_step(micro_batches(ids, labels, mask, 2), hp, step)
        assert step == 1 or gpu.engine.last_step["submits"] == 1      # the first one allocates the buckets
        assert_close(np.float64(g[2]), np.float64(r[2]), "gpu_loss", "grad norm")
    a, b = ref.engine.trainable(), gpu.engine.trainable()
    assert set(a) == set(b) and EMBED in a and HEAD in a
    for k in a:
        assert_close(b[k], a[k], "gpu_params_after_steps_lr1e-2", k)
    assert not np.allclose(a[EMBED], a[HEAD])          # trained apart
    est = estimate_memory(gpu.config, 2, 11, lora, "lora", "nf4", "auto", max_binding=gpu.engine.max_binding)
    assert est["weights"] == gpu.engine.base_weight_bytes


# ---- merge, resume ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["untied", "tied_embed", "tied_shared"])
def test_merge_equals_peft_merge_and_unload(models, tmp_path, case):
    """Merging writes the copies in place of their weights, as PEFT's merge_and_unload; the merged folder
    (tie_word_embeddings turned off where the head was trained or kept apart) loads in transformers with
    PEFT's logits."""
    arch, _, ensure = CASES[case]
    hf, folder = models(arch)
    pm = peft_model(hf, case, seed=2)
    pm.save_pretrained(tmp_path / "adapter")
    model = wt.load_model(folder)
    model.load_adapter(tmp_path / "adapter")
    merged = copy.deepcopy(pm).merge_and_unload()
    theirs = {k: v.detach().numpy() for k, v in merged.state_dict().items()}
    mine = model.merge_and_save(tmp_path / "merged")
    for k, v in mine.items():
        assert_close(v, theirs[k], "merged_weights" if "proj" in k else "exact", k)
    tied_now = CASES[case][0] != "llama" and ensure
    assert (HEAD in mine) == (not tied_now)
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["tie_word_embeddings"] == tied_now
    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids, _, mask = batch(3)
    real = mask.astype(bool)
    with torch.no_grad():
        want = pm(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        got = reloaded(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    assert_close(got[real], want[real], "merged_logits")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tied tiny Qwen2 with a tokenizer, and a toy dataset."""
    root = tmp_path_factory.mktemp("mts_run")
    vocab = build_tokenizer(root / "model")
    save_model(build_model("qwen2", vocab_size=vocab), root / "model")
    return root / "model", make_data_dir(root / "data")


@pytest.mark.parametrize("ensure", [False, True])
def test_resume_equals_uninterrupted(workspace, tmp_path, capsys, ensure):
    """Four steps in one run, or two then a resume from the checkpoint: the same copies, LoRA and loss (the
    copies' AdamW moments are in the checkpoint); eval and merge of the adapter on the command line."""
    model, data = workspace
    kw = dict(model=str(model), data=str(data), backend="numpy", no_progress=True, lr=1e-2, eval_generate=False,
              max_steps=4, batch_size=2, grad_accum=2, weight_decay=0.05, keep_checkpoints=0, loraplus_lr_ratio=2.0,
              modules_to_save="embed_tokens,lm_head", ensure_weight_tying=ensure)
    full = finetune(wt.TrainConfig(out=str(tmp_path / "full"), save_every=2, **kw))
    ckpt = tmp_path / "full" / "checkpoints" / "step-000002"
    moments = set(read_optimizer_names(ckpt))
    assert EMBED in moments and (HEAD in moments) == (not ensure)
    resumed = finetune(wt.TrainConfig(out=str(tmp_path / "resumed"), resume=str(ckpt), **kw))
    assert resumed["steps"] == 4
    a, b = read_adapter(tmp_path / "full")[1], read_adapter(tmp_path / "resumed")[1]
    assert a.keys() == b.keys() and "base_model.model.model.embed_tokens.weight" in a
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    assert resumed["valid_loss_after"] == full["valid_loss_after"]
    # eval and merge on the command line use the copies: the validation loss of the run, the merged model's logits
    argv = ["--model", str(model), "--adapter-path", str(tmp_path / "full"), "--backend", "numpy"]
    assert main(["eval", *argv, "--data", str(data), "--split", "valid", "--no-generate", "--json"]) == 0
    assert_close(json.loads(capsys.readouterr().out)["loss"], full["valid_loss_after"], "loss_f32", "eval")
    assert main(["merge", *argv[:4], "--out", str(tmp_path / "merged")]) == 0
    merged = wt.load_model(tmp_path / "merged")
    assert merged.config.tie_word_embeddings == ensure
    trained = wt.load_model(model)
    trained.load_adapter(tmp_path / "full")
    ids, _, mask = batch(5)
    assert_close(merged.logits(ids, mask), trained.logits(ids, mask), "merged_logits")
    changes = wt.TrainConfig(out=str(tmp_path / "other"), resume=str(ckpt), **{**kw, "modules_to_save": "lm_head"})
    with pytest.raises(ConfigError, match="modules_to_save"):
        finetune(changes)


def read_optimizer_names(ckpt):
    from wgpu_train.training.checkpoint import OPTIMIZER_FILE, read_optimizer_state

    return read_optimizer_state(ckpt / OPTIMIZER_FILE).keys()


# ---- counts, memory, bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["untied", "tied_embed", "tied_both", "tied_shared"])
def test_count_and_memory_follow_the_copies(models, case):
    """count_trainable counts the copies; the memory estimate's weights are what the WebGPU engine allocates
    (copies in float32 over a float16 embedding, an untied head), its trainable state adds the copies'
    gradients and two moments."""
    from wgpu_train.engines.webgpu.tensors import weight_buffers

    require_adapter()
    arch, mts, ensure = CASES[case]
    _, folder = models(arch)
    model = wt.load_model(folder, backend="wgpu", base_dtype="nf4")      # embedding float16
    model.add_lora(ours(case))
    engine = model.engine
    assert count_trainable(model.config, ours(case)) == sum(v.size for v in engine.trainable().values())
    assert len(engine.trained) == (1 if ensure else len(mts))
    args = (model.config, 2, 16)
    est = estimate_memory(*args, ours(case), "lora", "nf4", max_binding=engine.max_binding)
    plain = estimate_memory(*args, ours(case, modules_to_save=()), "lora", "nf4", max_binding=engine.max_binding)
    assert est["weights"] == engine.base_weight_bytes > plain["weights"]
    copies = sum(b.size for n in engine.trained for b in weight_buffers(engine.w[n]))
    assert est["trainable_state"] - plain["trainable_state"] == 3 * copies


def test_bad_modules_to_save(models, tmp_path, capsys):
    """Other modules, method full, or a PEFT adapter saving another module: one line, exit code 2."""
    with pytest.raises(ConfigError, match="only embed_tokens and lm_head"):
        LoraConfig(modules_to_save=("embed_tokens", "norm"))
    assert LoraConfig(modules_to_save=["lm_head", "model.embed_tokens"]).modules_to_save == ("embed_tokens",
                                                                                          "lm_head")
    _, folder = models("llama")
    capsys.readouterr()          # transformers' progress bar of saving the model
    for argv, match in ((["finetune", "--model", str(folder), "--modules-to-save", "score"],
                         "modules_to_save 'score' is not supported: only embed_tokens and lm_head"),
                        (["finetune", "--model", str(folder), "--method", "full", "--modules-to-save", "lm_head"],
                         "method lora"),
                        (["memory", "--model", str(folder), "--modules-to-save", "classifier"], "only embed_tokens")):
        one_line_error(capsys, argv, match)
    assert main(["memory", "--model", str(folder), "--modules-to-save", "embed_tokens,lm_head", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    model = wt.load_model(folder)
    assert shown["total"] == estimate_memory(model.config, 4, 128, ours("untied", r=8, alpha=16), "lora")["total"]
    model.add_lora(ours("untied"))
    model.save_adapter(tmp_path / "a")
    raw = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**raw, "modules_to_save": ["classifier"]}))
    with pytest.raises(AdapterError, match="modules_to_save 'classifier' is not supported"):
        read_adapter(tmp_path / "a")
    one_line_error(capsys, ["merge", "--model", str(folder), "--adapter-path", str(tmp_path / "a"), "--out",
                            str(tmp_path / "merged")], "modules_to_save 'classifier' is not supported")


@pytest.mark.parametrize("case", ["untied", "tied_embed"])
def test_a_new_adapter_gets_the_original_weights_back(models, case):
    """Trained copies replace their weights only while their adapter is attached: a plain LoRA attached after
    them computes with the original embedding and head again (a tied model's head tied again)."""
    arch, _, _ = CASES[case]
    hf, folder = models(arch)
    model = wt.load_model(folder)
    before = {k: np.array(v) for k, v in model.engine.weights().items()}
    model.add_lora(ours(case))
    ids, labels, mask = batch(4)
    model.engine.train_step(micro_batches(ids, labels, mask, 2), OptimizerParams(lr=1e-1), 1)
    assert not np.array_equal(model.engine.weights()[EMBED], before[EMBED])
    model.add_lora(ours(case, modules_to_save=()))
    after = model.engine.weights()
    assert set(after) == set(before) and model.engine.trained == ()
    for k in before:
        assert_close(after[k], before[k], "exact", k)
