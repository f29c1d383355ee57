#!/usr/bin/env python
"""Builds wgpu_train/assets/: the embedded default base model, its tokenizer and the instruction dataset.

Everything is generated here from one seed; nothing is downloaded. The recipe:

1. Task. "Reverse the order of these words: red fox moon" -> "moon fox red": 2-4 distinct words from the
   100-word list WORDS, asked in chat format; success is exact match of the greedy answer. Train / valid / test
   splits hold disjoint word tuples, so the held-out items test the rule, not memory.
2. Corpus. Plain-text documents that exercise the same skill in other surface forms ("reverse: a b c -> c b a",
   "words: a b c / reversed: c b a"), copies, and chat conversations of *other* instructions over the same
   words (repeat them, name the first word, name the last word, count them). The corpus never holds the
   reversal instruction in chat format, nor any word tuple of the valid or test splits.
3. Tokenizer. A byte-level BPE (tokenizers library) trained on a sample of the corpus and the train split, with
   the special tokens <|endoftext|>, <|im_start|>, <|im_end|> and a ChatML chat template.
4. Base model. A LlamaForCausalLM (config below) initialised from the seed and pretrained on the corpus with
   this project's own full fine-tuning (Model.set_full_finetune() + NumpyEngine.train_step, AdamW, warmup +
   cosine), documents packed into rows with attention that does not cross documents and positions from 0 in
   each. Every token carries loss except the randomly drawn word lists, which are unpredictable by design.
   What mattered in trials (same corpus, PyTorch as a quick stand-in for the NumPy engine): the copy /
   reversal skill appears after a plateau (~400-600 steps here); with tied input/output embeddings, or when
   attention could cross packed documents, it did not appear within 1000-3000 steps, and a peak lr of 3e-3
   escaped the plateau later than 1.5e-3. Including one-word lists (a pure previous-token copy) helps.
   With the defaults below the NumPy run is deterministic (OPENBLAS_NUM_THREADS=1): same seed, same bytes.
   LoRA margins measured once on the seed-0 model (NumPy engine, test exact match, from 0%): all-linear r8/a16
   lr 2e-3 batch 16: 60 steps 86%, 150 steps 100%; q_proj,v_proj 100 steps 100%; lr 1e-3 150 steps 97%;
   batch 8 100 steps 95%; lr 3e-3 40 steps 85%.
5. Check. Exact match of the base model on the test split (it knows the skill in plain text but not the
   instruction in chat format), and optionally (--lora-steps) the LoRA recipe of the default run on the NumPy
   engine, with exact match before and after.

The measured times and losses are written to <out>/README.md and <out>/build_info.json.

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 python tools/build_assets.py --seed 0 --steps 1200
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from wgpu_train.assets import TASK_DESCRIPTION, TASK_INSTRUCTION, WORDS
from wgpu_train.adapters.config import LoraConfig
from wgpu_train.models.config import ModelConfig
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.models.weights import save_model_folder
from wgpu_train.engines.loading import load_model
from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.engines.shared.labels import shift_labels
from wgpu_train.formats.tokenizer import load_tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
    " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TASK_LENGTHS = (2, 3, 4)          # words per task item
CORPUS_LENGTHS = (1, 2, 3, 4, 5, 6)  # words per corpus document: wider than the task, so the skill is general
# Chat instructions of the corpus (never the task's own): name -> (instruction, answer from the word list)
CORPUS_CHAT = {
    "repeat": ("Repeat these words:", lambda ws: " ".join(ws)),
    "first": ("What is the first word?", lambda ws: ws[0]),
    "last": ("What is the last word?", lambda ws: ws[-1]),
    "count": ("How many words are there?", lambda ws: str(len(ws))),
}
# Share of each document kind in the pretraining corpus.
CORPUS_MIX = {"reverse": 0.30, "reversed": 0.15, "copy": 0.10, "repeat": 0.15, "first": 0.10, "last": 0.12,
              "count": 0.08}


# ---- task and corpus -------------------------------------------------------------------------------------------

def task_record(words) -> dict:
    """One chat record of the task."""
    return {"messages": [{"role": "user", "content": f"{TASK_INSTRUCTION} {' '.join(words)}"},
                         {"role": "assistant", "content": " ".join(reversed(words))}]}


def sample_words(rng: np.random.Generator, lengths) -> tuple:
    n = int(rng.choice(lengths))
    return tuple(WORDS[i] for i in rng.choice(len(WORDS), size=n, replace=False))


def make_splits(rng: np.random.Generator, n_train: int, n_valid: int, n_test: int):
    """Train / valid / test records over disjoint word tuples."""
    seen: set = set()
    splits = []
    for n in (n_train, n_valid, n_test):
        items = []
        while len(items) < n:
            ws = sample_words(rng, TASK_LENGTHS)
            if ws not in seen:
                seen.add(ws)
                items.append(ws)
        splits.append(items)
    return splits


def render_chat(user: str, answer: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


def corpus_document(rng: np.random.Generator, held_out: set) -> tuple[str, tuple[int, int]]:
    """One pretraining document (without the end-of-text token) and the character span of its randomly drawn
    word list, which is unpredictable by construction and so carries no loss."""
    kinds = list(CORPUS_MIX)
    weights = np.array(list(CORPUS_MIX.values()))
    kind = kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]
    while True:
        ws = sample_words(rng, CORPUS_LENGTHS)
        if ws not in held_out:
            break
    x, r = " ".join(ws), " ".join(reversed(ws))
    if kind == "reverse":
        head, tail = "reverse: ", f" -> {r}"
    elif kind == "reversed":
        head, tail = "words: ", f"\nreversed:\n{r}"
    elif kind == "copy":
        head, tail = "copy: ", f" -> {x}"
    else:
        instruction, answer = CORPUS_CHAT[kind]
        text = render_chat(f"{instruction} {x}", answer(ws))
        head = text[:text.index(x)]
        tail = text[len(head) + len(x):]
    return head + x + tail, (len(head), len(head) + len(x))


# ---- tokenizer -------------------------------------------------------------------------------------------------

def train_tokenizer(texts, vocab_size: int, out: Path):
    """Byte-level BPE with the special tokens first; writes tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        "errors": "replace",
        "split_special_tokens": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok


# ---- base model ------------------------------------------------------------------------------------------------

def model_config(vocab_size: int, args) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,  # tied embeddings stalled on the copy tasks in trials
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def init_weights(cfg: ModelConfig, rng: np.random.Generator, std: float = 0.02) -> dict:
    """Normal(0, std) for embeddings, the LM head and linears (output projections scaled by 1/sqrt(2 L)), ones for norms."""
    from wgpu_train.models.config import LINEAR_MODULES
    from wgpu_train.models.weights import module_path

    w = {"model.embed_tokens.weight": rng.normal(0, std, (cfg.vocab_size, cfg.hidden_size)),
         "model.norm.weight": np.ones(cfg.hidden_size)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = rng.normal(0, std, (cfg.vocab_size, cfg.hidden_size))
    for i in range(cfg.num_hidden_layers):
        w[f"model.layers.{i}.input_layernorm.weight"] = np.ones(cfg.hidden_size)
        w[f"model.layers.{i}.post_attention_layernorm.weight"] = np.ones(cfg.hidden_size)
        for m in LINEAR_MODULES:
            s = std / math.sqrt(2 * cfg.num_hidden_layers) if m in ("o_proj", "down_proj") else std
            w[module_path(i, m) + ".weight"] = rng.normal(0, s, cfg.linear_shape(m))
    return {k: v.astype(np.float32) for k, v in w.items()}


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup to `peak`, then cosine decay to floor * peak; step counts from 1."""
    if step <= warmup:
        return peak * step / max(warmup, 1)
    t = (step - warmup) / max(total - warmup, 1)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


class PackedCorpus:
    """Endless stream of packed pretraining batches: documents (+ <|endoftext|>) laid one after another in rows
    of `row_len` tokens; each document is its own segment with positions from 0, as at inference."""

    def __init__(self, tokenizer, rng: np.random.Generator, held_out: set, eot_id: int, row_len: int):
        self.tok, self.rng, self.held_out, self.eot, self.row_len = tokenizer, rng, held_out, eot_id, row_len
        self.pending: list = []
        self.n_documents = 0

    def _next_doc(self) -> tuple[list, list]:
        """(token ids, whether each token is a target) of the next document, <|endoftext|> appended."""
        if not self.pending:
            docs = [corpus_document(self.rng, self.held_out) for _ in range(256)]
            encs = self.tok.encode_batch([d[0] for d in docs], add_special_tokens=False)
            for (_, (s, e)), enc in zip(docs, encs):
                trained = [not (a < e and b > s) for a, b in enc.offsets] + [True]  # overlaps the list
                self.pending.append((enc.ids + [self.eot], trained))
            self.pending.reverse()
        self.n_documents += 1
        return self.pending.pop()

    def batch(self, rows: int):
        """(ids int32, targets int64, segment_ids int32, position_ids int32), each (rows, row_len)."""
        shape = (rows, self.row_len)
        ids = np.zeros(shape, np.int32)
        targets = np.full(shape, IGNORE_INDEX, np.int64)
        seg = np.zeros(shape, np.int32)
        pos = np.zeros(shape, np.int32)
        carry = None
        for r in range(rows):
            at, s = 0, 0
            while True:
                doc, trained = carry if carry is not None else self._next_doc()
                carry = None
                doc, trained = doc[:self.row_len], trained[:self.row_len]
                if at + len(doc) > self.row_len:
                    carry = (doc, trained)
                    break
                n = len(doc)
                s += 1
                ids[r, at:at + n] = doc
                # position t predicts token t + 1 of the same document; the last token predicts nothing
                targets[r, at:at + n - 1] = np.where(trained[1:], doc[1:], IGNORE_INDEX)
                seg[r, at:at + n] = s
                pos[r, at:at + n] = np.arange(n)
                at += n
        if carry is not None:
            self.pending.append(carry)
        return ids, targets, seg, pos


def pretrain(model, corpus: PackedCorpus, args, log) -> dict:
    model.set_full_finetune()
    engine = model.engine
    losses, t0 = [], time.perf_counter()
    cpu0 = time.process_time()
    window: list = []
    for step in range(1, args.steps + 1):
        mb = corpus.batch(args.batch_size)
        hp = OptimizerParams(lr=lr_at(step, args.steps, args.lr, args.warmup), weight_decay=args.weight_decay,
                             max_grad_norm=1.0)
        loss_sum, count, norm, applied = engine.train_step([mb], hp, step)
        loss = loss_sum / max(count, 1)
        window.append(loss)
        if step % args.log_every == 0 or step == args.steps or step == 1:
            mean = float(np.mean(window))
            losses.append({"step": step, "loss": round(mean, 4), "lr": hp.lr, "grad_norm": round(float(norm), 3),
                           "elapsed_s": round(time.perf_counter() - t0, 1)})
            log(f"pretrain step {step:5d}/{args.steps}  loss {mean:.4f}  lr {hp.lr:.2e}  |g| {norm:.3f}  "
                f"{time.perf_counter() - t0:7.1f}s")
            window = []
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0, "log": losses,
            "documents": corpus.n_documents, "tokens_per_step": args.batch_size * args.row_len}


# ---- evaluation ------------------------------------------------------------------------------------------------

def exact_match(model, tokenizer, records, max_new_tokens: int = 12, chat: bool = True, show: int = 0, log=print):
    """Fraction of records whose greedy answer equals the reference after whitespace trimming."""
    hits = 0
    for k, rec in enumerate(records):
        user, ref = rec["messages"][0]["content"], rec["messages"][1]["content"]
        if chat:
            prompt = tokenizer.apply_chat_template(rec["messages"][:1], add_generation_prompt=True)
            stops = tokenizer.stop_token_ids
        else:  # the plain-text surface form of the corpus
            prompt = "reverse: " + user[len(TASK_INSTRUCTION) + 1:] + " ->"
            stops = [tokenizer.token_to_id("<|endoftext|>")]
        ids = tokenizer.encode(prompt)
        out = model.generate(ids, max_new_tokens=max_new_tokens, stop_token_ids=stops)
        text = tokenizer.decode(out, skip_special_tokens=True).strip()
        hits += text == ref.strip()
        if k < show:
            log(f"    {user!r} -> {text!r} (reference {ref!r})")
    return hits / max(len(records), 1)


def lora_check(model_dir: Path, data: dict, args, log) -> dict:
    """The default run's recipe on the NumPy engine: LoRA on the chat task, exact match before and after."""
    from wgpu_train.data.batching import make_batches
    from wgpu_train.data.tokenize import tokenize_dataset

    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, backend="numpy")
    test = data["test"]
    before = exact_match(model, tokenizer, test, show=3, log=log)
    log(f"  exact match before LoRA: {before:.1%}")
    examples, stats = tokenize_dataset(tokenizer, [r["messages"] for r in data["train"]], args.lora_max_seq_len)
    valid_ex, _ = tokenize_dataset(tokenizer, [r["messages"] for r in data["valid"]], args.lora_max_seq_len)
    model.add_lora(LoraConfig(r=args.lora_rank, alpha=args.lora_alpha, target_modules=args.lora_targets),
                   seed=args.seed)

    def valid_loss():
        total, count = 0.0, 0
        for b in make_batches(valid_ex, 32, np.random.default_rng(0), shuffle=False):
            s, c = model.engine.loss(b.input_ids, shift_labels(b.labels), b.segment_ids, b.position_ids)
            total, count = total + s, count + c
        return total / max(count, 1)

    v0 = valid_loss()
    t0 = time.perf_counter()
    step, epoch, log_rows, window = 0, 0, [], []
    warmup = max(1, int(round(args.lora_steps * 0.1)))
    while step < args.lora_steps:
        for b in make_batches(examples, args.lora_batch_size, np.random.default_rng([args.seed, epoch])):
            step += 1
            hp = OptimizerParams(lr=lr_at(step, args.lora_steps, args.lora_lr, warmup, floor=0.0), max_grad_norm=1.0)
            s, c, norm, _ = model.engine.train_step(
                [(b.input_ids, shift_labels(b.labels), b.segment_ids, b.position_ids)], hp, step)
            window.append(s / max(c, 1))
            if step % 25 == 0 or step == args.lora_steps:
                log_rows.append({"step": step, "loss": round(float(np.mean(window)), 4)})
                log(f"  lora step {step:4d}/{args.lora_steps}  loss {np.mean(window):.4f}  lr {hp.lr:.2e}  "
                    f"{time.perf_counter() - t0:6.1f}s")
                window = []
            if step >= args.lora_steps:
                break
        epoch += 1
    train_s = time.perf_counter() - t0
    v1 = valid_loss()
    t1 = time.perf_counter()
    after = exact_match(model, tokenizer, test, show=3, log=log)
    eval_s = time.perf_counter() - t1
    log(f"  exact match after LoRA: {after:.1%}; valid loss {v0:.3f} -> {v1:.3f}; train {train_s:.0f}s")
    return {"rank": args.lora_rank, "alpha": args.lora_alpha, "targets": args.lora_targets, "lr": args.lora_lr,
            "schedule": f"linear warmup {warmup} steps, cosine to 0", "batch_size": args.lora_batch_size,
            "steps": args.lora_steps, "max_seq_len": args.lora_max_seq_len, "train_examples": stats.n_examples,
            "mean_tokens_per_example": round(stats.n_tokens / max(stats.n_examples, 1), 1),
            "exact_match_before": before, "exact_match_after": after, "valid_loss_before": round(v0, 4),
            "valid_loss_after": round(v1, 4), "valid_ppl_before": round(math.exp(v0), 3),
            "valid_ppl_after": round(math.exp(v1), 3), "train_wall_s": round(train_s, 1),
            "eval_wall_s": round(eval_s, 1), "log": log_rows}


# ---- main ------------------------------------------------------------------------------------------------------

def write_jsonl(path: Path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def rebuild_command(args) -> str:
    """The command that rebuilds these assets in place: seed, steps and every other non-default option."""
    defaults = vars(parse_args([]))
    parts = ["python tools/build_assets.py", f"--seed {args.seed}", f"--steps {args.steps}"]
    for key, value in vars(args).items():
        if key not in ("out", "seed", "steps") and value != defaults[key]:
            parts.append(f"--{key.replace('_', '-')} {value}")
    return " ".join(parts)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "wgpu_train" / "assets", help="assets folder to write")
    p.add_argument("--seed", type=int, default=0, help="the one seed everything derives from")
    p.add_argument("--steps", type=int, default=1200, help="pretraining optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="pretraining rows per step")
    p.add_argument("--row-len", type=int, default=64, help="tokens per packed pretraining row")
    p.add_argument("--lr", type=float, default=1.5e-3, help="peak pretraining learning rate")
    p.add_argument("--warmup", type=int, default=100, help="pretraining warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay of pretraining")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=352)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=640,
                   help="BPE vocabulary limit (training stops earlier once every corpus word is one token)")
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-valid", type=int, default=100)
    p.add_argument("--n-test", type=int, default=100)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--lora-steps", type=int, default=150, help="steps of the LoRA check (0: skip it)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16)
    p.add_argument("--lora-targets", default="all-linear")
    p.add_argument("--lora-lr", type=float, default=2e-3)
    p.add_argument("--lora-batch-size", type=int, default=16)
    p.add_argument("--lora-max-seq-len", type=int, default=48)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    out: Path = args.out
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    # Independent streams, so that changing one part (e.g. the corpus size) leaves the others as they were.
    rng_data, rng_tok, rng_corpus, rng_init = (np.random.default_rng([args.seed, k]) for k in range(4))

    train, valid, test = make_splits(rng_data, args.n_train, args.n_valid, args.n_test)
    held_out = set(valid) | set(test)
    data = {name: [task_record(ws) for ws in items] for name, items in
            (("train", train), ("valid", valid), ("test", test))}
    log(f"dataset: {len(train)} train, {len(valid)} valid, {len(test)} test items")

    with tempfile.TemporaryDirectory() as tmp:
        init_dir = Path(tmp) / "init"
        tok_texts = [corpus_document(rng_tok, held_out)[0] for _ in range(20000)]
        tok_texts += [render_chat(r["messages"][0]["content"], r["messages"][1]["content"]) for r in data["train"]]
        backend_tok = train_tokenizer(tok_texts, args.vocab_size, init_dir)
        vocab = backend_tok.get_vocab_size()
        split = [w for w in WORDS if len(backend_tok.encode(" " + w).ids) != 1 or len(backend_tok.encode(w).ids) != 1]
        log(f"tokenizer: vocab {vocab}; words not a single token: {split or 'none'}")

        raw_cfg = model_config(vocab, args)
        cfg = ModelConfig.from_dict(raw_cfg)
        save_model_folder(init_dir, cfg, init_weights(cfg, rng_init))
        model = load_model(init_dir, backend="numpy")
        n_params = sum(int(np.prod(v.shape)) for v in model.engine.weights().values())
        log(f"model: {n_params:,} parameters; pretraining {args.steps} steps of {args.batch_size}x{args.row_len}")
        tokenizer = load_tokenizer(init_dir)
        corpus = PackedCorpus(backend_tok, rng_corpus, held_out, tokenizer.token_to_id("<|endoftext|>"), args.row_len)
        pre = pretrain(model, corpus, args, log)

        model_dir = out / "model"
        if model_dir.exists():
            shutil.rmtree(model_dir)
        model.save_pretrained(model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 0, "do_sample": False}, indent=2) + "\n")
    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, records in data.items():
        write_jsonl(data_dir / f"{name}.jsonl", records)
    log(f"wrote {model_dir} ({(model_dir / 'model.safetensors').stat().st_size / 1e6:.2f} MB) and {data_dir}")

    base = load_model(model_dir, backend="numpy")
    tokenizer = load_tokenizer(model_dir)
    log("base model, plain-text form 'reverse: ... ->' on the test items:")
    plain = exact_match(base, tokenizer, data["test"], chat=False, show=3, log=log)
    log(f"  exact match {plain:.1%}")
    log("base model, chat instruction on the test items:")
    chat = exact_match(base, tokenizer, data["test"], show=3, log=log)
    log(f"  exact match {chat:.1%}")

    lora = None
    if args.lora_steps > 0:
        log(f"LoRA check: {args.lora_steps} steps")
        lora = lora_check(model_dir, data, args, log)

    info = {
        "command": rebuild_command(args),
        "seed": args.seed, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "task": TASK_DESCRIPTION, "corpus_mix": CORPUS_MIX, "vocab_size": vocab, "parameters": n_params,
        "model_config": raw_cfg,
        "safetensors_bytes": (model_dir / "model.safetensors").stat().st_size,
        "pretrain": {k: (round(v, 1) if isinstance(v, float) else v) for k, v in pre.items()},
        "base_exact_match_plain_form": plain, "base_exact_match_chat": chat, "lora_check": lora,
        "total_wall_s": round(time.perf_counter() - t_start, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
                   f"NumPy {np.__version__}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}",
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "README.md").write_text(render_readme(info))
    log(f"done in {info['total_wall_s']:.0f}s; see {out / 'README.md'}")
    return info


def render_readme(info: dict) -> str:
    pre, c, lora = info["pretrain"], info["model_config"], info["lora_check"]
    first, last = pre["log"][0], pre["log"][-1]
    lines = [
        "# Embedded default: base model, tokenizer and dataset",
        "",
        "Generated by `tools/build_assets.py` (the recipe is in its docstring); nothing here is downloaded.",
        "Rebuild with",
        "",
        "```",
        "OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 " + info["command"],
        "```",
        "",
        f"- **Task** ({'data/'}): {info['task']}",
        f"- **Splits**: data/train.jsonl {info['args']['n_train']}, data/valid.jsonl {info['args']['n_valid']}, "
        f"data/test.jsonl {info['args']['n_test']} chat records (`{{\"messages\": [...]}}`), disjoint word tuples.",
        "- **Corpus** (generated while pretraining, never stored): documents mixing "
        + ", ".join(f"{k} {v:.0%}" for k, v in info["corpus_mix"].items())
        + "; `reverse: a b c -> c b a` and `words: a b c\\nreversed:\\nc b a` in plain text, `copy: a b c -> a b c`, "
        "and ChatML conversations of other instructions (`Repeat these words:`, `What is the first word?`, "
        "`What is the last word?`, `How many words are there?`) over 1-6 words; never the task's instruction, never a "
        "valid or test word tuple.",
        f"- **Tokenizer** (model/tokenizer.json): byte-level BPE, vocabulary {info['vocab_size']}, special tokens "
        "`<|endoftext|>` (0, pad), `<|im_start|>` (1), `<|im_end|>` (2, eos); ChatML chat template.",
        f"- **Model** (model/): LlamaForCausalLM, hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"{c['num_attention_heads']} heads ({c['num_key_value_heads']} KV heads, head dim {c['head_dim']}), "
        f"MLP {c['intermediate_size']}, {'tied' if c['tie_word_embeddings'] else 'untied'} embeddings, "
        f"{info['parameters']:,} parameters, "
        f"{info['safetensors_bytes'] / 1e6:.2f} MB float32 safetensors.",
        f"- **Pretraining**: full fine-tuning from a seeded random init (seed {info['seed']}) with this project's "
        f"NumPy engine: {info['args']['steps']} AdamW steps of {info['args']['batch_size']} packed rows x "
        f"{info['args']['row_len']} tokens ({pre['documents']:,} generated documents), peak lr {info['args']['lr']}, "
        f"warmup {info['args']['warmup']} then cosine to 10%, weight decay {info['args']['weight_decay']}, "
        f"gradient clipping 1.0. Loss {first['loss']:.3f} (step 1) -> {last['loss']:.3f} (mean of the last "
        f"{info['args']['log_every']} steps), over every token except the randomly drawn word lists.",
        f"- **Time**: pretraining {pre['wall_s'] / 60:.1f} min wall ({pre['cpu_s'] / 60:.1f} min CPU), whole build "
        f"{info['total_wall_s'] / 60:.1f} min on {info['machine']}.",
        f"- **Base model on the test split**: {info['base_exact_match_plain_form']:.0%} exact match in the "
        f"corpus's plain form (`reverse: a b c ->`), {info['base_exact_match_chat']:.0%} for the chat instruction.",
    ]
    if lora:
        lines.append(
            f"- **LoRA check** (NumPy engine): rank {lora['rank']}, alpha {lora['alpha']}, targets "
            f"{lora['targets']}, lr {lora['lr']} ({lora['schedule']}), batch {lora['batch_size']}, "
            f"{lora['steps']} steps, max_seq_len {lora['max_seq_len']}: test exact match "
            f"{lora['exact_match_before']:.0%} -> {lora['exact_match_after']:.0%}, validation perplexity "
            f"{lora['valid_ppl_before']:.2f} -> {lora['valid_ppl_after']:.3f}; {lora['train_wall_s']:.0f} s of "
            f"training, {lora['eval_wall_s']:.1f} s of greedy evaluation of the test split.")
    lines += ["", "Measured values, the full configuration and the loss curves are in build_info.json.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
