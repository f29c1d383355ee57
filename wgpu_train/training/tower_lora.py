"""The Trainer's VisionModel, and LoRA on its tower from --lora-targets (models/vision.split_targets): pairs on the
encoder modules named (fresh, or a resumed checkpoint's with their AdamW moments), what a checkpoint keeps of them,
and the options they do not take yet refused in one line."""
from __future__ import annotations

import numpy as np

from wgpu_train.adapters.inits import fresh_pair
from wgpu_train.engines.vision_model import VisionModel, attach_vision
from wgpu_train.errors import ConfigError
from wgpu_train.training.objectives import TrainerKind, objective_class
from wgpu_train.models.vision import selects, split_targets, tower_lora_key, tower_lora_path

_TENSOR, _M, _V = "tower.", "tower_exp_avg.", "tower_exp_avg_sq."     # checkpoint array name prefixes


def attach_tower(trainer) -> VisionModel:
    """The VisionModel of trainer.model (engines/vision_model.attach_vision) with LoRA on the tower's modules that
    --lora-targets names, at the run's rank and alpha: A as --lora-init draws it (from the seed), B zero, as
    PEFT's; on a resume, the checkpoint's tensors and moments (tower_arrays)."""
    cfg = trainer.config
    vision = attach_vision(trainer.model, trainer.model_dir)
    modules = split_targets(cfg.lora_targets)[1] if cfg.method == "lora" else ()
    if not modules:
        return vision
    for flag, given in (("--lora-dropout", cfg.lora_dropout), ("--rslora", cfg.rslora), ("--dora", cfg.dora),
                        (f"--lora-init {cfg.lora_init}", cfg.lora_init not in ("default", "gaussian")),
                        ("--lora-rank-pattern", cfg.lora_rank_pattern),
                        ("--lora-alpha-pattern", cfg.lora_alpha_pattern),
                        ("--early-stop-patience", cfg.early_stop_patience), ("--adapter-path", trainer.continued_from)):
        if given:
            raise ConfigError(f"LoRA on the vision tower does not take {flag} yet (it trains at one rank and "
                              f"alpha, without dropout)")
    if vision.qwen and vision.vision.deepstack_indexes and not hasattr(trainer.model.engine, "deepstack_grad"):
        raise ConfigError(f"LoRA on {vision.vision.name}'s vision tower with DeepStack trains without pipeline "
                          f"stages only for now (their stages do not give its DeepStack features' gradients back)")
    if not vision.in_step and objective_class(cfg.objective).trainer is not TrainerKind.SUPERVISED:
        raise ConfigError(f"LoRA on this model's vision tower trains with --objective {cfg.objective} where the "
                          f"engine runs the tower inside its step only for now (the NumPy engine, or the device "
                          f"beside WebGPU; not a host tower beside WebGPU or pipeline stages): use --objective sft")
    r, rng = int(cfg.lora_rank), np.random.default_rng([cfg.seed, 46])
    tensors = {}
    paths = [p for p in vision.tower.modules() if any(selects(p, m) for m in modules)]
    missing = next((m for m in modules if not any(selects(p, m) for p in paths)), None)
    if missing is not None:
        raise ConfigError(f"--lora-targets: {missing} is not a linear module of this model's vision tower")
    for path in paths:
        a, b = fresh_pair(rng, cfg.lora_init, r, *vision.tower.w[path + ".weight"].shape)
        tensors[tower_lora_key(path, "A", vision.vision)], tensors[tower_lora_key(path, "B", vision.vision)] = a, b
    vision.set_tower_lora(tensors, float(cfg.lora_alpha) / r)
    if trainer.resume:
        _restore(vision, trainer.resume.folder)
    n = sum(a.size + b.size for a, b, _ in vision.tower.lora.values())
    where = "on the device" if vision.device_tower is not None else "NumPy, on the CPU"
    trainer.log(f"LoRA on the vision tower: {', '.join(modules)} in {len(paths)} modules, "
                f"{n:,} trainable parameters ({where})")
    return vision


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


def check_continued(adapter):
    """An --adapter-path folder with LoRA on the vision tower refused in one line (a run continues a language
    model's adapter only, for now)."""
    from wgpu_train.formats.safetensors import safetensors_names

    if any(tower_lora_path(k) is not None for k in safetensors_names(adapter / "adapter_model.safetensors")):
        raise ConfigError(f"--adapter-path {adapter}: its LoRA on the vision tower is not continued by a new run yet; "
                          f"--resume its run's checkpoint instead")


def tower_arrays(vision: VisionModel | None) -> dict:
    """What a checkpoint keeps of the tower's LoRA (none without it): its tensors and AdamW moments by name."""
    if vision is None or not vision.tower.lora:
        return {}
    out = {_TENSOR + k: v.copy() for k, v in vision.tower_trainable().items()}
    for k, (m, v) in vision.tower_optimizer_state().items():
        out[_M + k], out[_V + k] = m, v
    return out


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
