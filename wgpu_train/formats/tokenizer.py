"""Tokenizers from Hugging Face folders (tokenizer.json via the `tokenizers` library) and chat templates
rendered the way transformers renders them (sandboxed jinja2), plus an incremental decoder for streaming."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from wgpu_train.errors import DataError, ModelFileError

__all__ = ["CHATML_TEMPLATE", "CHATML_EOS_TEMPLATE", "END_OF_TURN_TOKENS", "TOKENIZER_FILES", "StreamDecoder",
           "Tokenizer", "compile_chat_template", "load_tokenizer"]

log = logging.getLogger("wgpu_train")

# the tokenizer's files in a model folder (a merged or trained model's folder gets copies of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")

# Used when the tokenizer ships no template. The BOS line only fires for tokenizers whose post-processor
# adds a BOS (Llama-style), so that such models still see the token they were pretrained with.
CHATML_TEMPLATE = (
    "{% if add_bos_token and bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The fallback for vocabularies without a <|im_end|> token (base models such as Llama-2 or Mistral-7B-v0.1): the
# same layout as plain text, but each answer closed by the EOS token, so that the model learns to stop.
CHATML_EOS_TEMPLATE = (
    "{% if add_bos_token and bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{{ (eos_token if message['role'] == 'assistant' else '<|im_end|>') + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Tokens that close an assistant turn in common chat formats (ChatML/Qwen, Llama 3, Phi-3, Gemma).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

_REPLACEMENT_CHAR = "\ufffd"


class _TemplateNamespace(jinja2.utils.Namespace):
    """A jinja namespace that refuses underscore attributes, so templates cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` marker and renders its body unchanged;
    loss masks here come from character offsets instead."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which chat templates do not want
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled in the sandboxed environment transformers renders templates in."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    """A special token from a config file: a string, or a dict holding it under "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    return data


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_template(value: Any, path: Path) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template} whose "default" is used (a list
    without one is refused, as transformers refuses it)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named and named:
            names = ", ".join(sorted(str(n) for n in named))
            raise ModelFileError(f"{path}: chat_template lists the templates {names} but none named \"default\"")
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ModelFileError(f"{path}: chat_template must be a string or a list of {{name, template}}")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template of a model folder."""

    def __init__(self, tokenizer: _HFTokenizer, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None, unk_token: str | None = None,
                 extra_eos_ids: Iterable[int] = (), generation_eos_ids: Iterable[int] | None = None) -> None:
        """Wrap `tokenizer`; `extra_eos_ids` are further stop ids (e.g. from generation_config.json and config.json);
        `generation_eos_ids` the model's own, as transformers' generation config holds them (generation_config.json's,
        else config.json's; by default extra_eos_ids)."""
        self._tok = tokenizer
        self._template_source = chat_template
        self._template: jinja2.Template | None = None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self._extra_eos_ids = [i for i in extra_eos_ids if 0 <= i < self.vocab_size]

        self.eos_token_id: int | None = self._id_of(eos_token)
        if self.eos_token_id is None and self._extra_eos_ids:
            self.eos_token_id = self._extra_eos_ids[0]
        if self.eos_token_id is not None and self.eos_token is None:
            self.eos_token = self._tok.id_to_token(self.eos_token_id)
        self.bos_token_id: int | None = self._id_of(bos_token)
        pad_id = self._id_of(pad_token)
        self.pad_token_id: int | None = pad_id if pad_id is not None else self.eos_token_id

        stops: list[int] = []
        for i in [self.eos_token_id, *self._extra_eos_ids, *(self._id_of(t) for t in END_OF_TURN_TOKENS)]:
            if i is not None and i not in stops:
                stops.append(i)
        self.stop_token_ids: list[int] = stops
        # where TRL 1.16's GRPOTrainer ends a completion: the tokenizer's EOS and the generation config's, not every
        # end-of-turn token of the vocabulary (eos_token_ids)
        model_eos = self._extra_eos_ids if generation_eos_ids is None else list(generation_eos_ids)
        self.eos_token_ids: list[int] = list(dict.fromkeys(
            i for i in [self.eos_token_id, *model_eos] if i is not None and 0 <= i < self.vocab_size))
        self.add_bos_token: bool = self._post_processor_adds_bos()
        # ChatML's end of turn is no token of base vocabularies: their fallback closes answers with EOS instead
        self._chatml_native = len(self._tok.encode("<|im_end|>", add_special_tokens=False).ids) == 1

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _post_processor_adds_bos(self) -> bool:
        if self.bos_token_id is None:
            return False
        with_special = self._tok.encode("a", add_special_tokens=True).ids
        return bool(with_special) and with_special[0] == self.bos_token_id

    # ---- plain encoding ----

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings inside the text still map to their ids."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` and each token's (start, end) character offsets into `text`."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def special_tokens(self) -> list[str]:
        """The added tokens marked special: what decoding with skip_special_tokens leaves out."""
        return [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string, or None when it is not in the vocabulary."""
        return self._tok.token_to_id(token)

    # ---- chat templates ----

    @property
    def has_chat_template(self) -> bool:
        """Whether the model folder supplied its own chat template (otherwise ChatML is used)."""
        return self._template_source is not None

    @property
    def chat_template(self) -> str:
        """The template `apply_chat_template` renders: the folder's own, or a ChatML fallback (CHATML_TEMPLATE
        when <|im_end|> is a token of the vocabulary, else CHATML_EOS_TEMPLATE, whose answers end with EOS)."""
        if self._template_source is not None:
            return self._template_source
        return CHATML_TEMPLATE if self._chatml_native or self.eos_token is None else CHATML_EOS_TEMPLATE

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = False,
                            **kwargs: Any) -> str:
        """Render `messages` ([{"role", "content"}, ...]) to text exactly as transformers'
        apply_chat_template(messages, tokenize=False) does; extra keyword arguments become template variables.
        The first render with a fallback template logs a warning."""
        if self._template is None:
            try:
                self._template = compile_chat_template(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise ModelFileError(f"chat template does not compile: {e.message} (line {e.lineno})") from None
            if self._template_source is None:
                log.warning("the tokenizer has no chat template: using ChatML"
                            + ("" if self.chat_template == CHATML_TEMPLATE
                               else f", each answer closed by the EOS token {self.eos_token}"))
        variables: dict[str, Any] = {"tools": None, "documents": None}  # as transformers passes them
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(self, name)
            if value is not None:
                variables[name] = value
        if self._template_source is None:
            variables["add_bos_token"] = self.add_bos_token
        variables.update(kwargs)
        try:
            return self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise DataError(f"chat template refused the conversation: {e}") from None

    def end_of_turn_strings(self) -> list[str]:
        """Strings that may close an assistant turn in rendered chat text: the EOS and the stop tokens (which hold
        the known end-of-turn tokens of this vocabulary)."""
        out: list[str] = []
        for t in [self.eos_token, *(self._tok.id_to_token(i) for i in self.stop_token_ids)]:
            if t and t not in out:
                out.append(t)
        return out

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}, bos={self.bos_token!r}, "
                f"chat_template={'own' if self.has_chat_template else 'ChatML fallback'})")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from a model folder (or its tokenizer.json) with its special tokens and chat template."""
    path = Path(path)
    if path.is_file() and path.name.endswith(".json"):
        folder, tok_file = path.parent, path
    else:
        folder, tok_file = path, path / "tokenizer.json"
    if not folder.is_dir():
        raise ModelFileError(f"{folder}: no such model folder")
    if not tok_file.is_file():
        raise ModelFileError(f"{tok_file}: missing (a Hugging Face tokenizer.json is required)")
    try:
        backend = _HFTokenizer.from_file(str(tok_file))
    except Exception as e:  # the Rust side raises a bare Exception for any malformed file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelFileError(f"{tok_file}: cannot parse tokenizer ({first})") from None

    config: dict = {}
    if (folder / "tokenizer_config.json").is_file():
        config = _read_json(folder / "tokenizer_config.json")
    special_map: dict = {}
    if (folder / "special_tokens_map.json").is_file():
        special_map = _read_json(folder / "special_tokens_map.json")

    template = _pick_template(config.get("chat_template"), folder / "tokenizer_config.json")
    jinja_file = folder / "chat_template.jinja"
    json_file = folder / "chat_template.json"
    if jinja_file.is_file():  # transformers 5 writes the template here, and it takes precedence
        try:
            template = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFileError(f"{jinja_file}: cannot read ({e})") from None
    elif json_file.is_file():
        template = _pick_template(_read_json(json_file).get("chat_template"), json_file) or template

    def special(name: str) -> str | None:
        value = _token_content(config.get(name))
        return value if value is not None else _token_content(special_map.get(name))

    extra_eos: list[int] = []
    generation_eos: list[int] | None = None    # transformers' generation config: its file's, else config.json's
    for name in ("generation_config.json", "config.json"):
        if (folder / name).is_file():
            try:
                ids = _as_id_list(_read_json(folder / name).get("eos_token_id"))
            except ModelFileError:
                continue  # a broken config.json is reported by the model loader; the tokenizer does not need it
            extra_eos += ids
            generation_eos = ids if generation_eos is None else generation_eos
    return Tokenizer(backend, chat_template=template, bos_token=special("bos_token"), eos_token=special("eos_token"),
                     pad_token=special("pad_token"), unk_token=special("unk_token"), extra_eos_ids=extra_eos,
                     generation_eos_ids=generation_eos or [])


class StreamDecoder:
    """Turns generated token ids into text pieces as soon as they form complete characters.

    Decodes a short window of recent ids rather than the whole sequence, so that each push costs the same;
    the window starts a few tokens back so that decoders that drop a leading space behave as on full text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix = 0  # window start: ids already turned into text, kept as context
        self._read = 0  # ids[_prefix:_read] decode to text already emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a multi-byte character is still partial)."""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT_CHAR):
            piece = after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += piece
            return piece
        return ""

    def flush(self) -> str:
        """Return whatever is still held back (a partial character decodes to U+FFFD)."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        piece = after[len(before):] if len(after) > len(before) else ""
        self._prefix = self._read = len(self.ids)
        self.text += piece
        return piece
