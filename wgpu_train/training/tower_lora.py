"""The Trainer's VisionModel, and LoRA on its tower from --lora-targets (models/vision.split_targets): pairs on the
encoder modules named (fresh, a continued adapter's, or a resumed checkpoint's with their AdamW moments), what a
checkpoint and early stopping keep of them, and the options they do not take yet refused in one line."""
from __future__ import annotations

import numpy as np

from wgpu_train.adapters.inits import changes_base, decompose, fresh_pair
from wgpu_train.adapters.layout import parse_pattern
from wgpu_train.adapters.tower_scales import tower_scales
from wgpu_train.engines.vision_model import VisionModel, attach_vision
from wgpu_train.errors import ConfigError
from wgpu_train.training.objectives import TrainerKind, objective_class
from wgpu_train.models.vision import VisionConfig, selects, split_targets, tower_lora_key, tower_lora_path

_TENSOR, _M, _V = "tower.", "tower_exp_avg.", "tower_exp_avg_sq."     # checkpoint array name prefixes
_SCALE = "tower_scale."         # each module's scale (a continued adapter's LoRA resumes without --lora-targets)


def attach_tower(trainer) -> VisionModel:
    """The VisionModel of trainer.model (engines/vision_model.attach_vision) with LoRA on the tower's modules that
    --lora-targets names, at the run's rank and alpha: A as --lora-init draws it (from the seed), B zero, as
    PEFT's; on a resume, the checkpoint's tensors and moments (tower_arrays)."""
    cfg = trainer.config
    vision = attach_vision(trainer.model, trainer.model_dir)
    modules = split_targets(cfg.lora_targets)[1] if cfg.method == "lora" else ()
    continued = trainer.continued_from is not None and has_tower_lora(trainer.continued_from)
    saved = _saved_scales(trainer.resume.folder) if trainer.resume and not modules else {}
    if not (modules or continued or saved):
        return vision
    for flag, given in (("--lora-dropout", cfg.lora_dropout), ("--dora", cfg.dora),
                        (f"--lora-init {cfg.lora_init} on this model's tower (Gemma 3's and SmolVLM's only)",
                         changes_base(cfg.lora_init) and not isinstance(vision.vision, VisionConfig))):
        if given:
            raise ConfigError(f"LoRA on the vision tower does not take {flag} yet (it trains without dropout or "
                              f"DoRA)")
    if vision.qwen and vision.vision.deepstack_indexes and not hasattr(trainer.model.engine, "deepstack_grad"):
        raise ConfigError(f"LoRA on {vision.vision.name}'s vision tower with DeepStack trains without pipeline "
                          f"stages only for now (their stages do not give its DeepStack features' gradients back)")
    if not vision.in_step and objective_class(cfg.objective).trainer is not TrainerKind.SUPERVISED:
        raise ConfigError(f"LoRA on this model's vision tower trains with --objective {cfg.objective} where the "
                          f"engine runs the tower inside its step only for now (the NumPy engine, or the device "
                          f"beside WebGPU; not LFM2-VL's tower, a host tower beside WebGPU or pipeline stages): "
                          f"use --objective sft")
    if continued:       # the adapter's pairs, at its alpha / r, trained on (fresh moments)
        vision.load_tower_adapter(trainer.continued_from)
        paths = list(vision.tower.lora)
        _check_continued_targets(vision, modules, paths, trainer.continued_from)
    elif saved:         # a resumed run that continued an adapter: its checkpoint's pairs (_restore's), at their scales
        paths = list(saved)
        vision.set_tower_lora({tower_lora_key(p, w, vision.vision): np.zeros(s) for p, (shapes, _) in saved.items()
                               for w, s in zip("AB", shapes)}, {p: scale for p, (_, scale) in saved.items()})
    else:
        paths = _fresh(vision, modules, cfg)
    if trainer.resume:
        _restore(vision, trainer.resume.folder)
    n = sum(a.size + b.size for a, b, _ in vision.tower.lora.values())
    where = "on the device" if vision.device_tower is not None else "NumPy, on the CPU"
    named = "the adapter's, continued," if continued or saved else ", ".join(modules)
    trainer.log(f"LoRA on the vision tower: {named} in {len(paths)} modules, "
                f"{n:,} trainable parameters ({where})")
    return vision


def _fresh(vision: VisionModel, modules, cfg) -> list:
    """Fresh pairs on the tower's modules that `modules` select, at the run's rank and alpha: A as --lora-init
    draws it (from the seed), B zero; their paths."""
    rng = np.random.default_rng([cfg.seed, 46])
    tensors = {}
    paths = [p for p in vision.tower.modules() if any(selects(p, m) for m in modules)]
    missing = next((m for m in modules if not any(selects(p, m) for p in paths)), None)
    if missing is not None:
        raise ConfigError(f"--lora-targets: {missing} is not a linear module of this model's vision tower")
    settings = tower_scales(paths, vision.vision, cfg.lora_rank, cfg.lora_alpha, cfg.rslora,
                            parse_pattern(cfg.lora_rank_pattern, "lora_rank_pattern"),
                            parse_pattern(cfg.lora_alpha_pattern, "lora_alpha_pattern"))
    residual = {}
    for path in paths:
        w = vision.tower.w[path + ".weight"]
        if changes_base(cfg.lora_init):     # PiSSA / OLoRA: the pair from the weight, the residual its base
            a, b, residual[path] = decompose(w, settings[path][0], settings[path][1], cfg.lora_init, rng)
        else:
            a, b = fresh_pair(rng, cfg.lora_init, settings[path][0], *w.shape)
        tensors[tower_lora_key(path, "A", vision.vision)], tensors[tower_lora_key(path, "B", vision.vision)] = a, b
    if residual:
        vision.set_tower_residual(residual, {p: (tensors[tower_lora_key(p, "A", vision.vision)],
                                                 tensors[tower_lora_key(p, "B", vision.vision)]) for p in paths})
    vision.set_tower_lora(tensors, {p: scale for p, (_, scale) in settings.items()})
    return paths


def _check_continued_targets(vision: VisionModel, modules, paths, adapter):
    """--lora-targets naming tower modules other than those the continued adapter's tower LoRA covers refused in
    one line (none named: the adapter's)."""
    if modules and {p for p in vision.tower.modules() if any(selects(p, m) for m in modules)} != set(paths):
        raise ConfigError(f"--lora-targets contradicts the tower modules of {adapter}'s LoRA ({len(paths)} "
                          f"modules); leave the tower's out to continue with the adapter's")


def check_tower_targets(cfg, folder, images: bool | None = None):
    """--lora-targets naming the vision tower refused in one line where it cannot train: on a text-only model
    (no vision_config in folder's config.json), on records without images
    (images False; None: the data not read yet)."""
    import json
    from pathlib import Path

    modules = split_targets(cfg.lora_targets)[1] if cfg.method == "lora" else ()
    if not modules:
        return
    where = f"--lora-targets {cfg.lora_targets if isinstance(cfg.lora_targets, str) else ','.join(cfg.lora_targets)}"
    if not json.loads((Path(folder) / "config.json").read_text()).get("vision_config"):
        raise ConfigError(f"{where}: names the vision tower's modules, and {folder} is a text-only model (no "
                          f"vision tower)")
    if images is False:
        raise ConfigError(f"{where}: LoRA on the vision tower trains on records with images (TRL's vision format)")


def check_continued(cfg, images: bool):
    """An --adapter-path adapter with LoRA on the vision tower continued on records without images, or a
    checkpoint's adapter (its tower's LoRA is in the checkpoint's arrays), refused in one line (the tower's LoRA
    would be dropped)."""
    from wgpu_train.adapters.files import adapter_folder
    from wgpu_train.training.checkpoint import read_arrays

    adapter = adapter_folder(cfg.adapter_path)
    if adapter is None:
        return
    if adapter.name == "adapter" and any(k.startswith(_TENSOR) for k in read_arrays(adapter.parent)):
        raise ConfigError(f"--adapter-path {cfg.adapter_path}: a checkpoint whose LoRA on the vision tower lies "
                          f"beside its adapter; --resume it, or continue its run's adapter folder")
    if not images and has_tower_lora(adapter):
        raise ConfigError(f"--adapter-path {cfg.adapter_path}: its LoRA on the vision tower trains on records with "
                          f"images (TRL's vision format)")


def language_adapter(adapter):
    """The folder of `adapter`'s language-model LoRA: `adapter` itself, or where it holds LoRA on the vision tower
    too (continued by attach_tower), a copy without the tower's tensors (in a temporary folder kept for the
    process), which the language model's adapter reading takes."""
    from pathlib import Path

    if adapter is None or not has_tower_lora(adapter):
        return adapter
    folder = Path(adapter).resolve()
    stat = (folder / "adapter_model.safetensors").stat()
    key = (folder, stat.st_mtime_ns, stat.st_size)         # a folder written again: copied again
    if key not in _LANGUAGE_COPIES:
        import shutil
        import tempfile

        from wgpu_train.formats.safetensors import read_safetensors, write_safetensors

        copy = tempfile.TemporaryDirectory(prefix="wgpu-train-adapter-")
        shutil.copy(folder / "adapter_config.json", copy.name)
        tensors = read_safetensors(folder / "adapter_model.safetensors")
        write_safetensors(Path(copy.name) / "adapter_model.safetensors",
                          {k: v for k, v in tensors.items() if tower_lora_path(k) is None}, metadata={"format": "pt"})
        _LANGUAGE_COPIES[key] = copy
    return Path(_LANGUAGE_COPIES[key].name)


_LANGUAGE_COPIES: dict = {}     # (adapter folder, its file's mtime and size) -> TemporaryDirectory (language_adapter)


def has_tower_lora(adapter) -> bool:
    """Whether the PEFT adapter folder `adapter` holds LoRA on a vision tower."""
    from wgpu_train.formats.safetensors import safetensors_names

    return any(tower_lora_path(k) is not None for k in safetensors_names(adapter / "adapter_model.safetensors"))


def tower_arrays(vision: VisionModel | None) -> dict:
    """What a checkpoint keeps of the tower's LoRA (none without it): its tensors and AdamW moments by name."""
    if vision is None or not vision.tower.lora:
        return {}
    out = {_TENSOR + k: v.copy() for k, v in vision.tower_trainable().items()}
    for k, (m, v) in vision.tower_optimizer_state().items():
        out[_M + k], out[_V + k] = m, v
    out.update({_SCALE + p: np.float64(scale) for p, (_, _, scale) in vision.tower.lora.items()})
    return out


def _saved_scales(folder) -> dict:
    """{module path: ((A's shape, B's shape), scale)} of the tower's LoRA in the checkpoint in `folder` (none:
    it has none, or it predates the scales)."""
    from wgpu_train.training.checkpoint import read_arrays

    arrays = read_arrays(folder)
    return {k[len(_SCALE):]: ((arrays[f"{_TENSOR}{k[len(_SCALE):]}.lora_A"].shape,
                               arrays[f"{_TENSOR}{k[len(_SCALE):]}.lora_B"].shape), float(v))
            for k, v in arrays.items() if k.startswith(_SCALE)}


def kept_tensors(engine, vision: VisionModel | None) -> dict:
    """What early stopping keeps of an evaluation's weights: the engine's trainable tensors, and the tower's LoRA
    tensors under a checkpoint's array names (tower_arrays')."""
    tower = vision.tower_trainable() if vision is not None and vision.tower.lora else {}
    return {**engine.trainable(), **{_TENSOR + k: v for k, v in tower.items()}}


def checkpoint_kept(arrays: dict) -> dict:
    """kept_tensors' tower part from a checkpoint's arrays (read_arrays)."""
    return {k: v for k, v in arrays.items() if k.startswith(_TENSOR)}


def restore_kept(engine, vision: VisionModel | None, kept: dict):
    """kept_tensors' tensors written back: the engine's, and the tower's LoRA."""
    engine.set_trainable({k: v for k, v in kept.items() if not k.startswith(_TENSOR)})
    tower = {k[len(_TENSOR):]: v for k, v in kept.items() if k.startswith(_TENSOR)}
    if tower and vision is not None:
        vision.set_tower_trainable(tower)


def _restore(vision: VisionModel, folder):
    """The tower's LoRA tensors and moments from the checkpoint in `folder`; one that trained other modules (or
    none) refused in one line."""
    from wgpu_train.training.checkpoint import read_arrays

    arrays = read_arrays(folder)
    live = vision.tower_trainable()
    saved = {k[len(_TENSOR):] for k in arrays if k.startswith(_TENSOR)}
    if saved != set(live):
        raise ConfigError(f"resume: the checkpoint {folder} trained LoRA on {len(saved) // 2} tower modules, "
                          f"--lora-targets names {len(live) // 2}: resume with the targets it trained")
    vision.set_tower_trainable({k: arrays[_TENSOR + k] for k in live})
    vision.load_tower_optimizer_state({k[len(_M):]: (v, arrays[_V + k[len(_M):]])
                                       for k, v in arrays.items() if k.startswith(_M)})
