"""Fold a LoRA adapter into its base model and write a complete Hugging Face folder
(loadable by transformers.AutoModelForCausalLM.from_pretrained), then check it gives the same logits.

    python examples/merge_and_export.py --adapter wgpu-train-out --out merged-model
"""
import argparse

import numpy as np

import wgpu_train as wt
from wgpu_train.assets import default_model_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(default_model_dir()), help="base Hugging Face model folder")
    parser.add_argument("--adapter", required=True, help="PEFT adapter folder")
    parser.add_argument("--out", required=True, help="folder for the merged model")
    args = parser.parse_args()

    model = wt.load_model(args.model, backend="numpy")
    model.load_adapter(args.adapter)
    model.merge_and_save(args.out)

    merged = wt.load_model(args.out, backend="numpy")
    ids = np.arange(1, 17)[None] % model.config.vocab_size
    diff = float(np.abs(merged.logits(ids) - model.logits(ids)).max())
    print(f"merged model written to {args.out}/; max logit difference to base + adapter: {diff:.2e}")


if __name__ == "__main__":
    main()
