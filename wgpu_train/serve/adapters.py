"""The models a server answers for: the base under its name and each --adapter NAME=DIR (or hub id), read once
and kept in memory: all in one bank on the engine (rows of mixed adapters in one batch) where every adapter can
join one, else switched on the one Model without reloading the base; an adapter trained on another base (than
the served model's, or than another adapter's) refused before serving."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from wgpu_train.adapters.experts import is_expert_path
from wgpu_train.adapters.files import adapter_base_name
from wgpu_train.engines.shared.mixed_lora import build_bank
from wgpu_train.errors import AdapterError, ConfigError
from wgpu_train.formats import hub
from wgpu_train.models.weights import module_name
from wgpu_train.serve.prompts import PromptStyle

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]*")


@dataclass(frozen=True)
class AdapterSpec:
    """One --adapter: the name requests give as `model`, and the adapter's folder or hub id."""

    name: str
    source: str


def parse_adapter_spec(text: str) -> AdapterSpec:
    """NAME=DIR (a folder or hub id), or a hub id alone (named by itself); anything else is a ConfigError."""
    name, sep, source = text.partition("=")
    if not sep:
        if not hub.is_hub_id(text):
            raise ConfigError(f"--adapter {text!r}: give it a name, --adapter NAME=DIR (a hub id org/name may "
                              f"stand alone)")
        name, source = text, text
    if not _NAME.fullmatch(name):
        raise ConfigError(f"--adapter {text!r}: the name {name!r} must start with a letter or digit and hold "
                          f"only letters, digits and . _ : @ / -")
    if not source:
        raise ConfigError(f"--adapter {text!r}: no adapter folder or hub id after '='")
    return AdapterSpec(name, source)


def _same_model(a: Path, b: Path) -> bool:
    """Whether two model folders hold the same model: one folder, or copies (the same config.json, and weight
    files of the same names and sizes, equal at SAMPLES places spread over each)."""
    if a.resolve() == b.resolve():
        return True
    identity = _identity(a)
    return identity is not None and identity == _identity(b)


SAMPLES = 16        # 4 KiB reads per weight file: a fine-tuned copy of a base differs somewhere among them


def _identity(folder: Path):
    try:
        config = json.loads((folder / "config.json").read_text())
        files = []
        for path in sorted(folder.glob("*.safetensors")):
            size = path.stat().st_size
            with path.open("rb") as f:
                samples = []
                for k in range(SAMPLES):
                    f.seek(size * k // SAMPLES)
                    samples.append(f.read(4096))
            files.append((path.name, size, samples))
    except (OSError, ValueError):
        return None
    return config, files


def served_hub_id(model_arg: str | None, model_dir: Path) -> str | None:
    """The hub repository the served model is: --model when it is a hub id, else its config.json's
    `_name_or_path` when that is one, else the repository of a hub cache folder (models--org--name/snapshots/..);
    None when nothing names one."""
    if model_arg and hub.is_hub_id(model_arg):
        return hub.split_id(model_arg)[0]
    try:
        recorded = json.loads((model_dir / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if isinstance(recorded, str) and hub.is_hub_id(recorded):
        return hub.split_id(recorded)[0]
    for part in model_dir.resolve().parts:
        cached = re.fullmatch(r"models--([^/]+?)--(.+)", part)
        if cached:
            return f"{cached[1]}/{cached[2].replace('--', '/')}"
    return None


def check_bases(adapters: list[tuple[str, Path]], model_arg: str | None, model_dir: Path) -> list[str]:
    """Refuse (AdapterError, one line) an adapter whose recorded base (base_model_name_or_path) is known to be
    another model than the served one: another hub repository than the one the served model names (see
    served_hub_id), a model folder on this machine that is neither the served folder nor a copy of it, or
    another hub repository than another adapter's. A base recorded as none, or as a folder not on this machine,
    passes; so does a hub id over a served folder that names no repository, with a warning line (returned)
    naming it. The adapters' shapes are checked against the model when they are read."""
    served = served_hub_id(model_arg, model_dir)
    warnings, repos = [], {}
    for name, adapter in adapters:
        base = adapter_base_name(adapter)
        if hub.is_hub_id(base):
            repos.setdefault(hub.split_id(base)[0].lower(), (name, base))
            if served is None:
                warnings.append(f"adapter {name} was trained on {base}; the served model {model_dir} names no hub "
                                f"repository (no _name_or_path in its config.json), so only the shapes are checked")
                continue
            same = hub.split_id(base)[0].lower() == served.lower()
        elif base and (Path(base) / "config.json").is_file():
            same = _same_model(Path(base), model_dir)
        else:
            continue
        if not same:
            named = f" ({served})" if served and served != model_arg else ""
            raise AdapterError(f"adapter {name} ({adapter}) was trained on {base}, not on the served model "
                               f"{model_arg or model_dir}{named}: serve it with --model {base}")
    if len(repos) > 1:
        (a, base_a), (b, base_b) = list(repos.values())[:2]
        raise AdapterError(f"adapters {a} and {b} were trained on different base models ({base_a}, {base_b}): "
                           f"serve the adapters of each base from a server of their own")
    return warnings


def bank_modules(prepared, config) -> dict | None:
    """{module path: (A, B, scale)} of a prepared adapter (Model.prepare_adapter) for a bank, or None for one that
    changes the model beyond a LoRA term per linear module (DoRA, modules_to_save copies, a PiSSA / OLoRA
    residual, LoRA on a mixture of experts' experts, which the bank's per-row GEMMs do not route)."""
    if prepared.config.use_dora or prepared.copies or prepared.residual or any(map(is_expert_path, prepared.modules)):
        return None
    scales = prepared.config.module_scales(config)
    return {p: (t[0], t[1], scales[p]) for p, t in prepared.modules.items()}


class AdapterRegistry:
    """The served names (the base's and each adapter's), how each is prompted, and which the Model has on.
    Only the thread that owns the Model calls activate."""

    def __init__(self, model, base_name: str, base_style: PromptStyle = PromptStyle()):
        self.model = model
        self.base_name = base_name
        self.styles = {base_name: base_style}
        self.prepared: dict = {}        # adapter name -> Model.prepare_adapter's tensors
        self.active = base_name         # the model is loaded without an adapter
        self.switches = 0
        self.bank_index: dict = {}      # adapter name -> its index in the engine's bank (empty: no bank)

    def add(self, name: str, folder: Path, style: PromptStyle):
        """Read and check an adapter (AdapterError when it does not fit the model) and serve it as `name`."""
        if name in self.styles:
            raise ConfigError(f"--adapter {name}: the name is taken"
                              + (" by the base model (--served-model-name)" if name == self.base_name else ""))
        self.prepared[name] = self.model.prepare_adapter(folder)
        self.styles[name] = style

    def names(self) -> list[str]:
        """Every served name, the base's first."""
        return list(self.styles)

    def build_bank(self) -> bool:
        """Put every adapter in one bank on the engine, the model's own adapter off (its rows then run in one
        batch whatever their adapters), where each can join one and the engine takes banks (engine.adapter_banks:
        not pipeline stages); whether it did."""
        entries = [bank_modules(self.prepared[name], self.model.config) for name in self.prepared]
        if not entries or None in entries or not self.model.engine.adapter_banks:
            return False
        self.activate(self.base_name)
        self.model.engine.set_adapter_bank(build_bank(entries, lambda p: self.model.config.linear_shape(
            module_name(p))))
        self.bank_index = {name: k for k, name in enumerate(self.prepared)}
        return True

    def row_adapter(self, name: str) -> int:
        """A row's adapter in the bank (-1: the base)."""
        return self.bank_index.get(name, -1)

    def activate(self, name: str):
        """Put the adapter `name` (or the base alone) on the Model, unless it is on already."""
        if name == self.active:
            return
        if name == self.base_name:
            self.model.remove_adapter()
        else:
            self.model.use_adapter(self.prepared[name])
        self.active = name
        self.switches += 1
