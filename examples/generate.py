"""Generate text with a model and, optionally, a LoRA adapter (streaming tokens as they come).

    python examples/generate.py --adapter wgpu-train-out --prompt "Reverse the order of these words: cat sun"
"""
import argparse
import sys

import wgpu_train as wt
from wgpu_train.assets import default_model_dir
from wgpu_train.formats.tokenizer import StreamDecoder


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(default_model_dir()), help="Hugging Face model folder")
    parser.add_argument("--adapter", default=None, help="PEFT adapter folder")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 for greedy decoding")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()

    model = wt.load_model(args.model, backend=args.backend)
    if args.adapter:
        model.load_adapter(args.adapter)
    tokenizer = wt.load_tokenizer(args.model)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    stream = StreamDecoder(tokenizer)

    def show(token_id):
        sys.stdout.write(stream.push(token_id))
        sys.stdout.flush()

    model.generate(tokenizer.encode(prompt), max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   seed=args.seed, stop_token_ids=tokenizer.stop_token_ids, on_token=show)
    sys.stdout.write(stream.flush() + "\n")


if __name__ == "__main__":
    main()
