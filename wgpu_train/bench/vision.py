"""`bench --only vision`: Gemma 3's vision tower per image, frozen and with LoRA on it (forward + backward): the
NumPy tower on the CPU, and on the bench's adapter the WebGPU tower; against the language model's LoRA step on the
same batch (its images' tokens in it), on the NumPy engine and, where the WebGPU engine takes images (set_images),
on the bench's adapter; as ratios measured in one run, each path checked before it is timed."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.bench.training import random_weights
from wgpu_train.data.batching import Example
from wgpu_train.data.images import ImageSettings
from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.engines.loading import model_from_weights
from wgpu_train.engines.numpy.vision_tower import VisionTower
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.engines.vision_model import VisionModel
from wgpu_train.engines.webgpu.vision_tower import GpuVisionTower
from wgpu_train.models.config import ModelConfig
from wgpu_train.models.vision import VisionConfig, tensor_shapes

RANK = 16
# the tower's float32 embeddings against its float64 forward (the reference), and the first step's loss of the
# WebGPU engine against the NumPy engine's on the same weights and batch (float32 both; the loss sums ~ 10^2 terms)
TOWER_REL_TOL = 1e-4
LOSS_REL_TOL = 1e-4


@dataclasses.dataclass(frozen=True)
class VisionBenchShape:
    """A Gemma-3-vision-shaped model and its batch: the SigLIP tower (hidden, intermediate, layers, heads, image
    and patch size), the tokens an image pools to, the Gemma 3 text model (hidden, intermediate, layers, heads, kv
    heads, head_dim, vocabulary), and `rows` rows of `row_tokens` tokens, one image each."""

    tower_hidden: int
    tower_intermediate: int
    tower_layers: int
    tower_heads: int
    image_size: int
    patch_size: int
    mm_tokens: int
    text_hidden: int
    text_intermediate: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    head_dim: int
    vocab: int
    rows: int
    row_tokens: int

    def raw_config(self) -> dict:
        """The Gemma3ForConditionalGeneration config.json of this shape (image ids the vocabulary's last three)."""
        text = dict(hidden_size=self.text_hidden, intermediate_size=self.text_intermediate,
                    num_hidden_layers=self.text_layers, num_attention_heads=self.text_heads,
                    num_key_value_heads=self.text_kv_heads, head_dim=self.head_dim, vocab_size=self.vocab,
                    query_pre_attn_scalar=self.head_dim, max_position_embeddings=4 * self.row_tokens)
        vision = dict(hidden_size=self.tower_hidden, intermediate_size=self.tower_intermediate,
                      num_hidden_layers=self.tower_layers, num_attention_heads=self.tower_heads,
                      image_size=self.image_size, patch_size=self.patch_size)
        return {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": text, "vision_config": vision,
                "mm_tokens_per_image": self.mm_tokens, "boi_token_index": self.vocab - 3,
                "eoi_token_index": self.vocab - 2, "image_token_index": self.vocab - 1}

    def describe(self) -> str:
        p = self.image_size // self.patch_size
        return (f"tower {self.tower_layers} x {self.tower_hidden} (intermediate {self.tower_intermediate}, "
                f"{self.tower_heads} heads), {self.image_size} px / {self.patch_size} px patches ({p * p} patches "
                f"pooled to {self.mm_tokens} tokens); Gemma 3 text {self.text_layers} x {self.text_hidden} "
                f"(intermediate {self.text_intermediate}, {self.text_heads}/{self.text_kv_heads} heads of "
                f"{self.head_dim}, vocabulary {self.vocab}); {self.rows} rows x {self.row_tokens} tokens, one image "
                f"a row; LoRA r={RANK} on the LM's q/k/v/o, and on every tower encoder linear for its backward")


# SigLIP's patch and image size at 224 px (a 16 x 16 grid pooled 4 x 4, as Gemma 3's 64 x 64 grid pools to 256
# tokens), a sixth of SigLIP-so400m's width (3 heads of 64) in 4 of its 27 layers; a Gemma 3 text model at twice
# the tower's hidden (gemma-3-4b: 2560 over 1152); each row mostly its image's tokens, as Gemma 3's rows are (256
# of ~350). Sized for a 2-core machine: a round of the three parts takes seconds there.
DEFAULT_SHAPE = VisionBenchShape(tower_hidden=192, tower_intermediate=768, tower_layers=4, tower_heads=3,
                                 image_size=224, patch_size=14, mm_tokens=16, text_hidden=384,
                                 text_intermediate=1536, text_layers=4, text_heads=6, text_kv_heads=2, head_dim=64,
                                 vocab=2048, rows=4, row_tokens=32)


def _examples(shape: VisionBenchShape, vc: VisionConfig, rng) -> list[Example]:
    """rows records: a few prompt tokens, boi, the image's tokens, eoi, then the answer (trained); random pixels."""
    out = []
    for _ in range(shape.rows):
        head = rng.integers(0, shape.vocab - 3, 3)
        tail = rng.integers(0, shape.vocab - 3, shape.row_tokens - 5 - shape.mm_tokens)
        ids = np.concatenate([head, [vc.boi_token_id], np.full(shape.mm_tokens, vc.image_token_id),
                              [vc.eoi_token_id], tail]).astype(np.int64)
        labels = np.full_like(ids, IGNORE_INDEX)
        labels[-len(tail):] = tail
        pixels = rng.standard_normal((vc.num_channels, vc.image_size, vc.image_size)).astype(np.float32)
        out.append(Example(ids, labels, images=[pixels]))
    return out


def _vision_model(cfg, vc, weights, tower_weights, backend: str, device=None, device_tower=None) -> VisionModel:
    model = model_from_weights(cfg, weights, backend, device, precision="fp32")
    model.add_lora(LoraConfig(r=RANK, alpha=2 * RANK, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), seed=0)
    return VisionModel(model, VisionTower(vc, tower_weights), vc, ImageSettings(vc.image_size, vc.image_size),
                       device_tower)


def _check_tower(vc, tower_weights, pixels, tower=None, what="float32 tower"):
    """A frozen tower's float32 embeddings (the NumPy one's, or `tower`'s) against the float64 forward: an
    AssertionError past TOWER_REL_TOL."""
    got = (tower or VisionTower(vc, tower_weights))(pixels)
    want = VisionTower(vc, tower_weights, np.float64)(pixels.astype(np.float64))
    err = float(np.abs(got - want).max() / np.abs(want).max())
    if not err < TOWER_REL_TOL:
        raise AssertionError(f"vision bench: the {what} is {err:.2e} from its float64 forward")
    return err


def _check_grads(want: dict, got: dict):
    """The WebGPU tower's LoRA gradients against the NumPy tower's (float32 both), each tensor in units of its
    largest element: an AssertionError past TOWER_REL_TOL."""
    err = max(float(np.abs(got[k] - g).max() / np.abs(g).max()) for k, g in want.items())
    if set(got) != set(want) or not err < TOWER_REL_TOL:
        raise AssertionError(f"vision bench: the WebGPU tower's LoRA gradients are {err:.2e} from the NumPy tower's")


def bench_vision(rt, shape: VisionBenchShape = DEFAULT_SHAPE, rounds: int = 3) -> dict:
    """Milliseconds per image of the tower's frozen forward (the NumPy tower one image at a time, as training runs
    it; on rt's adapter the WebGPU tower over the batch's images, its row's) and of its forward + backward with
    LoRA r=16 on every encoder linear (the batch's images at once; the embeddings' gradient random; the WebGPU
    tower's in its row, its gradients checked against NumPy's), and of the language model's LoRA step on the same
    rows (the frozen tower's embeddings in place of the image tokens; the images per step divide the step), on each engine: the NumPy engine, and rt's
    adapter where the WebGPU engine has set_images (rt None: the NumPy engine alone). Every part runs once
    (warm-up, and the checks: the tower against float64, the WebGPU step's loss against the NumPy engine's),
    then `rounds` times in turn; medians. "tower_forward_vs_lm_step" and "tower_forward_backward_vs_lm_step":
    the tower's time per image over the step's time per image on that engine (over 1: the tower costs more than
    the language model's step on its image's row); "webgpu_tower_vs_numpy_tower": the WebGPU tower's time over
    the NumPy tower's (each checked against the float64 forward first)."""
    from wgpu_train.engines.webgpu.engine import WgpuEngine

    raw = shape.raw_config()
    cfg, vc = ModelConfig.from_dict(raw, "bench vision model"), VisionConfig.from_config(raw, "bench vision model")
    rng = np.random.default_rng(0)
    weights = random_weights(cfg, rng)
    tower_weights = {k: (rng.standard_normal(s) * 0.02).astype(np.float32) for k, s in tensor_shapes(vc).items()}
    for k in tower_weights:     # the norms' weights at one, as a trained tower's are near (not ~0.02)
        if k.endswith(("norm1.weight", "norm2.weight", "post_layernorm.weight", "mm_soft_emb_norm.weight")):
            tower_weights[k][:] = 1.0
    examples = _examples(shape, vc, rng)
    pixels = np.stack([e.images[0] for e in examples])                            # (N, C, H, W)
    n = len(pixels)
    tower_err = _check_tower(vc, tower_weights, pixels)

    lora_tower = VisionTower(vc, tower_weights)
    for path in lora_tower.modules():           # A (r, in), B (out, r), scale alpha / r = 2
        out_f, in_f = lora_tower.w[path + ".weight"].shape
        lora_tower.lora[path] = (rng.uniform(-0.1, 0.1, (RANK, in_f)).astype(np.float32),
                                 (rng.standard_normal((out_f, RANK)) * 0.02).astype(np.float32), 2.0)
    dout = rng.standard_normal((n, vc.mm_tokens_per_image, vc.text_hidden_size)).astype(np.float32)

    engines = {"numpy": _vision_model(cfg, vc, weights, tower_weights, "numpy")}
    device_tower = device_err = lora_device = None
    if rt is not None and hasattr(WgpuEngine, "set_images"):
        device_tower = GpuVisionTower(rt, vc, tower_weights)
        lora_device = GpuVisionTower(rt, vc, tower_weights)     # its LoRA's: the step's tower stays frozen
        device_err = _check_tower(vc, tower_weights, pixels, device_tower, "WebGPU tower")
        engines[rt.info.describe()] = _vision_model(cfg, vc, weights, tower_weights, "wgpu", str(rt.info.index),
                                                    device_tower)
    hp = OptimizerParams(lr=1e-4, max_grad_norm=1.0)
    losses = {}
    device_grads: list = []

    def lm_step(name, i):
        loss, count, _, _ = engines[name].train_step([examples], hp, i + 1)
        losses.setdefault(name, loss / count)

    frozen = VisionTower(vc, tower_weights)
    parts = {"tower_forward": lambda i: frozen(pixels),
             "tower_forward_backward": lambda i: lora_tower.backward(dout, lora_tower.forward(pixels)[1]),
             **({"device_tower_forward": lambda i: device_tower(pixels),
                 "device_tower_forward_backward": lambda i: device_grads.append(lora_device.backward(
                     dout, lora_device.forward(pixels, lora_tower.lora)[1]))} if device_tower is not None else {}),
             **{("lm_step", name): (lambda i, name=name: lm_step(name, i)) for name in engines}}
    walls: dict = {k: [] for k in parts}
    for i in range(rounds + 1):                 # round 0: the warm-up (pipelines, the frozen embeddings, checks)
        for key, fn in parts.items():
            t0 = time.perf_counter()
            fn(i)
            if i:
                walls[key].append(time.perf_counter() - t0)
        if i == 0:
            if device_grads:
                _check_grads(lora_tower.backward(dout, lora_tower.forward(pixels)[1]), device_grads[0])
            for name, loss in losses.items():
                err = abs(loss - losses["numpy"]) / abs(losses["numpy"])
                if not err < LOSS_REL_TOL:
                    raise AssertionError(f"vision bench: the {name} step's loss {loss:.6f} is {err:.2e} from "
                                         f"the NumPy engine's {losses['numpy']:.6f}")
    ms = {k: 1e3 * float(np.median(w)) for k, w in walls.items()}
    rows = []
    for name in engines:
        step = ms[("lm_step", name)]
        tower = "numpy" if name == "numpy" else "webgpu"
        fwd = ms["tower_forward" if name == "numpy" else "device_tower_forward"] / n
        fwd_bwd = ms["tower_forward_backward" if name == "numpy" else "device_tower_forward_backward"] / n
        rows.append({"engine": name, "tower": tower, "tower_forward_ms_per_image": fwd,
                     "tower_forward_backward_ms_per_image": fwd_bwd,
                     "lm_step_ms": step, "lm_step_ms_per_image": step / n,
                     "tower_forward_vs_lm_step": fwd / (step / n),
                     "tower_forward_backward_vs_lm_step": fwd_bwd / (step / n),
                     "first_loss": losses[name]})
    return {"model": shape.describe(), "images_per_step": n, "tokens_per_step": shape.rows * shape.row_tokens,
            "rounds": rounds, "tower_max_rel_err_vs_float64": tower_err,
            **({"webgpu_tower_max_rel_err_vs_float64": device_err,
                "webgpu_tower_vs_numpy_tower": ms["device_tower_forward"] / ms["tower_forward"],
                "webgpu_tower_forward_backward_vs_numpy": (ms["device_tower_forward_backward"]
                                                           / ms["tower_forward_backward"])}
               if device_tower is not None else {}),
            "webgpu": "timed" if len(engines) > 1 else ("no adapter" if rt is None else
                                                          "the WebGPU engine has no set_images yet"),
            "rows": rows}
