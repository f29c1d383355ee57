#!/usr/bin/env python
"""Builds wgpu_train/assets/vision_model/: the embedded image demo's tiny Gemma 3 vision-language model
(Gemma3ForConditionalGeneration), which `wgpu-train finetune --images-demo` fine-tunes.

The recipe, from one seed, nothing downloaded:

1. Tokenizer. A word-level vocabulary (tokenizers' WordLevel, whitespace pre-tokenizer): Gemma 3's special tokens
   (<bos>, <eos>, <start_of_turn>, <end_of_turn>, <start_of_image>, <end_of_image>, <image_soft_token>) and the
   demo's words (data/vision_demo.py: the question's and the colours'), with a Gemma-3-style chat template of this
   project's own (turns `<start_of_turn>user` / `<start_of_turn>model`, an image part written as <start_of_image>,
   which the processor expands).
2. Model. transformers' Gemma3ForConditionalGeneration at its own random initialisation with initializer_range
   --init (0.15; the projector's projection, which transformers starts at zero, drawn with the same deviation):
   a tiny text model (2 layers, hidden 64) and a one-layer SigLIP tower (32x32 images, 8x8 patches, 4 image
   tokens after the projector's pooling), saved in float32 with the processor's preprocessor_config.json. The
   model knows nothing: the demo's LoRA (recipe.toml's [images_demo]) teaches it to name the square's colour from
   the frozen tower's features, exact match from 0%. What mattered: at transformers' 0.02 the tied embeddings are
   so small that no logit can stand out (the loss stayed near 2.3 nats), and with the projection at zero no
   image reaches the text (the loss stayed at the colours' entropy, 20% exact match).
3. Check (--check): the demo's run on the NumPy engine, exact match before and after.

    OPENBLAS_NUM_THREADS=1 python tools/build_vision_demo.py --seed 0 --init 0.15 [--check]

transformers and torch are needed here only (the build), never at run time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from wgpu_train.data.vision_demo import COLOURS, QUESTION  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
            "<end_of_image>", "<image_soft_token>"]
BOI, EOI, IMAGE = 6, 7, 8
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) "
    "+ '\\n' }}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{% if p.type == "
    "'image' %}{{ '<start_of_image>' }}{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
IMAGE_SIZE, PATCH = 32, 8


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["user", "model", "system", *QUESTION.replace("?", " ?").split(), *COLOURS]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(SPECIALS + words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": TEMPLATE,
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"}}, indent=2))
    return len(vocab)


def build_model(out: Path, vocab: int, seed: int, init: float):
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    text = tf.Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
                               sliding_window=32, layer_types=["sliding_attention", "full_attention"],
                               pad_token_id=0, eos_token_id=1, bos_token_id=2, initializer_range=init,
                               query_pre_attn_scalar=32)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=IMAGE_SIZE, patch_size=PATCH)
    cfg = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE,
                          initializer_range=init, tie_word_embeddings=True)
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():       # transformers starts the projection at zero: no image would reach the text
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, init)
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": [1, 5],
                                                            "pad_token_id": 0}, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_resize": True, "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}, indent=2))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "wgpu_train" / "assets" / "vision_model"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", type=float, default=0.15, help="the random initialisation's standard deviation")
    p.add_argument("--check", action="store_true", help="then run the demo on the embedded model (the default --out): exact match before/after")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build_model(out, build_tokenizer(out), args.seed, args.init)
    for extra in ("chat_template.jinja", "processor_config.json"):     # ours: the template in tokenizer_config
        (out / extra).unlink(missing_ok=True)
    print(f"wrote {out}: " + ", ".join(f"{f.name} {f.stat().st_size:,} B" for f in sorted(out.iterdir())))
    if args.check:              # the demo as `wgpu-train finetune --images-demo` runs it (its recipe)
        import tempfile

        from wgpu_train.cli.main import main as cli

        with tempfile.TemporaryDirectory() as tmp:
            cli(["finetune", "--images-demo", "--out", tmp, "--overwrite", "--no-progress"])
            summary = json.loads((Path(tmp) / "summary.json").read_text())
        print(json.dumps({k: summary[k] for k in ("exact_match_before", "exact_match_after", "train_time_s")}))


if __name__ == "__main__":
    main()
