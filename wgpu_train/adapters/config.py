"""LoraConfig: the LoRA hyper-parameters with PEFT's meaning for every field, checked on construction."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from wgpu_train.errors import ConfigError
from wgpu_train.adapters.experts import all_linear_takes_experts, parse_target_parameters, peft_converts_expert_names
from wgpu_train.models.config import ATTENTION_MODULES, EXPERT_PARAMETERS, KNOWN_LINEAR_MODULES, ModelConfig
from wgpu_train.models.vision import vision_targets


_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")     # transformers 4's names of an expert's projections


def _names(module: str, target: str) -> bool:
    """Whether a target name selects a layer's linear module: the module itself, or the end of its path."""
    return module == target or module.endswith("." + target)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA hyper-parameters (use_dora: DoRA), with PEFT's meaning for every field (layout.py resolves the per-layer ones:
    layers_to_transform / layers_pattern choose the layers, rank_pattern / alpha_pattern map a module-path
    pattern to its r / alpha; inits.py computes `init`: "default" (PEFT's True), "gaussian", "pissa",
    "pissa_niter_K" or "olora"; saved_modules.py resolves modules_to_save with ensure_weight_tying)."""

    r: int = 8
    alpha: float = 16
    dropout: float = 0.0
    target_modules: tuple = ("q_proj", "v_proj")
    use_rslora: bool = False
    layers_to_transform: tuple | None = None     # layer indices (None: every layer)
    layers_pattern: tuple | None = None          # names of the layer list in module paths (None: any)
    rank_pattern: dict = field(default_factory=dict)     # module-path pattern -> r
    alpha_pattern: dict = field(default_factory=dict)    # module-path pattern -> alpha
    init: str = "default"
    use_dora: bool = False        # DoRA: a trained magnitude per output row (PEFT's use_dora; dora.py)
    modules_to_save: tuple = ()      # "embed_tokens" / "lm_head": full copies trained beside LoRA (adapters/saved_modules.py)
    ensure_weight_tying: bool = False   # a tied model: one copy serves the embedding and lm_head (PEFT's)
    # an MoE layer's expert tensors with a LoRA pair per expert (PEFT's target_parameters: experts.py); all-linear
    # takes them, as PEFT's does
    target_parameters: tuple = ()

    def __post_init__(self):
        from wgpu_train.adapters.inits import check_init
        from wgpu_train.adapters.layout import check_layout
        from wgpu_train.adapters.saved_modules import check_modules

        targets = self.target_modules
        experts, routers = parse_target_parameters(self.target_parameters or ())
        if targets == "all-linear":
            experts = EXPERT_PARAMETERS
        object.__setattr__(self, "target_parameters", experts)
        if isinstance(targets, str):
            targets = KNOWN_LINEAR_MODULES if targets == "all-linear" else tuple(
                t.strip() for t in targets.split(",") if t.strip())
        targets = tuple(targets) + routers
        unknown = [t for t in targets if t not in KNOWN_LINEAR_MODULES]
        if vision_targets(unknown):
            raise ConfigError(f"LoRA target_modules {vision_targets(unknown)!r} are the vision tower's: not supported "
                              f"here (a text-only model has none; a vision model's train through finetune's "
                              f"--lora-targets on records with images, or VisionModel.set_tower_lora)")
        if unknown or not (targets or experts):      # LoRA on the experts alone: no module
            raise ConfigError(f"LoRA target_modules {unknown or targets!r} not in {', '.join(KNOWN_LINEAR_MODULES)} "
                              f"or 'all-linear'")
        object.__setattr__(self, "target_modules", tuple(t for t in KNOWN_LINEAR_MODULES if t in targets))
        if int(self.r) < 1:
            raise ConfigError(f"LoRA rank r must be >= 1, got {self.r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ConfigError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if not (math.isfinite(float(self.alpha)) and float(self.alpha) > 0):
            raise ConfigError(f"LoRA alpha must be a finite number > 0, got {self.alpha}")
        for name, value in check_layout(self).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "init", check_init(self))
        if self.use_dora and self.init not in ("default", "gaussian"):
            raise ConfigError(f"DoRA with LoRA init {self.init} is not supported (its residual base and the "
                              f"conversion on save are not computed for DoRA); use init default or gaussian")
        object.__setattr__(self, "modules_to_save", check_modules(self.modules_to_save))
        object.__setattr__(self, "ensure_weight_tying", bool(self.ensure_weight_tying))

    @property
    def scale(self) -> float:
        """The update's scale of a module with the config's own r and alpha (see module_scales for all)."""
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r

    def targets_in(self, model: ModelConfig) -> tuple:
        """The target modules in `model`'s layers, in their order: all-linear (every family's names) takes
        the model's own (on gpt-oss and LFM2-MoE not the router or experts, as PEFT's:
        experts.all_linear_takes_experts); a target names a module by its path's end, as in PEFT (gate_proj: Qwen2-MoE's
        dense MLPs' and shared expert's; the experts' on the MoE families whose names PEFT converts, so refused
        there); a named module the model lacks is refused, naming the model's modules."""
        all_linear = self.target_modules == KNOWN_LINEAR_MODULES
        if all_linear and not all_linear_takes_experts(model):     # every nn.Linear, as PEFT's: not the router
            return tuple(m for m in model.linear_modules if m != model.moe.router)
        missing = [t for t in self.target_modules if not any(_names(m, t) for m in model.linear_modules)]
        if missing and not all_linear:
            kinds = model.modules_by_layer_kind()
            have = "; ".join(f"{kind}: {', '.join(mods)}" for kind, mods in kinds.items() if mods)
            raise ConfigError(f"LoRA target_modules {','.join(missing)}: {model.architecture}'s linear modules are, "
                              f"by kind of layer, {have} (or use all-linear)")
        if model.moe is not None and peft_converts_expert_names(model):
            # PEFT 0.21 on transformers 5 reads these names as the experts' fused tensors of an MoE model (its
            # conversion of transformers 4 adapters), so an adapter could not name a dense MLP's modules (on
            # Qwen2-MoE, where it converts nothing, they name the dense MLPs and the shared expert, as here)
            mlp = [t for t in self.target_modules if t in _EXPERT_NAMES]
            if mlp and not all_linear:
                raise ConfigError(f"LoRA target_modules {','.join(mlp)}: on an MoE model PEFT reads these names as "
                                  f"the experts' tensors; target the experts with target_parameters "
                                  f"(--lora-target-parameters mlp.experts.gate_up_proj,mlp.experts.down_proj) or "
                                  f"use all-linear")
            return tuple(m for m in model.linear_modules if any(_names(m, t) for t in self.target_modules)
                         and m.rsplit(".", 1)[-1] not in _EXPERT_NAMES)
        return tuple(m for m in model.linear_modules if any(_names(m, t) for t in self.target_modules))

    def named_targets(self, model: ModelConfig) -> tuple:
        """The target names that name some module of `model` (all-linear: the model's own), as an adapter saves
        them."""
        modules = self.targets_in(model)
        return tuple(t for t in self.target_modules if any(_names(m, t) for m in modules))

    def as_saved(self, model: ModelConfig) -> "LoraConfig":
        """This config as an adapter for `model` saves it: its targets as named_targets; on an MoE model, all-linear
        as PEFT 0.21 resolves it on transformers 5 (the attention, the router, the experts; the experts' fused
        gate_up_proj at rank 2r and alpha 2 alpha, for the gate's and the up's pairs, in rank / alpha patterns)."""
        saved = dataclasses.replace(self, target_modules=self.named_targets(model),
                                    target_parameters=self.experts_in(model))
        if model.moe is None or not all_linear_takes_experts(model) or self.target_modules != KNOWN_LINEAR_MODULES:
            return saved
        fused = r".*\.gate_up_proj"
        return dataclasses.replace(saved, rank_pattern={fused: 2 * int(self.r), **self.rank_pattern},
                                   alpha_pattern={fused: 2 * self.alpha, **self.alpha_pattern})

    def experts_in(self, model: ModelConfig) -> tuple:
        """The expert tensors of `model`'s MoE layers that get a LoRA pair per expert (target_parameters); on a
        dense model, expert targets other than all-linear's are refused, and so are dropout and DoRA on experts
        (PEFT's expert wrapper takes neither)."""
        if not self.target_parameters:
            return ()
        if self.target_modules == KNOWN_LINEAR_MODULES and not all_linear_takes_experts(model):
            return ()        # gpt-oss: PEFT's all-linear leaves its experts alone
        if model.moe is None:
            if self.target_modules == KNOWN_LINEAR_MODULES:
                return ()
            raise ConfigError(f"LoRA target_parameters {', '.join(self.target_parameters)}: {model.architecture} has "
                              f"no experts")
        if self.dropout or self.use_dora:
            raise ConfigError(f"LoRA on the experts ({', '.join(self.target_parameters)}) takes neither dropout nor "
                              f"DoRA (as PEFT's): set lora_dropout 0 and use_dora false, or leave the experts out")
        return self.target_parameters

    def modules(self, model: ModelConfig) -> dict:
        """{module path: (r, alpha)} of every module this config puts LoRA on in `model`, layer by layer in
        its linear modules' order (PEFT's selection and pattern rules: layout.module_settings)."""
        from wgpu_train.adapters.layout import module_settings

        return module_settings(self, model)

    def module_scales(self, model: ModelConfig) -> dict:
        """{module path: scale} (alpha / r, or alpha / sqrt(r) with rsLoRA, of each module's own r, alpha)."""
        root = math.sqrt if self.use_rslora else float
        return {p: a / root(r) for p, (r, a) in self.modules(model).items()}
