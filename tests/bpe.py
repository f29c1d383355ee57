"""A byte-level BPE trained in the test itself (nothing downloaded), with the ChatML special tokens."""
from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# ids 0, 1, 2 in this order: the tiny transformers configs name bos_token_id=1 and eos_token_id=2.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_bpe(corpus, vocab_size: int, specials=SPECIALS) -> Tokenizer:
    """A byte-level BPE (offsets stay meaningful) trained on corpus (repeated three times), whose first ids are
    the `specials` (default: ChatML's; Llama/Mistral-like vocabularies pass ["<unk>", "<s>", "</s>", ...])."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus) * 3, trainer)
    return tok


def tokenizer_folder(path, backend: Tokenizer, template: str, **special):
    """A tokenizer folder as transformers reads it: tokenizer.json, and tokenizer_config.json with the chat
    template and the special tokens (eos and pad <|endoftext|> unless `special` names others)."""
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": template, **special}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
