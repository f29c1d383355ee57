"""The "wgpu-train" model of lm_eval's registry: loglikelihood, loglikelihood_rolling and generate_until over a
Model on either engine, with or without a LoRA adapter, tokenized as lm_eval's Hugging Face backend does."""
from __future__ import annotations

import json
from pathlib import Path

import lm_eval.models  # noqa: F401 - lm_eval's own names first: get_model fills the registry only while it is empty
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from wgpu_train.adapters.files import adapter_base_model, adapter_folder
from wgpu_train.engines.loading import load_model
from wgpu_train.errors import ConfigError, DataError
from wgpu_train.formats import hub
from wgpu_train.formats.tokenizer import load_tokenizer
from wgpu_train.harness.scoring import continuation_scores

GEN_TOKENS = 256          # max_gen_toks when a task names none (lm_eval's Hugging Face backend's default)
_CONTINUE = "<wgpu-train: the final message goes on here> "   # marks where a continued final message ends


def _whole_number(value, what: str) -> int:
    """An lm_eval model argument that must be a whole number >= 1 (model_args strings give it as text)."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a whole number, got {value!r}") from None
    if number < 1:
        raise ConfigError(f"{what} must be at least 1, got {number}")
    return number


@register_model("wgpu-train")
class WgpuTrainLM(TemplateLM):
    """lm_eval's LM over a wgpu-train Model: model_args pretrained (a model folder or hub id; default: the
    adapter's base model), peft (a PEFT LoRA adapter folder or hub id), backend ("auto", "wgpu", "numpy"),
    device (the WebGPU adapter), base_dtype / embed_dtype / kv_dtype (storage, as `load_model`; kv_dtype the
    generate_until KV cache's), batch_size (rows per engine call), max_length (at most the model's
    max_position_embeddings, the default) and seed (sampling)."""

    def __init__(self, pretrained=None, peft=None, backend: str = "auto", device=None, base_dtype: str = "auto",
                 embed_dtype: str = "auto", batch_size=8, max_length=None, seed: int = 1234, kv_dtype: str = "float32"):
        super().__init__()
        adapter = adapter_folder(peft)
        model_dir = hub.resolve(pretrained, "model") if pretrained else adapter and adapter_base_model(adapter)
        if not model_dir:
            raise ConfigError("the wgpu-train model needs pretrained=<model folder or hub id> (or an adapter whose "
                              "base model is on this machine)")
        self.model = load_model(model_dir, backend=backend, device=device, base_dtype=base_dtype,
                                embed_dtype=embed_dtype, kv_dtype=kv_dtype)
        if adapter is not None:
            self.model.load_adapter(adapter)
        self.tokenizer = load_tokenizer(model_dir)
        if self.tokenizer.eos_token_id is None:
            raise ConfigError(f"{model_dir}: the tokenizer names no EOS token, which lm_eval's requests need")
        self.model_dir = Path(model_dir)
        if str(batch_size) == "auto":
            raise ConfigError("batch_size auto is not supported: give a number of rows")
        self.batch_size = _whole_number(batch_size, "batch_size")
        positions = self.model.config.max_position_embeddings
        self._max_length = min(_whole_number(max_length, "max_length"), positions) if max_length else positions
        self.seed = int(seed)

    # ---- what TemplateLM asks of a model ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window condition on: BOS, else EOS (as lm_eval's hf)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.model_dir).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """Token ids of `string`, with the tokenizer's special tokens (its BOS) unless told otherwise or the
        string starts with the prefix token's text already; the last left_truncate_len ids when given."""
        if add_special_tokens is None:
            prefix = self.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
            add_special_tokens = not (prefix and string.startswith(prefix))
        ids = self.tokenizer.encode(string, add_special_tokens=add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of each ((context, continuation), context ids, continuation ids)."""
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood (wgpu-train)")
        try:
            answers = continuation_scores(self.model, [(c, x) for _, c, x in requests], self.batch_size,
                                          self.max_length, self._pad_id(), bar.update)
        finally:
            bar.close()
        for (request, _, _), answer in zip(requests, answers):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole string: its tokens after the prefix token, in lm_eval's rolling
        windows of max_length tokens (each token predicted once, with as much context as fits)."""
        windows, owners = [], []
        for i, (string,) in enumerate(r.args for r in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (log_prob, _) in zip(owners, scores):
            totals[i] += log_prob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation of its context, generated on the KV cache `batch_size` rows at a time
        (requests of the same gen_kwargs together, longest first): greedy, or sampled with the temperature
        (top_k, top_p) when do_sample; a row ends at max_gen_toks, a stop token or one of the `until` strings
        (EOS's text among them), and its text is cut before the first of those strings."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str | None] = [None] * len(requests)
        eos_text = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until (wgpu-train)")
        for members in groups.values():
            kwargs = normalize_gen_kwargs(requests[members[0]].args[1], GEN_TOKENS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            budget = kwargs.pop("max_gen_toks")
            room = self.max_length - budget
            if room < 1:
                raise ConfigError(f"max_gen_toks {budget} leaves no room for a prompt within the model's "
                                  f"{self.max_length} positions")
            # an empty context is the prefix token alone, as in loglikelihood
            prompts = {i: self.tok_encode(requests[i].args[0], left_truncate_len=room) or [self.prefix_token_id]
                       for i in members}
            order = sorted(members, key=lambda i: -len(prompts[i]))
            for b0 in range(0, len(order), self.batch_size):
                rows = order[b0:b0 + self.batch_size]
                texts = self._generate(rows, prompts, budget, until, kwargs)
                for i, text in zip(rows, texts):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(rows))
        bar.close()
        return out  # type: ignore[return-value]

    def _generate(self, rows: list[int], prompts: dict, budget: int, until: list[str], kwargs: dict) -> list[str]:
        """The texts generated after prompts[i] for each request i of `rows`, each cut before its first stop
        string; a row stops as soon as one appears in its text."""
        sampled = bool(kwargs.get("do_sample"))
        made: list[list[int]] = [[] for _ in rows]

        def stop_here(r: int, token: int) -> bool:
            made[r].append(token)
            text = self.tokenizer.decode(made[r], skip_special_tokens=False)
            return any(s and s in text for s in until)

        outs = self.model.generate_batch(
            [np.asarray(prompts[i]) for i in rows], max_new_tokens=budget,
            temperature=float(kwargs.get("temperature") or 0.0) if sampled else 0.0,
            top_k=int(kwargs.get("top_k") or 0) if sampled else 0,
            top_p=float(1.0 if kwargs.get("top_p") is None else kwargs["top_p"]) if sampled else 1.0,
            seed=[[self.seed, i] for i in rows], stop_token_ids=self.tokenizer.stop_token_ids, on_token=stop_here)
        return [postprocess_generated_text(self.tokenizer.decode(ids), until, None) for ids in outs]

    # ---- chat templates -----------------------------------------------------------------------------------
    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template --apply-chat-template renders: the model folder's own, else the ChatML fallback."""
        return self.tokenizer.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """The few-shot conversation as the chat template renders it: with the assistant's generation prompt, or
        (add_generation_prompt False) ending inside the final message, to be continued, as transformers'
        continue_final_message cuts it. A template that refuses the system role gets the conversation without it."""
        try:
            return self._render(chat_history, add_generation_prompt)
        except DataError:
            return self._render([m for m in chat_history if m["role"] != "system"], add_generation_prompt)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if add_generation_prompt:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # the final message marked, rendered, and cut at the mark (before the spaces a trimming template removed)
        marked = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE}]
        text = self.tokenizer.apply_chat_template(marked, add_generation_prompt=False)
        at = text.rindex(_CONTINUE.strip())
        return text[:at] if text[at:at + len(_CONTINUE)] == _CONTINUE else text[:at].rstrip()

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else 0
