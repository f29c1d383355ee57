"""What generate, eval and merge take from the run that trained an adapter: the settings the command line
leaves out (its train_config.json, or a checkpoint's trainer_state.json), the validation split it held out, and
the base model it implies; and
loading that model with the adapter, in one process or as pipeline stages (closed by closing_stages)."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

from wgpu_train.adapters.files import adapter_base_model

# What generate / eval use for a setting that neither the command line nor the adapter's run decides.
FALLBACKS = {"base_dtype": "auto", "embed_dtype": "auto", "no_chat_template": False, "train_on_last_turn": False,
             "max_seq_len": 512}
_SETTING_TYPES = {"base_dtype": str, "embed_dtype": str, "no_chat_template": bool, "train_on_last_turn": bool,
                  "max_seq_len": int}


def _read_json_object(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def run_config_path(adapter_path) -> Path:
    """The train_config.json of the run that wrote an adapter folder (an output folder's own, or for a
    checkpoint's adapter/ its run's)."""
    adapter = Path(adapter_path)
    if (adapter.parent / "trainer_state.json").is_file():
        from wgpu_train.training.run_folder import run_folder

        return run_folder(adapter.parent) / "train_config.json"
    return adapter / "train_config.json"


def trained_settings(adapter_path) -> dict:
    """The settings in FALLBACKS that the run which wrote an adapter folder used: its train_config.json (an
    output folder), or for a checkpoint's adapter/ the checkpoint's trainer_state.json (the storage dtypes)
    over its run's train_config.json; only those recorded with the right type."""
    adapter = Path(adapter_path)
    checkpoint = adapter.parent
    sources = [run_config_path(adapter)]
    if (checkpoint / "trainer_state.json").is_file():
        sources.append(checkpoint / "trainer_state.json")
    found = {}
    for path in sources:
        found.update(_read_json_object(path))
    return {k: found[k] for k, kind in _SETTING_TYPES.items()
            if isinstance(found.get(k), kind) and (kind is not int or not isinstance(found[k], bool))}


def trained_data_format(adapter_path) -> str | None:
    """The data format the run that wrote an adapter folder trained on ("completions", "chat", ...), if known."""
    return trained_run_config(adapter_path).get("data_format")


def trained_run_config(adapter_path) -> dict:
    """The train_config.json of the run that wrote an adapter folder, as recorded ({} when there is none)."""
    return _read_json_object(run_config_path(adapter_path))


def held_out_split(adapter_path) -> tuple[float, int]:
    """(valid_split, seed): how the run that wrote an adapter folder held validation data out of data without a
    validation split (TrainConfig's defaults without an adapter, or for what its train_config.json does not
    record), so that eval --split valid finds the same records."""
    from wgpu_train.training.config import TrainConfig

    defaults = TrainConfig()
    run = trained_run_config(adapter_path) if adapter_path is not None else {}
    fraction, seed = run.get("valid_split"), run.get("seed")
    if not (isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 <= fraction < 1):
        fraction = defaults.valid_split
    if not (isinstance(seed, int) and not isinstance(seed, bool)):
        seed = defaults.seed
    return float(fraction), seed


def _option(name: str, value) -> str:
    """How the command line spells a setting's value (e.g. --base-dtype nf4, --no-chat-template)."""
    flag = "--" + name.replace("_", "-")
    return flag if value is True else f"{flag} {value}"


def _as_used(settings: dict, checkpoint_dtype: str) -> dict:
    """settings with base_dtype and embed_dtype "auto" resolved as the engines resolve them over a checkpoint of
    that dtype."""
    from wgpu_train.engines.shared.quant import check_dtypes

    base, embed = check_dtypes(settings["base_dtype"], settings["embed_dtype"], checkpoint_dtype)
    return {**settings, "base_dtype": base, "embed_dtype": embed}


def choose_settings(given: dict, adapter_path, model_dir) -> dict:
    """`given` (setting -> its command-line value, None when not given; base_dtype and embed_dtype among them)
    with each missing value taken from the run that trained the adapter (trained_settings), else from
    FALLBACKS. One line on stderr names what the run decided where that differs from what would apply
    without it over the model in model_dir."""
    from wgpu_train.models.config import ModelConfig

    checkpoint_dtype = ModelConfig.from_folder(model_dir).checkpoint_dtype
    trained = trained_settings(adapter_path) if adapter_path is not None else {}
    chosen = {k: v if v is not None else trained.get(k, FALLBACKS[k]) for k, v in given.items()}
    used = _as_used(chosen, checkpoint_dtype)
    plain = _as_used({k: v if v is not None else FALLBACKS[k] for k, v in given.items()}, checkpoint_dtype)
    taken = [_option(k, chosen[k]) for k in given if given[k] is None and k in trained and used[k] != plain[k]]
    if taken:
        print(f"settings of the run that trained the adapter (options given here win): {', '.join(taken)}",
              file=sys.stderr)
    return chosen


def model_folder(model_arg, adapter: Path | None) -> Path:
    """--model (a folder or hub id), else the adapter's base model (a folder on this machine or a hub id), else
    the embedded model."""
    from wgpu_train.formats import hub
    from wgpu_train.training.config import default_model_dir

    return hub.resolve(model_arg, "model") if model_arg else (adapter and adapter_base_model(adapter)) or default_model_dir()


def load_model_and_tokenizer(model_dir: Path, adapter: Path | None, backend="auto", device=None, tokenizer=True,
                             base_dtype="auto", embed_dtype="auto", kv_dtype="float32", stages=None):
    """(Model with the adapter loaded, Tokenizer or None) for generate / eval / chat / serve / merge; kv_dtype: the
    storage of generation's KV cache (engine.kv_dtype); stages: options.StageOptions, the model loaded as those
    pipeline stages (distributed/pipeline_model.py; said in one line on stderr), whose end is closing_stages'.
    Backend auto's choice is said in one line on stderr."""
    from wgpu_train.engines.loading import load_model
    from wgpu_train.formats.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir) if tokenizer else None
    if stages is None:
        model = load_model(model_dir, backend=backend, device=device, base_dtype=base_dtype, embed_dtype=embed_dtype,
                           kv_dtype=kv_dtype)
    else:
        model = _staged_model(model_dir, stages, backend, device, base_dtype, embed_dtype, kv_dtype)
    if backend == "auto":           # stderr: generate's answer alone is on stdout
        print(f"backend: {model.backend} ({model.backend_reason})", file=sys.stderr)
    if adapter is not None:
        try:
            model.load_adapter(adapter)
        except BaseException:
            close_stages(model)
            raise
    return model, tok


def _staged_model(model_dir: Path, stages, backend, device, base_dtype, embed_dtype, kv_dtype):
    """The Model as the pipeline stages `stages` asks for (inference_plan's split), each on its --device."""
    from wgpu_train.distributed.pipeline_model import inference_plan, pipeline_model, stage_devices
    from wgpu_train.models.config import ModelConfig

    config = ModelConfig.from_folder(model_dir)
    plan = inference_plan(config, stages.count, stages.layers, base_dtype, embed_dtype)
    model = pipeline_model(model_dir.resolve(), config, plan, backend=backend,
                           devices=stage_devices(device, len(plan)), base_dtype=base_dtype, embed_dtype=embed_dtype,
                           kv_dtype=kv_dtype, address=stages.ray_address)
    print(f"pipeline: {len(plan)} stages (layers {plan.describe()}) as Ray actors", file=sys.stderr)
    return model


def close_stages(model):
    """End the pipeline stages `model` runs on, if any: their Ray actors, and a Ray this process started."""
    from wgpu_train.distributed.pipeline_engine import PipelineEngine

    if isinstance(model.engine, PipelineEngine):
        model.engine.close()


@contextmanager
def closing_stages(model):
    """Run the block, then close_stages(model), however it ends (an error or Ctrl-C too)."""
    try:
        yield model
    finally:
        close_stages(model)
