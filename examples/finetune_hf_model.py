"""Fine-tune any Hugging Face model folder you have (e.g. SmolLM2-135M-Instruct, Qwen2.5-0.5B-Instruct,
downloaded beforehand with `huggingface-cli download`) on a JSONL chat dataset, and save a PEFT adapter.

    python examples/finetune_hf_model.py --model ~/models/Qwen2.5-0.5B-Instruct --data my_chats.jsonl

With --base-dtype nf4 (or nf4-dq) it is QLoRA: the frozen weights (the embedding and lm_head then in
float16) take about a quarter of their float32 memory on the GPU.
"""
import argparse

import wgpu_train as wt


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--data", required=True, help="JSONL file or folder with train.jsonl (and valid.jsonl)")
    parser.add_argument("--out", default="finetuned-adapter", help="output folder")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--base-dtype", default="float32", choices=wt.BASE_DTYPES,
                        help="storage of the frozen linear weights")
    parser.add_argument("--embed-dtype", default="auto", choices=wt.EMBED_CHOICES,
                        help="storage of the embedding and lm_head (auto: float16 unless the base is float32)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out")
    args = parser.parse_args()

    config = wt.TrainConfig(
        model=args.model, data=args.data, out=args.out, backend=args.backend, max_steps=args.max_steps,
        max_seq_len=args.max_seq_len, overwrite=args.overwrite,
        base_dtype=args.base_dtype, embed_dtype=args.embed_dtype,
        lora_rank=16, lora_alpha=32, lora_targets="all-linear",   # adapt every linear layer
        lr=2e-4, lr_schedule="cosine", warmup_steps=min(10, args.max_steps - 1) if args.max_steps else 10,
        batch_size=2, grad_accum=4,                               # 8 samples per optimizer step
        eval_generate=False, no_progress=True,
    )
    summary = wt.finetune(config)
    print(f"{summary['steps']} steps, {summary['tokens_per_s']:.0f} tokens/s; validation perplexity "
          f"{summary['valid_perplexity_before']:.2f} -> {summary['valid_perplexity_after']:.2f}")
    print(f"PEFT adapter written to {args.out}/ (load it with peft.PeftModel.from_pretrained)")


if __name__ == "__main__":
    main()
