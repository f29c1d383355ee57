"""`wgpu-train merge`: a LoRA adapter folded into its base model's original weights, written as a Hugging Face
folder in the base checkpoint's dtype (or --dtype's), and optionally as a GGUF file; everything the command can
refuse is refused before anything is written."""
from __future__ import annotations

from pathlib import Path

from wgpu_train.cli.adapter_settings import load_model_and_tokenizer, model_folder
from wgpu_train.cli.options import add_parser, model_options
from wgpu_train.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _model_files(folder: Path) -> list[str]:
    """The files of a model or adapter folder (config.json, *.safetensors, their index, adapter_config.json)
    and of a run (see run_folder.earlier_run) that `folder` holds, sorted."""
    from wgpu_train.training.run_folder import earlier_run

    if not folder.is_dir():
        return []
    try:
        found = [p.name for p in folder.iterdir()
                 if p.name in ("config.json", "adapter_config.json") or p.name.endswith((".safetensors",
                                                                                        ".safetensors.index.json"))]
    except OSError as e:
        raise ConfigError(f"cannot read {folder}: {e.strerror or e}") from None
    return sorted(set(found) | set(earlier_run(folder)))


def _remove_model_files(folder: Path):
    """Remove what a loader could take for part of the merged model: its weights (model.safetensors, the
    model-*.safetensors shards and their index), config.json, an adapter and tokenizer files (the base
    model's are copied again). Other files stay."""
    from wgpu_train.formats.tokenizer import TOKENIZER_FILES

    names = ("config.json", "model.safetensors", "model.safetensors.index.json", "adapter_config.json",
             "adapter_model.safetensors", *TOKENIZER_FILES)
    for p in folder.iterdir():
        if p.is_file() and (p.name in names or p.name.startswith("model-") and p.name.endswith(".safetensors")):
            p.unlink()


def cmd_merge(args) -> int:
    # Merging is weight arithmetic: the NumPy engine does it without a device. The update goes onto the
    # original weights, also for an adapter trained over float16 / NF4 ones (as PEFT merges a QLoRA
    # adapter into a 16-bit base): the merged folder carries no rounding of the base but --dtype's.
    from wgpu_train.adapters.files import adapter_folder
    from wgpu_train.models.config import ModelConfig
    from wgpu_train.models.weights import checkpoint_float_dtype

    adapter = adapter_folder(args.adapter_path)
    model_dir = model_folder(args.model, adapter)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    for what, folder in (("base model", model_dir), ("adapter", adapter)):
        if out.resolve() == folder.resolve():
            raise ConfigError(f"--out must differ from the {what} folder {folder}")
    found = _model_files(out)
    if found and not args.overwrite:
        raise ConfigError(f"--out {out} already holds {', '.join(found)}; pass --overwrite to replace the model "
                          f"files in it, or choose another --out")
    config = ModelConfig.from_folder(model_dir)
    dtype = checkpoint_float_dtype(model_dir, config) if args.dtype == "auto" else args.dtype
    gguf_file = Path(args.gguf) if args.gguf else None
    if gguf_file is not None:               # everything a GGUF needs is checked before anything is written
        from wgpu_train.models import gguf_export

        if gguf_file.exists() and not args.overwrite:
            raise ConfigError(f"--gguf {gguf_file} exists; pass --overwrite to replace it, or choose another file")
        gguf_export.check(config, args.gguf_type)
        gguf_export.tokenizer_fields(model_dir)
    model, _ = load_model_and_tokenizer(model_dir, adapter, backend="numpy", tokenizer=False,
                                        base_dtype="float32", embed_dtype="float32")
    try:
        if found:
            _remove_model_files(out)
        merged = model.merge_and_save(out, dtype)
        if gguf_file is not None:
            gguf_export.write_gguf(gguf_file, model.config, merged, out, args.gguf_type)
    except OSError as e:
        raise ConfigError(f"cannot write {out}: {e.strerror or e}") from None
    print(f"wrote the merged model to {out} ({dtype})" + (f" and {gguf_file} ({args.gguf_type})" if gguf_file else ""))
    return 0


def register(sub):
    p = add_parser(sub, "merge", "fold a LoRA adapter into its base model's original weights and write a Hugging "
                                  "Face folder")
    model_options(p, need_adapter=True)
    p.add_argument("--out", required=True, metavar="DIR",
                   help="folder for the merged model; one that holds a model, an adapter or a run is refused "
                        "unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an --out that holds a model, an adapter or a run: its model weights (shards "
                        "and index included), config.json, adapter and tokenizer files are removed first, so that "
                        "the model in it is exactly the merged one; other files stay")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="storage of the merged weights, which are computed in float32 and rounded once; auto: the "
                        "base checkpoint's (config.json's torch_dtype, else its weights'), as PEFT's "
                        "merge_and_unload keeps the model's dtype (default: auto)")
    p.add_argument("--gguf", default=None, metavar="FILE",
                   help="also write the merged model as one GGUF file for llama.cpp / Ollama (Llama, Mistral, Qwen2, "
                        "Qwen3, the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, and the hybrid SmolLM3, "
                        "LFM2, Qwen3.5, Qwen3.5-MoE, Qwen3-Next; byte-level BPE tokenizers), tokenizer and chat "
                        "template included; needs pip install 'wgpu-train[gguf]'")
    p.add_argument("--gguf-type", default="f16", choices=("f32", "f16", "q8_0"),
                   help="storage of the GGUF's matrices (default: f16; norms and biases stay f32), whatever --dtype")
    p.set_defaults(func=cmd_merge)
