"""VisionModel: a vision-language model users hold (Gemma 3, SmolVLM / Idefics3, Qwen3-VL, Qwen3.5), the language
model's `Model` beside the vision tower and projector (frozen, or with LoRA on SigLIP's encoder or on Qwen's blocks and
mergers): logits, loss and LoRA gradients, train steps, PEFT adapter files and greedy generation of token streams
whose image placeholders take the images' embeddings (Qwen3-VL's and Qwen3.5's with their M-RoPE positions, Qwen3-VL's
DeepStack features). The language model runs on either engine (both have set_images); the tower (SigLIP's or Qwen's)
inside the engine's train_step (TowerImages: on the device beside WebGPU, webgpu/vision_tower.py or
qwen_vision_tower.py, its LoRA's backward too), else on the CPU (NumPy): around the engine's passes where the engine
does not run it (a host tower beside WebGPU, pipeline stages). (Over 450 lines: the multimodal model's whole surface,
both tower families.)"""
from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from wgpu_train.data.image_tiles import TiledImageSpan, TileSettings
from wgpu_train.data.images import ImageSettings
from wgpu_train.data.lfm2_images import Lfm2ImageSettings
from wgpu_train.data.qwen_images import QwenImageSettings
from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.data.batching import Batch, collate
from wgpu_train.data.vision_records import ImageSpan, image_span
from wgpu_train.engines.loading import load_model
from wgpu_train.engines.model import Model
from wgpu_train.engines.numpy.optim import Optimizer, grad_norm
from wgpu_train.engines.numpy.qwen3_vl_tower import Qwen3VLTower
from wgpu_train.engines.numpy.siglip2_tower import Siglip2Tower
from wgpu_train.engines.numpy.vision_tower import VisionTower
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.engines.shared.image_tokens import ImageTokens, TowerImages
from wgpu_train.engines.shared.labels import shift_labels
from wgpu_train.engines.webgpu import qwen_vision_tower
from wgpu_train.engines.webgpu.qwen_vision_tower import GpuQwenTower
from wgpu_train.engines.webgpu import siglip2_tower
from wgpu_train.engines.webgpu.siglip2_tower import GpuSiglip2Tower
from wgpu_train.engines.webgpu.vision_tower import GpuVisionTower, runs_on_device
from wgpu_train.errors import ConfigError, DataError
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.adapters.files import write_adapter
from wgpu_train.adapters.inits import converted
from wgpu_train.adapters.tower_scales import tower_scales
from wgpu_train.formats.safetensors import read_safetensors, safetensors_names, write_safetensors
from wgpu_train.models.lfm2_vl import Lfm2VlVision, check_lfm2_vl_tensors, lfm2_vl_names
from wgpu_train.models.qwen3_vl import (Qwen3VLVision, check_visual_tensors, frame_grids, pair_positions, rope_index,
                                       visual_names)
from wgpu_train.models.vision import (VisionConfig, check_vision_tensors, image_blocks, tower_lora_key,
                                      tower_lora_path, tower_target_regex, vision_names)
from wgpu_train.models.weights import weight_files


class VisionModel:
    """model: the language model (a `Model`, LoRA and adapters as for text); tower: the vision tower and projector
    (engines/numpy/vision_tower.VisionTower); vision: their config; settings: the image preprocessing (Gemma 3's
    ImageSettings, SmolVLM's TileSettings: each image its tiles, each tile mm_tokens_per_image tokens; Qwen3-VL's
    QwenImageSettings: each image its merged patches); device_tower: the same tower on the WebGPU engine
    (webgpu/vision_tower.GpuVisionTower; Qwen's webgpu/qwen_vision_tower.GpuQwenTower; LFM2-VL's
    webgpu/siglip2_tower.GpuSiglip2Tower), which runs it (with the tower's LoRA and its backward too), or None.
    Qwen3-VL's and Qwen3.5's (a models/qwen3_vl.Qwen3VLVision, its tower an engines/numpy/qwen3_vl_tower.Qwen3VLTower)
    ImageTokens carry the M-RoPE positions and Qwen3-VL's DeepStack features, which both engines take."""

    def __init__(self, model: Model, tower, vision, settings, device_tower=None):
        if not hasattr(model.engine, "set_images"):
            raise ConfigError(f"images do not run on the {model.backend} engine (no set_images); use backend='numpy'")
        self.qwen = isinstance(vision, Qwen3VLVision)
        self.lfm2 = isinstance(vision, Lfm2VlVision)     # LFM2-VL's SigLIP2 tower: tiles of their own sizes
        self.model, self.tower, self.vision, self.settings = model, tower, vision, settings
        self.device_tower = device_tower
        self.tower_optimizer = None     # the tower's LoRA's AdamW where the engine does not run the tower
        self.tower_init: dict = {}      # PiSSA / OLoRA on the tower: path -> (A0, B0) (set_tower_residual)
        # the tower inside the engine's train_step (TowerImages): the device's beside a WebGPU engine, the NumPy
        # one beside the NumPy engine; else (LFM2-VL's tower, a host tower beside WebGPU, pipeline stages) the
        # tower runs here, and train_step steps its LoRA around the engine's passes
        engine = model.engine
        self.in_step = (not self.lfm2 and hasattr(engine, "set_vision_tower")
                        and (device_tower is not None or getattr(engine, "name", "") == "numpy"))
        if self.in_step:
            engine.set_vision_tower(device_tower if device_tower is not None else tower)

    def pixel_values(self, images, where: str = "record"):
        """Images (paths, bytes, PIL images, or pixel_values (N, C, H, W) or a list of (C, H, W) already) ->
        (N, C, H, W) float32: N the images, or SmolVLM's tiles of them all. Qwen3-VL's: (pixel_values (patches,
        patch dim), image_grid_thw (N, 3)), as its processor gives them (such a pair passes through)."""
        if self.qwen or self.lfm2:      # LFM2-VL's: (pixel_values, pixel_attention_mask, spatial_shapes)
            if isinstance(images, tuple) and len(images) == 2 + self.lfm2 and all(isinstance(a, np.ndarray)
                                                                                  for a in images):
                return images
            return self.settings.batch(list(images), where)
        if isinstance(images, np.ndarray):
            return images.astype(np.float32)
        if images and all(isinstance(im, np.ndarray) and im.ndim == 3 for im in images):
            return np.stack(images).astype(np.float32)
        return self.settings.batch(list(images), where)

    def image_span(self, tokenizer) -> ImageSpan | TiledImageSpan:
        """How an image's placeholder is expanded in `tokenizer`'s text (data/vision_records' span protocol)."""
        return image_span(tokenizer, self.vision, self.settings)

    def set_tower_lora(self, tensors: dict, scale):
        """LoRA on the tower's encoder (Qwen's: its blocks and mergers) from a PEFT adapter's tensors ({key: array};
        keys outside the tower are left to the language model's adapter), each module's output scaled by `scale`
        (alpha / r; or {module path: scale}, adapters/tower_scales)."""
        pairs: dict = {}
        for key, value in tensors.items():
            path = tower_lora_path(key)
            if path is not None:
                pairs.setdefault(path, {})["A" if ".lora_A" in key else "B"] = np.asarray(value, self.tower.dtype)
        unknown = sorted(set(pairs) - set(self.tower.modules()))
        if unknown:
            raise ConfigError(f"LoRA on {unknown[0]}: not a linear module of the vision tower's "
                              f"{'blocks or mergers' if self.qwen else 'encoder'}")
        half = next((p for p, ab in pairs.items() if len(ab) != 2), None)
        if half is not None:
            raise ConfigError(f"LoRA on {half}: the adapter has only its lora_{next(iter(pairs[half]))}")
        self.tower.lora = {p: (ab["A"], ab["B"], float(scale[p] if isinstance(scale, dict) else scale))
                           for p, ab in pairs.items()}
        if self.in_step:        # the engine's optimizer takes the tower's LoRA (zeroed moments)
            if self.device_tower is not None:
                self.device_tower.set_lora(self.tower.lora)
            self.model.engine.set_vision_tower(self.device_tower if self.device_tower is not None else self.tower)
        else:
            self.tower_optimizer = Optimizer(self._host_lora, self.tower.dtype, {"nonfinite_skipped": 0})

    def set_tower_residual(self, residual: dict, init_pairs: dict):
        """PiSSA / OLoRA on the tower: each module's base weight replaced by its residual ({path: (out, in)}), and
        the pairs it was drawn with ({path: (A0, B0)}), which save_adapter converts the trained ones against (as
        PEFT's path_initial_model_for_weight_conversion: rank 2r on the original base)."""
        for path, w in residual.items():
            self.tower.w[path + ".weight"] = np.asarray(w, self.tower.dtype)
            if self.device_tower is not None:
                self.device_tower.set_base(path, w)
        self.tower_init = {p: (a.copy(), b.copy()) for p, (a, b) in init_pairs.items()}

    def _host_lora(self) -> dict:
        return {f"{p}.lora_{w}": t for p, (a, b, _) in self.tower.lora.items() for w, t in (("A", a), ("B", b))}

    def tower_trainable(self) -> dict:
        """The tower's LoRA tensors by name (path.lora_A / .lora_B): the NumPy tower's arrays, which the device
        tower's (where it trains them) are read back into first."""
        if self.device_tower is not None and self.in_step and self.tower.lora:
            live = self._host_lora()
            for name, arr in self.device_tower.lora_arrays().items():
                live[name][...] = arr
        return self._host_lora()

    def set_tower_trainable(self, arrays: dict):
        """The tower's LoRA tensors by name (tower_trainable's) written over the live ones."""
        live = self._host_lora()
        for name, arr in arrays.items():
            live[name][...] = arr
        if self.device_tower is not None and self.in_step:
            self.device_tower.write_lora(arrays)

    def tower_optimizer_state(self) -> dict:
        """The tower's LoRA AdamW moments by name: (m, v), the engine's where it trains the tower."""
        return self.model.engine.tower_optimizer_state() if self.in_step else self.tower_optimizer.state()

    def load_tower_optimizer_state(self, state: dict):
        if self.in_step:
            self.model.engine.load_tower_optimizer_state(state)
        else:
            self.tower_optimizer.load_state(state)

    def save_adapter(self, directory):
        """The adapter in PEFT's format on the multimodal model: the language model's (Model.save_adapter) and the
        tower's LoRA beside it, target_modules one regular expression over both. Where the language model has LoRA
        too, each tower module's rank and scale must be those its config (r, alpha, rsLoRA, rank_pattern /
        alpha_pattern) gives the module (one config holds both); alone, one rank and scale.""" 
        directory = Path(directory)
        if not self.tower.lora:
            return self.model.save_adapter(directory)
        cfg = self.model.lora_config
        if cfg is None:     # the tower's alone: a config of its rank and alpha, no language tensors
            shapes = {(a.shape[0], s) for a, _, s in self.tower.lora.values()}
            if len(shapes) > 1:
                raise ConfigError("the tower's LoRA modules differ in rank or scale: without the language model's "
                                  "LoRA (and its patterns), one adapter file holds one of each")
            (a, scale), = shapes
            write_adapter(directory, LoraConfig(r=a, alpha=scale * a, target_modules=("q_proj",)), {},
                          base_model=self.model.name_or_path, model=self.model.config)
        else:
            self.model.save_adapter(directory)
            self._check_tower_config(json.loads((directory / "adapter_config.json").read_text()))
        raw = json.loads((directory / "adapter_config.json").read_text())
        tower = tower_target_regex(self.tower.lora, self.vision)
        raw["target_modules"] = tower if cfg is None else f"(?:{raw['target_modules']}|{tower})"
        (directory / "adapter_config.json").write_text(json.dumps(raw, indent=2))
        tensors = read_safetensors(directory / "adapter_model.safetensors") if cfg is not None else {}
        live = self.tower_trainable()
        for path in self.tower.lora:
            a, b = live[path + ".lora_A"], live[path + ".lora_B"]
            if path in self.tower_init:
                a, b = converted(a, b, *self.tower_init[path])
            tensors[tower_lora_key(path, "A", self.vision)], tensors[tower_lora_key(path, "B", self.vision)] = a, b
        write_safetensors(directory / "adapter_model.safetensors", tensors, metadata={"format": "pt"})

    def _check_tower_config(self, raw: dict):
        """Each tower module's rank and scale, as the adapter config `raw` gives them (its r, alpha, rsLoRA and
        patterns), refused in one line where they differ from the tower's (one config holds both models')."""
        want = tower_scales(self.tower.lora, self.vision, raw["r"], raw["lora_alpha"], raw.get("use_rslora", False),
                            raw.get("rank_pattern"), raw.get("alpha_pattern"))
        for path, (a, _, scale) in self.tower.lora.items():
            r = a.shape[0] * (2 if path in self.tower_init else 1)      # converted on save: rank 2r
            if want[path][0] != r or abs(want[path][1] - scale) > 1e-12:
                raise ConfigError(f"the tower's LoRA on {path} (r {r}, scale {scale:g}) differs from the "
                                  f"adapter config's (r {want[path][0]}, scale {want[path][1]:g}): one config holds "
                                  f"both models' ranks and alphas")

    def load_adapter(self, directory):
        """A PEFT adapter of the multimodal model: the tower's LoRA (set_tower_lora, at the config's alpha / r)
        and the language model's (Model.load_adapter), either alone."""
        directory = Path(directory)
        tensors = read_safetensors(directory / "adapter_model.safetensors")
        tower = self.load_tower_adapter(directory)
        if len(tower) < len(tensors):
            with tempfile.TemporaryDirectory() as tmp:
                shutil.copy(directory / "adapter_config.json", tmp)
                write_safetensors(Path(tmp) / "adapter_model.safetensors",
                                  {k: v for k, v in tensors.items() if k not in tower}, metadata={"format": "pt"})
                self.model.load_adapter(tmp)

    def load_tower_adapter(self, directory) -> dict:
        """The tower's LoRA of the PEFT adapter in `directory` set (set_tower_lora, at the config's alpha / r, or
        alpha / sqrt(r) with use_rslora, per module under its rank_pattern / alpha_pattern); its tensors by key
        returned (none: the adapter has no LoRA on the tower, and nothing is set)."""
        directory = Path(directory)
        tensors = read_safetensors(directory / "adapter_model.safetensors")
        tower = {k: v for k, v in tensors.items() if tower_lora_path(k) is not None}
        if tower:
            raw = json.loads((directory / "adapter_config.json").read_text())
            paths = {tower_lora_path(k) for k in tower}
            scales = tower_scales(paths, self.vision, raw["r"], raw["lora_alpha"], raw.get("use_rslora", False),
                                  raw.get("rank_pattern"), raw.get("alpha_pattern"))
            self.set_tower_lora(tower, {p: s for p, (_, s) in scales.items()})
            self._check_tower_config(raw)
        return tower

    def image_tokens(self, ids, images, cache: dict | None = None, segments=None) -> ImageTokens | None:
        """The ImageTokens of a batch ids (B, T) and its images, in order of their placeholders' runs; a count of
        placeholders that is not the images' times mm_tokens_per_image refused in one line. cache, when given,
        keeps the tower's forward for its backward; segments (B, T), Qwen3-VL's M-RoPE positions count each from 0
        (mrope_positions)."""
        if self.qwen:
            return self._qwen_image_tokens(ids, images, segments, cache)
        if self.lfm2:
            return self._lfm2_image_tokens(ids, images, cache)
        m = self.vision.mm_tokens_per_image
        pixels = self.pixel_values(images) if images is not None and len(images) else np.zeros((0,), np.float32)
        n_images = len(pixels)
        blocks = image_blocks(ids, self.vision.image_token_id, self.vision.bidirectional)
        n_tokens = int((blocks >= 0).sum())
        if n_tokens != n_images * m:
            what = "image tiles" if self.vision.scale_factor else "images"
            raise DataError(f"{n_tokens} image placeholder tokens for {n_images} {what} of {m} tokens each")
        if not n_images:
            return None
        if self.device_tower is not None and self.tower.lora:   # the LoRA forward, its backward's cache kept
            embeds, tower_cache = self.device_tower.forward(pixels)                       # (N, M, C)
            if cache is not None:
                cache.update(tower_cache)
        elif self.device_tower is not None:
            embeds = self.device_tower(pixels)
        elif self.tower.lora and cache is not None:       # the tower's backward follows: keep its activations
            embeds, tower_cache = self.tower.forward(pixels)
            cache.update(tower_cache)
        else:
            embeds = self.tower(pixels)
        return ImageTokens(blocks, embeds.reshape(-1, self.vision.text_hidden_size))

    def tower_images(self, ids, images, segments=None) -> TowerImages | None:
        """The TowerImages of a batch ids (B, T) and its images (image_tokens' count check), or None; segments as
        image_tokens' (Qwen's M-RoPE positions)."""
        if self.qwen:
            return self._qwen_tower_images(ids, images, segments)
        m = self.vision.mm_tokens_per_image
        pixels = self.pixel_values(images) if images is not None and len(images) else np.zeros((0,), np.float32)
        blocks = image_blocks(ids, self.vision.image_token_id, self.vision.bidirectional)
        n_tokens = int((blocks >= 0).sum())
        if n_tokens != len(pixels) * m:
            what = "image tiles" if self.vision.scale_factor else "images"
            raise DataError(f"{n_tokens} image placeholder tokens for {len(pixels)} {what} of {m} tokens each")
        if not len(pixels):
            return None
        return TowerImages(blocks, pixels, functools.partial(self._host_tokens, ids, pixels), bool(self.tower.lora))

    def _qwen_tower_images(self, ids, images, segments) -> TowerImages | None:
        """Qwen's TowerImages of ids (B, T) and its images and videos (as _qwen_image_tokens takes them): the
        patches and grids, the M-RoPE positions, the DeepStack features' count."""
        pixels, grids, blocks = self._qwen_visual(ids, images)
        if not len(grids):
            return None
        positions = pair_positions(self.mrope_positions(ids, grids, segments)[0], self.vision.mrope_section)
        return TowerImages(blocks, np.asarray(pixels, np.float32),
                           functools.partial(self._host_tokens, ids, (pixels, grids), segments), bool(self.tower.lora),
                           np.asarray(grids), positions, len(self.vision.deepstack_indexes))

    def _host_tokens(self, ids, pixels, segments=None) -> ImageTokens:
        """TowerImages' host(): their ImageTokens, the tower's LoRA off while the language model's adapter is
        (PEFT's disable_adapter switches both off: a reference's forward)."""
        if getattr(self.model.engine, "adapter_enabled", True) or not self.tower.lora:
            return self.image_tokens(ids, pixels, segments=segments)
        if self.qwen:       # the device tower runs without LoRA while the NumPy tower's is empty
            lora, self.tower.lora = self.tower.lora, {}
            try:
                return self.image_tokens(ids, pixels, segments=segments)
            finally:
                self.tower.lora = lora
        blocks = image_blocks(ids, self.vision.image_token_id, self.vision.bidirectional)
        lora, self.tower.lora = self.tower.lora, {}
        try:
            embeds = self.device_tower(pixels, lora=False) if self.device_tower is not None else self.tower(pixels)
        finally:
            self.tower.lora = lora
        return ImageTokens(blocks, embeds.reshape(-1, self.vision.text_hidden_size))

    def _qwen_image_tokens(self, ids, images, segments=None, cache: dict | None = None) -> ImageTokens | None:
        """Qwen3-VL's ImageTokens of ids (B, T) and its images and videos (data/qwen_videos.Video, in the order of
        their placeholders): the merged patches' embeddings, the DeepStack features, and every token's M-RoPE
        positions (each segment of `segments` (B, T), 0 padding, counted from
        0; the whole row without them); cache as image_tokens'."""
        ids = np.atleast_2d(np.asarray(ids))
        pixels, grids, blocks = self._qwen_visual(ids, images)
        if not len(grids):
            return None
        if self.tower.lora and cache is not None:       # the tower's backward follows: keep its activations
            embeds, deepstack, tower_cache = (self.device_tower or self.tower).forward(pixels, grids)
            cache.update(tower_cache)
        elif self.device_tower is not None:             # with the tower's LoRA, where set
            embeds, deepstack = self.device_tower(pixels, grids)
        else:
            embeds, deepstack = self.tower(pixels, grids)
        return ImageTokens(blocks, embeds, pair_positions(self.mrope_positions(ids, grids, segments)[0],
                                                          self.vision.mrope_section), tuple(deepstack))

    def _qwen_visual(self, ids, images) -> tuple:
        """(patches, grids, blocks (B, T)) of ids (B, T) and its images and videos, in the order of their
        placeholders: a video's tokens read as an image's; a placeholder count that is not the grids' refused."""
        pixels, grids = (self.pixel_values(images) if images is not None and len(images) else
                         (np.zeros((0, self.vision.patch_dim), np.float32), np.zeros((0, 3), np.int64)))
        visual = np.isin(ids, (self.vision.image_token_id, self.vision.video_token_id))
        blocks = image_blocks(visual.astype(np.int64), 1, bidirectional=False)
        n_tokens, expected = int((blocks >= 0).sum()), int(np.prod(grids, axis=1).sum()) // self.vision.merge_unit
        if n_tokens != expected:
            raise DataError(f"{n_tokens} image (and video) placeholder tokens for {len(grids)} images and videos of "
                            f"{expected} tokens in all")
        return pixels, grids, blocks

    def _lfm2_image_tokens(self, ids, images, cache: dict | None = None) -> ImageTokens | None:
        """LFM2-VL's ImageTokens of ids (B, T) and its images: every tile's tokens (its patches pooled by the
        projector), causal in the text like any token; cache as image_tokens'."""
        pixels = self.pixel_values(images) if images is not None and len(images) else None
        blocks = image_blocks(np.atleast_2d(np.asarray(ids)), self.vision.image_token_id, bidirectional=False)
        n_tokens, expected = int((blocks >= 0).sum()), 0 if pixels is None else self.tower.tokens(pixels[2])
        if n_tokens != expected:
            raise DataError(f"{n_tokens} image placeholder tokens for images of {expected} tokens in all")
        if pixels is None:
            return None
        if self.tower.lora and cache is not None:       # the tower's backward follows: keep its activations
            embeds, tower_cache = (self.device_tower or self.tower).forward(pixels)
            cache.update(tower_cache)
            return ImageTokens(blocks, embeds)
        return ImageTokens(blocks, (self.device_tower or self.tower)(pixels))

    def mrope_positions(self, ids, grids, segments=None) -> tuple:
        """(positions (3, B, T) of ids (B, T) whose image runs take `grids` in order (a video's: a run per frame
        group), each segment counted from 0 (models/qwen3_vl.rope_index), padding 0; the position after each row's
        last segment (B,))."""
        ids = np.atleast_2d(np.asarray(ids))
        seg = np.ones_like(ids) if segments is None else np.asarray(segments).reshape(ids.shape)
        out, after = np.zeros((3, *ids.shape), np.int64), np.zeros(ids.shape[0], np.int64)
        grids = iter(frame_grids(grids))
        for b in range(ids.shape[0]):
            for s in [s for s in dict.fromkeys(seg[b].tolist()) if s != 0]:
                where = np.flatnonzero(seg[b] == s)
                visual = np.isin(ids[b, where], (self.vision.image_token_id, self.vision.video_token_id))
                runs = int(np.sum(np.diff(np.concatenate([[0], visual]).astype(int)) == 1))
                out[:, b, where], after[b] = rope_index(ids[b, where], [next(grids) for _ in range(runs)],
                                                        self.vision)
        return out, after

    def _text_ids(self, ids):
        """ids with an image (or video) placeholder outside the vocabulary read as 0 (its embedding row is
        replaced)."""
        ids = np.array(ids, dtype=np.int64)
        for token in (self.vision.image_token_id, getattr(self.vision, "video_token_id", -1)):
            if token >= self.model.config.vocab_size:
                ids[ids == token] = 0
        return ids

    def prompt_images(self, ids, images) -> tuple:
        """One prompt's ids (T,) and its images (as pixel_values takes them) -> (its ids as the engine takes them
        (T,), the ImageTokens of the prompt as one row (1, T)): the tower's forward, once, for a prefill."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        return self._text_ids(ids)[0], self.image_tokens(ids, images)

    def _with_images(self, ids, images, call, cache=None, attention_mask=None):
        ids = np.atleast_2d(np.asarray(ids))
        self.model.engine.set_images(self.image_tokens(ids, images, cache, attention_mask))
        try:
            return call(self._text_ids(ids))
        finally:
            self.model.engine.set_images(None)

    def logits(self, input_ids, images=(), attention_mask=None) -> np.ndarray:
        """float32 logits (B, T, V) of input_ids (B, T) whose image placeholders take `images` in order."""
        return self._with_images(input_ids, images, lambda ids: self.model.logits(ids, attention_mask),
                                 attention_mask=attention_mask)

    def loss_and_grads(self, input_ids, labels, images=(), attention_mask=None):
        """Model.loss_and_grads with the images: (mean loss, LoRA gradients by PEFT key), the tower's LoRA
        (set_tower_lora) too: back through the projector and the tower from the image rows' gradient."""
        cache: dict = {}
        loss, grads = self._with_images(input_ids, images,
                                        lambda ids: self.model.loss_and_grads(ids, labels, attention_mask), cache)
        if self.tower.lora and cache:
            for name, g in self._tower_backward(cache).items():
                path, which = name.rsplit(".lora_", 1)
                grads[tower_lora_key(path, which, self.vision)] = g.astype(np.float32)
        return loss, grads

    def _tower_backward(self, cache) -> dict:
        """The tower's LoRA gradients from the language engine's last backward (the image rows' gradient; Qwen3-VL's
        DeepStack features' too), on the tower whose forward made `cache` (the device's or the NumPy one's)."""
        engine = self.model.engine
        if self.qwen:
            layers = range(len(self.vision.deepstack_indexes))
            deep = getattr(engine, "deepstack_grad", {})
            if any(i not in deep for i in layers):
                raise ConfigError(f"LoRA on {self.vision.name}'s vision tower with DeepStack trains without "
                                  f"pipeline stages only for now (its DeepStack features' gradients)")
            tower = self.device_tower if cache.get("device") else self.tower
            return tower.backward(engine.image_grad, [deep[i] for i in layers], cache)
        if self.lfm2:
            tower = self.device_tower if cache.get("device") else self.tower
            return tower.backward(engine.image_grad.reshape(-1, self.vision.text_hidden_size), cache)
        dout = engine.image_grad.reshape(cache["n"], self.vision.mm_tokens_per_image, -1)
        return (self.device_tower if cache.get("device") else self.tower).backward(dout, cache)

    def engine_batch(self, batch: Batch, cache: dict | None = None) -> tuple:
        """A batch of records with images (data/batching.Batch, its `images` each row's) -> the engine's
        micro-batch: (ids with the placeholders as the engine takes them, targets shifted, segment_ids,
        position_ids[, their images]): where the engine runs the tower (in_step), TowerImages, the pixels its
        train_step takes the tower's forward of (set_images: computed at once); else ImageTokens, the tower's
        forward over the batch's images here, once; cache as image_tokens' (and ImageTokens with it)."""
        ids = np.asarray(batch.input_ids)
        pictures = [im for row in batch.images or () for im in row]
        if self.in_step and cache is None:
            images = self.tower_images(ids, pictures, batch.segment_ids)
        else:
            images = self.image_tokens(ids, pictures, cache, batch.segment_ids)
        return (self._text_ids(ids).astype(np.int32), shift_labels(np.asarray(batch.labels, np.int64)),
                np.ascontiguousarray(batch.segment_ids, np.int32), np.ascontiguousarray(batch.position_ids, np.int32),
                *(() if images is None else (images,)))

    def loss(self, batch: Batch) -> tuple:
        """The engine's (loss_sum, count) of a batch with its images."""
        ids, targets, seg, pos, *images = self.engine_batch(batch)
        self.model.engine.set_images(images[0] if images else None)
        try:
            return self.model.engine.loss(ids, targets, seg, pos)
        finally:
            self.model.engine.set_images(None)

    def train_step(self, micro_batches: list, hp: OptimizerParams, step: int, reduce=None, **extra) -> tuple:
        """One optimizer step of the LoRA over micro-batches of records with images (data/batching.Batch, or a
        list of tokenized records each, collated here): the engine's (loss_sum, token_count, grad_norm, applied).
        The tower frozen: its embeddings of each micro-batch's images, then the engine's own step (reduce and
        extra as the engine protocol's); with LoRA on the tower (set_tower_lora), each micro-batch's image-row
        gradient goes back through the tower, `reduce` (a data-parallel worker's) sums both over the workers, and
        one global norm clips both before AdamW updates each. Where the engine runs the tower (in_step), this is the
        engine's own train_step over TowerImages micro-batches (on WebGPU, one submission: the tower's forward and
        its LoRA's backward recorded into it); else (a host tower beside WebGPU, pipeline stages) the tower runs here
        around the engine's passes, with f16's loss scaler as the engine's step applies it (the loss gradient scaled,
        both gradients unscaled, a non-finite step skipped and the scaler updated; pipeline stages refuse f16)."""
        micro = [collate([[e] for e in mb]) if isinstance(mb, list) else mb for mb in micro_batches]
        if self.in_step or not self.tower.lora:
            return self.model.engine.train_step([self.engine_batch(b) for b in micro], hp, step, reduce=reduce,
                                                **extra)
        engine = self.model.engine
        scaler = getattr(engine, "loss_scaler", None)
        if scaler is not None and not hasattr(engine, "set_vision_tower"):    # the stages', a copy here
            raise ConfigError("LoRA on the vision tower over pipeline stages does not train with --precision f16 "
                              "(the stages keep the loss scaler): use --precision bf16")
        scale = scaler.scale if scaler is not None else 1.0
        total = sum(int((shift_labels(np.asarray(b.labels, np.int64)) != IGNORE_INDEX).sum()) for b in micro)
        engine.zero_grads()
        self.tower_optimizer.zero_grads()
        loss_sum = 0.0
        for mb in micro:    # the tower's forward just before its backward (the device tower keeps its last one's)
            cache: dict = {}
            ids, targets, seg, pos, *images = self.engine_batch(mb, cache)
            engine.set_images(images[0] if images else None)
            try:
                loss_sum += engine.forward_backward(ids, targets, seg, pos, scale / max(total, 1))[0]
            finally:
                engine.set_images(None)
            if images:
                for name, g in self._tower_backward(cache).items():
                    self.tower_optimizer.add(name, g)
        if scaler is not None:      # f16: both gradients unscaled (exact: a power of two) before the reduce
            engine.reduce_gradients(lambda flat, _: flat * np.float32(1.0 / scale), total)
            self.tower_optimizer.unscale(scale)
        if reduce is not None:      # data parallel: the language model's gradients, then the tower's, summed
            engine.reduce_gradients(reduce, total)
            self.tower_optimizer.reduce(reduce, total)
        norm = grad_norm([*engine.gradients().values(), *self.tower_optimizer.grads.values()])
        args = (hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.max_grad_norm, step, hp.lora_b_lr_ratio)
        _, applied = engine.apply_update(norm, *args)      # a non-finite norm skips both updates
        self.tower_optimizer.apply_update(norm, *args)
        if scaler is not None:
            scaler.update(applied)
        return loss_sum, total, norm, applied

    def state_dict(self) -> dict:
        """The language engine's (its LoRA dropout counter, which a data-parallel worker sets for its share)."""
        return self.model.engine.state_dict()

    def load_state_dict(self, state: dict):
        self.model.engine.load_state_dict(state)

    def generate(self, input_ids, images=(), max_new_tokens: int = 32, stop_token_ids=(), on_token=None) -> list[int]:
        """Greedy new token ids after one prompt with its images, over the engine's KV cache: the prompt prefilled
        in one call (each image whole, Gemma 3's blocks bidirectional), then a token a call; on_token(id), when given,
        called with each as it comes."""
        ids = np.asarray(input_ids).reshape(-1)
        engine, n = self.model.engine, len(ids)
        kv = engine.new_kv_cache(1, n + max_new_tokens)
        prompt = self.image_tokens(ids[None], images)
        engine.set_images(prompt)
        try:
            logits = engine.forward_rows(self._text_ids(ids), np.zeros(n, np.int32), np.arange(n, dtype=np.int32),
                                         kv, np.array([n - 1]))
        finally:
            engine.set_images(None)
        # Qwen3-VL: a new token's M-RoPE position counts on from the prompt's last, which its images made smaller
        # than the cache row it takes
        shift = int(prompt.positions.max()) + 1 - n if prompt is not None and prompt.positions is not None else 0
        out = []
        for step in range(max_new_tokens):
            nxt = int(np.argmax(logits[0]))
            out.append(nxt)
            if on_token is not None:
                on_token(nxt)
            if nxt in stop_token_ids or step == max_new_tokens - 1:
                break
            engine.set_images(None if not shift else ImageTokens(
                np.full((1, 1), -1, np.int32), np.zeros((0, self.model.config.hidden_size), np.float32),
                np.full((1, 1, sum(self.vision.mrope_section)), n + step + shift, np.int32)))
            try:
                logits = engine.forward_rows(np.array([nxt]), np.zeros(1, np.int32), np.array([n + step], np.int32),
                                             kv, np.array([0]))
            finally:
                engine.set_images(None)
        engine.free_kv_cache(kv)
        return out


def load_vision_model(path, backend: str = "numpy", **kw) -> VisionModel:
    """A Gemma3ForConditionalGeneration, SmolVLMForConditionalGeneration, Idefics3ForConditionalGeneration,
    Qwen3VLForConditionalGeneration, Qwen3.5's (dense or MoE) or Lfm2VlForConditionalGeneration folder with its vision tower and projector
    (float32); `kw` as load_model's. The processor's preprocessor_config.json gives the image preprocessing where
    the folder has it."""
    return attach_vision(load_model(path, backend=backend, **kw), path)


def _tower_tensors(folder: Path, names_of) -> dict:
    """The vision tower's and projector's tensors alone (not the language model's again) from folder's weight files:
    names_of(a file's tensor names) -> {our name: the file's name}."""
    tensors = {}
    for f in weight_files(folder):
        tensors.update(read_safetensors(f, names=set(names_of(safetensors_names(f)).values())))
    return tensors


def attach_vision(model: Model, path) -> VisionModel:
    """The VisionModel of a language model loaded already from the multimodal folder `path` (load_vision_model's):
    its vision tower and projector read from the folder's weights beside it."""
    folder = Path(path)
    raw = json.loads((folder / "config.json").read_text())
    vision = VisionConfig.from_config(raw, str(folder / "config.json"))
    rt = getattr(model.engine, "rt", None)      # None: NumPy, or pipeline stages (the tower in this process's CPU)
    if isinstance(vision, Qwen3VLVision):
        tensors = _tower_tensors(folder, visual_names)
        names = check_visual_tensors(tensors, vision, folder)
        tower = Qwen3VLTower(vision, {ours: tensors[name] for ours, name in names.items()}, model.engine.dtype)
        device = (GpuQwenTower(rt, tower) if model.backend == "wgpu" and rt is not None and
                  qwen_vision_tower.runs_on_device(rt, tower) else None)
        return VisionModel(model, tower, vision, QwenImageSettings.from_folder(folder, vision), device)
    if isinstance(vision, Lfm2VlVision):
        tensors = _tower_tensors(folder, lfm2_vl_names)
        names = check_lfm2_vl_tensors(tensors, vision, folder)
        tower = Siglip2Tower(vision, {ours: tensors[name] for ours, name in names.items()}, model.engine.dtype)
        device = (GpuSiglip2Tower(rt, tower) if model.backend == "wgpu" and rt is not None and
                  siglip2_tower.runs_on_device(rt, tower) else None)
        return VisionModel(model, tower, vision, Lfm2ImageSettings.from_folder(folder, vision.patch_size,
                                                                                vision.downsample_factor), device)
    tensors = _tower_tensors(folder, vision_names)
    names = check_vision_tensors(tensors, vision, folder)
    weights = {ours: tensors[name] for ours, name in names.items()}
    tower = VisionTower(vision, weights, model.engine.dtype)
    settings = (TileSettings if vision.scale_factor else ImageSettings).from_folder(folder, vision.image_size)
    device = (GpuVisionTower(rt, vision, weights)
              if model.backend == "wgpu" and rt is not None and runs_on_device(rt, vision) else None)
    return VisionModel(model, tower, vision, settings, device)
