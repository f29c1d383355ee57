"""Tests of wgpu_train.formats.tokenizer: loading model folders, chat templates against transformers, streaming decode."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from bpe import train_bpe
from wgpu_train.errors import DataError, ModelFileError
from wgpu_train.formats.tokenizer import CHATML_EOS_TEMPLATE, CHATML_TEMPLATE, StreamDecoder, load_tokenizer

CORPUS = [
    "hello world, the cat sat on the mat.",
    "what is two plus two? it is four.",
    "you are a helpful assistant. answer the question briefly.",
    "the quick brown fox jumps over the lazy dog",
    "caf\u00e9 na\u00efve \u00fcber \u65e5\u672c",
]

QWEN_LIKE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama-3 shaped, written with block tags on their own lines so that trim_blocks/lstrip_blocks matter, and
# using namespace, raise_exception and tojson like real templates do.
LLAMA_LIKE = """{{ bos_token }}
{% set ns = namespace(n_user=0) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('bad role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {% set ns.n_user = ns.n_user + 1 %}
    {% endif %}
    {{ '<|im_start|>' + message['role'] + '\n\n' }}
    {% if message['role'] == 'system' %}
{{ message['content'] | tojson }}
    {% else %}
{{ message['content'] | trim }}
    {% endif %}
    {{ '<|im_end|>' }}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\n\n' }}
{% endif %}"""


def build_backend(seed_text=CORPUS, vocab_size=360):
    return train_bpe(seed_text, vocab_size)


@pytest.fixture(scope="module")
def backend():
    return build_backend()


def write_folder(path, backend, config=None, **files):
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (path / name.replace("__", ".")).write_text(text if isinstance(text, str) else json.dumps(text))
    return path


@pytest.fixture
def chat_folder(tmp_path, backend):
    config = {"chat_template": QWEN_LIKE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "bos_token": None}
    return write_folder(tmp_path / "model", backend, config)


def test_load_special_tokens(chat_folder, backend):
    tok = load_tokenizer(chat_folder)
    assert tok.vocab_size == backend.get_vocab_size(with_added_tokens=True)
    assert tok.eos_token_id == backend.token_to_id("<|im_end|>")
    assert tok.pad_token_id == backend.token_to_id("<|endoftext|>")
    assert tok.bos_token_id is None and not tok.add_bos_token
    assert tok.has_chat_template
    assert set(tok.stop_token_ids) == {backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")}
    # a path to tokenizer.json itself works too
    assert load_tokenizer(chat_folder / "tokenizer.json").eos_token_id == tok.eos_token_id


def test_special_tokens_as_dicts_and_pad_fallback(tmp_path, backend):
    config = {"eos_token": {"content": "<|endoftext|>", "special": True}, "bos_token": {"content": "<|im_start|>"},
              "chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEF"}]}
    tok = load_tokenizer(write_folder(tmp_path / "m", backend, config))
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == backend.token_to_id("<|endoftext|>")
    assert tok.bos_token_id == backend.token_to_id("<|im_start|>")
    assert tok.pad_token_id == tok.eos_token_id  # no pad token: falls back to EOS
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "DEF"


def test_template_list_without_default_is_refused(tmp_path, backend):
    templates = [{"name": "tool_use", "template": "TOOLS"}, {"name": "rag", "template": "RAG"}]
    folder = write_folder(tmp_path / "m", backend, {"eos_token": "<|endoftext|>", "chat_template": templates})
    with pytest.raises(ModelFileError) as e:
        load_tokenizer(folder)
    assert str(e.value) == (f'{folder / "tokenizer_config.json"}: chat_template lists the templates rag, tool_use '
                            'but none named "default"')
    transformers = pytest.importorskip("transformers", reason="transformers' refusal is the reference")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                              chat_template={t["name"]: t["template"] for t in templates})
    with pytest.raises(ValueError, match="no default"):
        hf.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)


def test_eos_from_generation_config_and_jinja_file_precedence(tmp_path, backend):
    im_end, eot = backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")
    folder = write_folder(tmp_path / "m", backend, {"chat_template": "OLD"},
                          chat_template__jinja="NEW {{ messages[0]['content'] }}",
                          generation_config__json={"eos_token_id": [im_end, eot]})
    tok = load_tokenizer(folder)
    assert tok.eos_token_id == im_end
    assert tok.stop_token_ids[:2] == [im_end, eot]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "NEW hi"


def test_missing_and_broken_files(tmp_path, backend):
    with pytest.raises(ModelFileError, match="no such model folder"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFileError, match="tokenizer.json: missing"):
        load_tokenizer(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ModelFileError, match="cannot parse tokenizer") as e:
        load_tokenizer(bad)
    assert str(bad / "tokenizer.json") in str(e.value) and "\n" not in str(e.value)
    folder = write_folder(tmp_path / "badcfg", backend)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="tokenizer_config.json: cannot read JSON") as e:
        load_tokenizer(folder)
    assert "\n" not in str(e.value)


def test_encode_decode_offsets(chat_folder):
    tok = load_tokenizer(chat_folder)
    text = "<|im_start|>user\ncaf\u00e9 the cat<|im_end|>\n"
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\ncaf\u00e9 the cat\n"
    assert text[offsets[0][0]:offsets[0][1]] == "<|im_start|>" and ids[0] == tok.token_to_id("<|im_start|>")
    assert all(0 <= s <= e <= len(text) for s, e in offsets)
    assert [s for s, _ in offsets] == sorted(s for s, _ in offsets)


def test_chatml_fallback(tmp_path, backend):
    tok = load_tokenizer(write_folder(tmp_path / "m", backend, {"eos_token": "<|endoftext|>"}))
    assert not tok.has_chat_template and tok.chat_template == CHATML_TEMPLATE
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n")
    assert tok.apply_chat_template(msgs[:2], add_generation_prompt=True).endswith(
        "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    assert tok.token_to_id("<|im_end|>") in tok.stop_token_ids


def test_fallback_for_vocabularies_without_chatml_closes_answers_with_eos(tmp_path, caplog):
    backend = train_bpe(CORPUS, 300, specials=["<unk>", "<s>", "</s>"])
    tok = load_tokenizer(write_folder(tmp_path / "m", backend, {"bos_token": "<s>", "eos_token": "</s>"}))
    assert tok.chat_template == CHATML_EOS_TEMPLATE and tok.token_to_id("<|im_end|>") is None
    assert tok.stop_token_ids == [backend.token_to_id("</s>")]
    msgs = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    with caplog.at_level("WARNING", logger="wgpu_train"):
        text = tok.apply_chat_template(msgs)
        tok.apply_chat_template(msgs[:1], add_generation_prompt=True)
    assert text == "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA</s>\n"
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["the tokenizer has no chat template: using ChatML, each answer closed by the EOS token </s>"]


def test_chatml_fallback_adds_bos_when_post_processor_does(tmp_path):
    backend = build_backend()
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", backend.token_to_id("<|endoftext|>"))])
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    tok = load_tokenizer(write_folder(tmp_path / "m", backend, config))
    assert tok.add_bos_token
    assert tok.apply_chat_template([{"role": "user", "content": "U"}]) == "<|endoftext|><|im_start|>user\nU<|im_end|>\n"


def test_template_errors_are_data_errors(tmp_path, backend):
    config = {"chat_template": LLAMA_LIKE, "bos_token": "<|endoftext|>"}
    tok = load_tokenizer(write_folder(tmp_path / "m", backend, config))
    with pytest.raises(DataError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    broken = load_tokenizer(write_folder(tmp_path / "b", backend, {"chat_template": "{% for x in %}"}))
    with pytest.raises(ModelFileError, match="chat template does not compile"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])


def test_sandbox_blocks_python_internals(tmp_path, backend):
    evil = "{{ messages.__class__.__mro__ }}"
    tok = load_tokenizer(write_folder(tmp_path / "m", backend, {"chat_template": evil}))
    with pytest.raises(DataError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


CONVERSATIONS = [
    [{"role": "user", "content": "what is two plus two?"}],
    [{"role": "system", "content": "be \"brief\" & <exact>"}, {"role": "user", "content": "  hello  "},
     {"role": "assistant", "content": "it is four."}, {"role": "user", "content": "and caf\u00e9?\n"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
]


@pytest.mark.parametrize("template", [QWEN_LIKE, LLAMA_LIKE], ids=["qwen-like", "llama-like"])
def test_matches_transformers(tmp_path, backend, template):
    transformers = pytest.importorskip("transformers", reason="transformers is the oracle for chat templates")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template,
                                              bos_token="<|endoftext|>", eos_token="<|im_end|>")
    ours = load_tokenizer(write_folder(tmp_path / "m", backend, {
        "chat_template": template, "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}))
    for messages in CONVERSATIONS:
        for gen in (False, True):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_tools_and_documents_are_none_as_in_transformers(tmp_path, backend):
    transformers = pytest.importorskip("transformers", reason="transformers is the oracle for chat templates")
    template = ("{% if tools is not none %}[TOOLS]{% endif %}{% if documents is not none %}[DOCS]{% endif %}"
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template)
    ours = load_tokenizer(write_folder(tmp_path / "m", backend, {"chat_template": template}))
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False) == "user: hi\n"
    assert ours.apply_chat_template(messages, tools=[{"name": "f"}]) == "[TOOLS]user: hi\n"


def test_reads_folder_saved_by_transformers(tmp_path, backend):
    transformers = pytest.importorskip("transformers", reason="transformers writes the folder under test")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=LLAMA_LIKE,
                                              bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                              pad_token="<|endoftext|>")
    hf.save_pretrained(tmp_path / "saved")
    tok = load_tokenizer(tmp_path / "saved")
    assert tok.has_chat_template
    assert tok.eos_token_id == hf.eos_token_id and tok.bos_token_id == hf.bos_token_id
    assert tok.pad_token_id == hf.pad_token_id
    messages = CONVERSATIONS[1]
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_stream_decoder_multibyte(chat_folder):
    tok = load_tokenizer(chat_folder)
    text = "caf\u00e9 \U0001F600 the \u65e5\u672c cat<|im_end|> sat"
    ids = tok.encode(text)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == tok.decode(ids) == dec.text
    assert not any("\ufffd" in p for p in pieces)
    # the emoji is several byte-level tokens: the pushes before its last byte return nothing
    assert "" in pieces[:-1]
    assert any(p.endswith("\U0001F600") for p in pieces)


def test_stream_decoder_metaspace_leading_spaces(tmp_path):
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    ours = load_tokenizer(write_folder(tmp_path / "m", tok, {"eos_token": "</s>"}))
    ids = ours.encode("the quick brown fox jumps over the lazy dog")
    dec = StreamDecoder(ours)
    streamed = "".join(dec.push(i) for i in ids) + dec.flush()
    assert streamed == ours.decode(ids) == "the quick brown fox jumps over the lazy dog"
