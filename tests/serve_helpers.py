"""What the server's tests share: a tiny model's random adapters, the generate path's answers as the reference,
and one request of each kind through the openai client."""
from __future__ import annotations

import numpy as np

import wgpu_train as wt
from wgpu_train.cli.commands import prompt_ids
from wgpu_train.formats.tokenizer import load_tokenizer

KEY = "sk-test-key"
QUESTIONS = ["after red 1?", "after cat 3?", "after moon 6?", "after tree 7?"]
NAMES = ("base", "a", "b")


def save_adapter(model_dir, out, seed: int, r: int = 4, targets="all-linear"):
    """A random LoRA (B nonzero, so it changes the answers) saved as a PEFT adapter of the model in model_dir."""
    model = wt.load_model(model_dir, backend="numpy")
    lora = wt.LoraConfig(r=r, alpha=16, target_modules=targets)
    model.add_lora(lora, seed=seed)
    rng = np.random.default_rng(seed)
    model._set_lora(lora, {p: (a, rng.normal(0, 0.3, b.shape).astype(np.float32))
                           for p, (a, b) in model.engine.lora_tensors().items()})
    model.save_adapter(out)
    return out


def served_files(root):
    """A tiny model in root/model and two of its adapters, a (seed 2) and b (seed 5), as the serve tests serve
    them."""
    from types import SimpleNamespace

    from finetune_helpers import make_model_dir

    model_dir = make_model_dir(root / "model")
    return SimpleNamespace(model=model_dir, a=save_adapter(model_dir, root / "a", 2),
                           b=save_adapter(model_dir, root / "b", 5), root=root)


class Reference:
    """Answers as the generate path computes them: the model with the adapter loaded from its folder."""

    def __init__(self, files):
        self.tok = load_tokenizer(files.model)
        self.models = {name: wt.load_model(files.model, backend="numpy") for name in NAMES}
        self.models["a"].load_adapter(files.a)
        self.models["b"].load_adapter(files.b)
        self.stops = set(self.tok.stop_token_ids)

    def answer(self, name: str, ids: list, max_tokens: int, **sampling) -> tuple:
        """(text, completion tokens, finish reason)."""
        new = self.models[name].generate(ids, max_new_tokens=max_tokens, stop_token_ids=self.tok.stop_token_ids,
                                         **sampling)
        text = self.tok.decode([t for t in new if t not in self.stops])
        return text, len(new), "stop" if new[-1] in self.stops else "length"

    def chat(self, name, question, max_tokens=10, **sampling):
        return self.answer(name, prompt_ids(self.tok, question), max_tokens, **sampling)

    def text(self, name, prompt, max_tokens=10, **sampling):
        return self.answer(name, self.tok.encode(prompt), max_tokens, **sampling)


def ask(client, kind: str, name: str, prompt: str, max_tokens: int = 10, **kw) -> tuple:
    """(text, completion tokens, finish reason) of one request of `kind`: chat / chat_stream / text / text_stream."""
    if kind == "chat":
        r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_tokens, **kw)
        return r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason
    if kind == "text":
        r = client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, **kw)
        return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason
    chat = kind == "chat_stream"
    create = client.chat.completions.create if chat else client.completions.create
    what = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    pieces, finish, usage = [], None, None
    for chunk in create(model=name, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
                        **what, **kw):
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
            continue
        choice = chunk.choices[0]
        pieces.append((choice.delta.content if chat else choice.text) or "")
        finish = choice.finish_reason or finish
    return "".join(pieces), usage.completion_tokens, finish


def expected(ref, kind, name, prompt, max_tokens=10, **sampling):
    return (ref.chat if kind.startswith("chat") else ref.text)(name, prompt, max_tokens, **sampling)
