"""Quickstart: LoRA fine-tune the embedded model on its embedded task through the Python API, then ask it.

    python examples/quickstart.py                 # the full default run (a few minutes on a software GPU)
    python examples/quickstart.py --max-steps 5   # a smoke test
    python examples/quickstart.py --overwrite     # again into the same folder, replacing the earlier run
"""
import argparse

import wgpu_train as wt
from wgpu_train.assets import TASK_INSTRUCTION, default_model_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="wgpu-train-out", help="output folder")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    parser.add_argument("--backend", default="auto", help="auto, wgpu or numpy")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out")
    args = parser.parse_args()

    overrides = {"max_steps": args.max_steps} if args.max_steps else {}
    # the embedded model, dataset and LoRA recipe: what `wgpu-train finetune` with no option runs
    summary = wt.finetune(wt.default_run_config(out=args.out, backend=args.backend, no_progress=True,
                                                overwrite=args.overwrite, **overrides))
    print(f"validation perplexity {summary['valid_perplexity_before']:.2f} -> {summary['valid_perplexity_after']:.2f}")
    if summary.get("exact_match_after") is not None:
        print(f"exact match {summary['exact_match_before']:.0%} -> {summary['exact_match_after']:.0%}")

    model = wt.load_model(default_model_dir(), backend=args.backend)
    model.load_adapter(args.out)
    tokenizer = wt.load_tokenizer(default_model_dir())
    question = f"{TASK_INSTRUCTION} red fox moon"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    answer = model.generate(tokenizer.encode(prompt), max_new_tokens=16, stop_token_ids=tokenizer.stop_token_ids)
    print(f"{question}\n-> {tokenizer.decode(answer)}")


if __name__ == "__main__":
    main()
