"""Tests of wgpu_train.data.tokenize: JSONL formats and bad lines, splits, loss masks from chat templates, batching,
packing and the resumable batch stream."""

import json

import numpy as np
import pytest
from bpe import train_bpe
from chat_templates import GEMMA, LAST_USER_SYSTEM, LAST_USER_SYSTEM_TIGHT, PHI3, REASONING
from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.data.batching import BatchStream, Example, make_batches
from wgpu_train.data.sources import load_records, resolve_data
from wgpu_train.data.tokenize import raw_prompt_text, tokenize_dataset, tokenize_example
from wgpu_train.errors import ConfigError, DataError
from wgpu_train.formats.tokenizer import load_tokenizer

CORPUS = [
    "hello world, the cat sat on the mat.",
    "what is two plus two? it is four.",
    "you are a helpful assistant. answer the question briefly.",
    "the quick brown fox jumps over the lazy dog",
]
QWEN_LIKE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Same output as QWEN_LIKE, but marking the assistant part for transformers' return_assistant_tokens_mask.
QWEN_GENERATION = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Trims contents and leaves text between the answer and its end token and after it, like Llama-3 style templates.
SPACY = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n\n' + message['content'] | trim }}{{ ' .\n<|im_end|>\n\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n\n' }}{% endif %}"
)


def build_backend():
    return train_bpe(CORPUS, vocab_size=340)


@pytest.fixture(scope="module")
def backend():
    return build_backend()


def make_tokenizer(path, backend, template=QWEN_LIKE, **special):
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", **special}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def tok(backend, tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"), backend)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------------------------
# formats and bad lines

FORMAT_CASES = [
    ("chat", {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                           {"role": "assistant", "content": "A"}]},
     [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]),
    ("chat", {"messages": [{"role": "system", "content": " "}, {"role": "user", "content": "U"},
                           {"role": "assistant", "content": "A"}]},  # an empty system message is no system message
     [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "U1"},
                                                        {"type": "text", "text": " U2"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "A"}]}]},  # OpenAI content parts
     [{"role": "user", "content": "U1 U2"}, {"role": "assistant", "content": "A"}]),
    ("chat", {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "U"},
                                {"from": "gpt", "value": "A"}]},  # ShareGPT
     [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]),
    ("completions", {"prompt": "P", "completion": "C"},
     [{"role": "user", "content": "P", "raw_separator": ""}, {"role": "assistant", "content": "C"}]),
    ("completions", {"instruction": "I", "prompt": "P", "completion": "C"},  # the instruction is kept, first
     [{"role": "user", "content": "I\n\nP", "raw_separator": ""}, {"role": "assistant", "content": "C"}]),
    ("alpaca", {"instruction": "I", "input": "X", "output": "O"},
     [{"role": "user", "content": "I\n\nX"}, {"role": "assistant", "content": "O"}]),
    ("alpaca", {"instruction": "I", "input": "X", "output": "O", "prompt": "Below is an instruction. I X", "text": "T"},
     [{"role": "user", "content": "I\n\nX"}, {"role": "assistant", "content": "O"}]),  # a rendered prompt beside it
    ("instruction", {"instruction": "I", "input": "X", "response": "R"},
     [{"role": "user", "content": "I\n\nX"}, {"role": "assistant", "content": "R"}]),
    ("instruction", {"instruction": "I", "context": "C", "response": "R", "category": "closed_qa"},  # Dolly
     [{"role": "user", "content": "I\n\nC"}, {"role": "assistant", "content": "R"}]),
    ("alpaca", {"instruction": "I", "input": "", "output": "O"},
     [{"role": "user", "content": "I"}, {"role": "assistant", "content": "O"}]),
    ("instruction", {"instruction": "I", "response": "R", "system": "S"},
     [{"role": "system", "content": "S"}, {"role": "user", "content": "I"}, {"role": "assistant", "content": "R"}]),
    ("instruction", {"instruction": "I", "response": "R"},
     [{"role": "user", "content": "I"}, {"role": "assistant", "content": "R"}]),
    ("text", {"text": "some text"}, "some text"),
]


@pytest.mark.parametrize("fmt,row,expected", FORMAT_CASES)
def test_formats_detected_and_converted(tmp_path, fmt, row, expected):
    path = write_jsonl(tmp_path / "d.jsonl", [row, "", row])  # a blank line is ignored
    records, found, skipped = load_records(path)
    assert found == fmt and skipped == 0
    assert records == [expected, expected]


def test_chat_extra_keys_dropped(tmp_path):
    row = {"messages": [{"role": "user", "content": "U", "name": "x"}, {"role": "assistant", "content": "A"}],
           "id": 3}
    records, _, _ = load_records(write_jsonl(tmp_path / "d.jsonl", [row]))
    assert records == [[{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]]


GOOD_CHAT = {"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]}
BAD_LINES = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"foo": 1, "bar": 2}, "unknown record shape"),
    ({"messages": "hi"}, "must be a non-empty list"),
    ({"messages": []}, "must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "U"}]}, "no assistant message"),
    ({"messages": [{"role": "user", "content": "U"}, {"role": "robot", "content": "A"}]}, "role 'robot'"),
    ({"messages": [{"role": "user", "content": "U"}, {"role": "assistant"}]}, 'missing field "content"'),
    ({"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": " "}]}, "is empty"),
    ({"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": 5}]}, "must be a string"),
    ({"messages": [{"role": "assistant", "content": "A"}]}, "must start with a user message"),
    ({"messages": [{"role": "user", "content": "U"}, {"role": "system", "content": "S"},
                   {"role": "assistant", "content": "A"}]}, "system message may only come first"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
                   {"role": "assistant", "content": "A"}]}, "content part of type 'image_url'; only text parts"),
    ({"conversations": [{"from": "human", "value": "U"}, {"from": "bot", "value": "A"}]}, "is from 'bot'"),
    ({"prompt": "P", "completion": "C"}, "looks like completions format"),
    ({"text": "T"}, "looks like text format"),
]


@pytest.mark.parametrize("bad,problem", BAD_LINES)
def test_bad_line_names_file_and_line(tmp_path, bad, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD_CHAT, "", bad, GOOD_CHAT])
    with pytest.raises(DataError) as e:
        load_records(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: ") and problem in msg and "\n" not in msg
    records, fmt, skipped = load_records(path, skip_invalid=True)
    assert (len(records), fmt, skipped) == (2, "chat", 1)


@pytest.mark.parametrize("row,problem", [
    ({"prompt": "P"}, 'missing field "completion"'),
    ({"prompt": "P", "completion": ""}, 'field "completion" is empty'),
    ({"prompt": ["P"], "completion": "C"}, 'field "prompt" must be a string'),
    ({"instruction": "I", "input": "X"}, 'missing field "output"'),
    ({"instruction": "I", "input": 3, "output": "O"}, 'field "input" must be a string'),
    ({"instruction": "I", "response": None}, 'missing field "response"'),
    ({"text": 7}, 'field "text" must be a string'),
])
def test_bad_fields_of_flat_formats(tmp_path, row, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(DataError, match=problem) as e:
        load_records(path)
    assert str(e.value).startswith(f"{path}:1: ")


def test_invalid_utf8_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps({"text": "ok"}).encode() + b"\n" + b'{"text": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=r":2: not valid UTF-8"):
        load_records(path)


def test_skip_invalid_detects_format_after_bad_first_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["garbage", {"x": 1}, {"text": "a"}, {"prompt": "p", "completion": "c"},
                                              {"text": "b"}])
    records, fmt, skipped = load_records(path, skip_invalid=True)
    assert (records, fmt, skipped) == (["a", "b"], "text", 3)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be"])
def test_utf16_file_is_named(tmp_path, encoding):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "caf\u00e9"}) + "\n", encoding=encoding)
    with pytest.raises(DataError) as e:
        load_records(path)
    assert str(e.value) == f"{path}: the file is UTF-16 encoded; save it as UTF-8"


def test_empty_missing_and_all_invalid_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_records(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(DataError, match="empty file"):
        load_records(tmp_path / "empty.jsonl")
    write_jsonl(tmp_path / "bad.jsonl", ["x", "y"])
    with pytest.raises(DataError, match=r"no valid lines \(2 skipped\)"):
        load_records(tmp_path / "bad.jsonl", skip_invalid=True)


# ---------------------------------------------------------------------------------------------------------------
# splits


def test_resolve_folder_with_all_splits(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"text": f"t{i}"} for i in range(5)])
    write_jsonl(tmp_path / "valid.jsonl", [{"text": "v"}])
    write_jsonl(tmp_path / "test.jsonl", [{"text": "x"}, {"text": "y"}])
    splits = resolve_data(tmp_path, valid_split=0.5, seed=1)
    assert splits.format == "text" and not splits.valid_held_out
    assert (len(splits.train), splits.valid, splits.test) == (5, ["v"], ["x", "y"])


def test_held_out_valid_is_deterministic_by_seed(tmp_path):
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(40)]
    path = write_jsonl(tmp_path / "all.jsonl", rows)
    a = resolve_data(path, valid_split=0.25, seed=3)
    b = resolve_data(path, valid_split=0.25, seed=3)
    c = resolve_data(path, valid_split=0.25, seed=4)
    assert a.valid_held_out and (len(a.train), len(a.valid), a.test) == (30, 10, [])
    assert a.train == b.train and a.valid == b.valid
    assert a.valid != c.valid
    prompts = lambda recs: [r[0]["content"] for r in recs]  # noqa: E731
    assert sorted(prompts(a.train) + prompts(a.valid), key=lambda s: int(s[1:])) == [f"p{i}" for i in range(40)]
    assert prompts(a.train) == sorted(prompts(a.train), key=lambda s: int(s[1:]))  # file order kept
    # the folder form holds out the same way when it has no valid.jsonl
    folder = tmp_path / "f"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", rows)
    assert resolve_data(folder, valid_split=0.25, seed=3).valid == a.valid
    assert resolve_data(path, valid_split=0.0, seed=3).valid == []


def test_records_keep_their_file_and_line_through_the_split(tmp_path):
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "all.jsonl", ["", *rows])  # the blank first line counts
    splits = resolve_data(path, valid_split=0.3, seed=2)
    assert splits.valid_held_out
    for record in splits.train + splits.valid:
        assert record.source == f"{path}:{int(record[0]['content'][1:]) + 2}"
    texts, _, _ = load_records(write_jsonl(tmp_path / "t.jsonl", [{"text": "a"}, {"text": "b"}]))
    assert texts == ["a", "b"] and [t.source for t in texts] == [f"{tmp_path / 't.jsonl'}:{i}" for i in (1, 2)]


@pytest.mark.parametrize("name", ["validation.jsonl", "val.jsonl", "dev.jsonl"])
def test_other_validation_file_names(tmp_path, name):
    write_jsonl(tmp_path / "train.jsonl", [{"text": f"t{i}"} for i in range(5)])
    write_jsonl(tmp_path / name, [{"text": "v"}])
    splits = resolve_data(tmp_path, valid_split=0.5)
    assert splits.valid == ["v"] and not splits.valid_held_out and splits.files["valid"] == str(tmp_path / name)
    write_jsonl(tmp_path / "valid.jsonl", [{"text": "w"}])
    with pytest.raises(DataError) as e:
        resolve_data(tmp_path)
    assert str(e.value) == f"{tmp_path}: found valid.jsonl and {name}; keep one validation file"


def test_resolve_errors(tmp_path):
    with pytest.raises(DataError, match="no such file or folder"):
        resolve_data(tmp_path / "nope")
    with pytest.raises(DataError, match="no train.jsonl"):
        resolve_data(tmp_path)
    write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}, {"text": "b"}])
    with pytest.raises(ConfigError):
        resolve_data(tmp_path, valid_split=1.5)


# ---------------------------------------------------------------------------------------------------------------
# loss masks


def expected_spans(text, answers, header="<|im_start|>assistant\n", end="<|im_end|>"):
    """Char spans of each answer + end token, found directly in the rendered ChatML text."""
    spans, at = [], 0
    for a in answers:
        start = text.index(header + a + end, at) + len(header)
        spans.append((start, start + len(a) + len(end)))
        at = spans[-1][1]
    return spans


def check_labels_against_spans(tok, ex, text, spans):
    ids, offsets = tok.encode_with_offsets(text)
    assert ex.input_ids.dtype == np.int32 and ex.labels.dtype == np.int64
    assert ex.input_ids.tolist() == ids
    for j, (s, e) in enumerate(offsets):
        inside = any(s < b and e > a for a, b in spans)  # the token holds a character of an answer
        assert ex.labels[j] == (ids[j] if inside else IGNORE_INDEX), (j, text[offsets[j][0]:offsets[j][1]])


def trained_text(tok, ex):
    return tok.decode(ex.input_ids[ex.labels != IGNORE_INDEX], skip_special_tokens=False)


SINGLE = [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "it is four."}]
MULTI = [
    {"role": "system", "content": "answer briefly."},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "hello, the cat"},
    {"role": "user", "content": "what is two plus two?"},
    {"role": "assistant", "content": "it is four."},
]


def test_single_turn_mask(tok):
    ex = tokenize_example(tok, SINGLE, max_seq_len=512)
    text = tok.apply_chat_template(SINGLE)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.")  # template's default system
    check_labels_against_spans(tok, ex, text, expected_spans(text, ["it is four."]))
    assert trained_text(tok, ex) == "it is four.<|im_end|>"
    assert ex.input_ids[-1] == tok.encode("\n")[0] and ex.labels[-1] == IGNORE_INDEX  # newline after end of turn
    assert not ex.truncated


def test_multi_turn_all_and_last(tok):
    text = tok.apply_chat_template(MULTI)
    ex = tokenize_example(tok, MULTI, max_seq_len=512)
    check_labels_against_spans(tok, ex, text, expected_spans(text, ["hello, the cat", "it is four."]))
    assert trained_text(tok, ex) == "hello, the cat<|im_end|>it is four.<|im_end|>"
    last = tokenize_example(tok, MULTI, max_seq_len=512, train_on_last_turn=True)
    check_labels_against_spans(tok, last, text, expected_spans(text, ["it is four."]))
    assert trained_text(tok, last) == "it is four.<|im_end|>"
    np.testing.assert_array_equal(ex.input_ids, last.input_ids)


def test_trailing_user_turn_is_dropped(tok):
    ex = tokenize_example(tok, MULTI + [{"role": "user", "content": "thanks"}], max_seq_len=512)
    assert ex.input_ids.tolist() == tok.encode(tok.apply_chat_template(MULTI))


def test_chatml_fallback_mask(tmp_path, backend):
    plain = make_tokenizer(tmp_path / "plain", backend, template=None)
    ex = tokenize_example(plain, MULTI, max_seq_len=512)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in MULTI)
    assert ex.input_ids.tolist() == plain.encode(text)
    check_labels_against_spans(plain, ex, text, expected_spans(text, ["hello, the cat", "it is four."]))


def test_template_with_text_around_end_token(tmp_path, backend):
    # the template trims content and writes " .\n" before <|im_end|>: that is part of the answer, "\n\n" after is not
    spacy = make_tokenizer(tmp_path / "spacy", backend, template=SPACY, bos_token="<|endoftext|>")
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "  the cat sat \n"}]
    ex = tokenize_example(spacy, messages, max_seq_len=512)
    text = spacy.apply_chat_template(messages)
    assert text.endswith("<|im_start|>assistant\n\nthe cat sat .\n<|im_end|>\n\n")
    assert trained_text(spacy, ex) == "the cat sat .\n<|im_end|>"
    assert ex.labels[-1] == IGNORE_INDEX and ex.input_ids[0] == spacy.token_to_id("<|endoftext|>")


# Like Qwen3: only the final assistant turn is rendered with an (empty) thinking block.
THINKING = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and loop.last %}"
    "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_template_rendering_past_turns_differently(tmp_path, backend):
    thinking = make_tokenizer(tmp_path / "think", backend, template=THINKING)
    ex = tokenize_example(thinking, MULTI, max_seq_len=512)
    text = thinking.apply_chat_template(MULTI)
    spans = expected_spans(text, ["hello, the cat"]) + expected_spans(text, ["<think>\n\n</think>\n\nit is four."])
    check_labels_against_spans(thinking, ex, text, spans)
    assert trained_text(thinking, ex) == "hello, the cat<|im_end|><think>\n\n</think>\n\nit is four.<|im_end|>"


MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
MISTRAL_CHATS = [
    [{"role": "system", "content": "be brief."}, {"role": "user", "content": "what is the capital of france"},
     {"role": "assistant", "content": "paris"}],
    # answers that the questions also hold, and a question asked twice
    [{"role": "system", "content": "answer the question briefly."}, {"role": "user", "content": "say hello world"},
     {"role": "assistant", "content": "hello world"}, {"role": "user", "content": "say hello world"},
     {"role": "assistant", "content": "hello world"}, {"role": "user", "content": "what is two plus two?"},
     {"role": "assistant", "content": " it is four. "}],
    SINGLE,
]


def _masks_match_transformers(ours, backend, template, answer, bos, eos):
    """Every MISTRAL_CHATS conversation: our ids and trained tokens equal transformers' ids and assistant mask,
    with transformers given the same template and {% generation %} around its answer line `answer`."""
    transformers = pytest.importorskip("transformers", reason="transformers' assistant mask is the oracle")
    tagged = template.replace(answer, "{%- generation %}" + answer + "{%- endgeneration %}")
    assert tagged != template
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=tagged, bos_token=bos,
                                              eos_token=eos)
    for messages in MISTRAL_CHATS:
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ex = tokenize_example(ours, messages, max_seq_len=512)
        assert ex.input_ids.tolist() == list(out["input_ids"])
        assert (ex.labels != IGNORE_INDEX).astype(int).tolist() == list(out["assistant_masks"])


@pytest.mark.parametrize("template,assistant", [
    (LAST_USER_SYSTEM, '{{- " " ~ m.content | trim ~ eos_token }}'),
    (LAST_USER_SYSTEM_TIGHT, '{{- m.content ~ eos_token }}'),
], ids=["spaced", "tight"])
def test_last_user_system_templates_train_only_answers(tmp_path, template, assistant):
    """The system message goes into the last user turn only (as in Mistral's templates), so the prompt of an
    earlier answer is not a prefix of the conversation: still only each answer and its </s> are trained, as
    transformers' assistant mask says of the same template with {% generation %} around the answer."""
    pytest.importorskip("transformers", reason="transformers' assistant mask is the oracle")
    backend = train_bpe(CORPUS + ["what is the capital of france? paris. say hello world"], 400,
                        specials=MISTRAL_SPECIALS)
    ours = make_tokenizer(tmp_path / "m", backend, template=template, bos_token="<s>", eos_token="</s>")
    _masks_match_transformers(ours, backend, template, assistant, "<s>", "</s>")
    ex = tokenize_example(ours, MISTRAL_CHATS[0], max_seq_len=512)
    assert trained_text(ours, ex).strip() == "paris</s>"
    # the case under test: the first answer's prompt holds the system text, which the whole render has only later
    chat = MISTRAL_CHATS[1]
    assert not ours.apply_chat_template(chat).startswith(ours.apply_chat_template(chat[:2], add_generation_prompt=True))
    assert ours.apply_chat_template(chat).count("answer the question briefly.") == 1


def test_reasoning_template_turns(tmp_path, backend):
    """A reasoning template (like Qwen3's) renders past answers without their thinking: those train the answer after
    </think>, one that held only thinking is not trained, and the last keeps its thinking, which is trained."""
    transformers = pytest.importorskip("transformers", reason="transformers renders the oracle text")
    qwen = make_tokenizer(tmp_path / "q", backend, template=REASONING, eos_token="<|im_end|>")
    messages = [
        {"role": "user", "content": "what is two plus two?"},
        {"role": "assistant", "content": "<think>two and two</think>it is four."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "<think>\nonly thinking\n</think>\n\n"},
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "<think>a cat</think>the cat sat on the mat."},
    ]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=REASONING,
                                              eos_token="<|im_end|>")
    text = hf.apply_chat_template(messages, tokenize=False)
    assert "two and two" not in text and "only thinking" not in text
    assert qwen.apply_chat_template(messages) == text  # tools=None: no system turn, as in transformers
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with_tools = hf.apply_chat_template(messages, tools=tools, tokenize=False)
    assert with_tools.startswith("<|im_start|>system\n")
    assert qwen.apply_chat_template(messages, tools=tools) == with_tools
    ex = tokenize_example(qwen, messages, max_seq_len=512)
    assert ex.input_ids.tolist() == qwen.encode(text)
    assert trained_text(qwen, ex) == (
        "it is four.<|im_end|><think>\na cat\n</think>\n\nthe cat sat on the mat.<|im_end|>")
    last = tokenize_example(qwen, messages, max_seq_len=512, train_on_last_turn=True)
    assert trained_text(qwen, last) == "<think>\na cat\n</think>\n\nthe cat sat on the mat.<|im_end|>"


def test_generation_prompt_that_past_answers_lack(tmp_path, backend):
    """Like DeepSeek-R1's template: asking for an answer adds "<think>\n", which rendered answers do not have; the
    answer starts right after the shared beginning, also when the question holds the answer's text."""
    template = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|im_start|>' + m['content'] }}"
                "{% else %}{{ '<|im_start|>assistant:\n' + m['content'] + '<|im_end|>' }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant:\n<think>\n' }}{% endif %}")
    r1 = make_tokenizer(tmp_path / "r1", backend, template=template)
    messages = [{"role": "user", "content": "say\nhello world"}, {"role": "assistant", "content": "hello world"},
                {"role": "user", "content": "the cat\n"}, {"role": "assistant", "content": "the cat sat."}]
    ex = tokenize_example(r1, messages, max_seq_len=512)
    assert trained_text(r1, ex) == "hello world<|im_end|>the cat sat.<|im_end|>"


def test_fallback_for_base_vocabularies_ends_answers_with_eos(tmp_path):
    """A base model (Llama-2, Mistral-7B-v0.1) has no template and no <|im_end|> token: answers end with its EOS."""
    backend = train_bpe(CORPUS, 340, specials=["<unk>", "<s>", "</s>"])
    base = make_tokenizer(tmp_path / "base", backend, template=None, bos_token="<s>", eos_token="</s>")
    eos = base.token_to_id("</s>")
    ex = tokenize_example(base, MULTI, max_seq_len=512)
    trained = ex.labels[ex.labels != IGNORE_INDEX]
    assert trained[-1] == eos and (trained == eos).sum() == 2
    assert trained_text(base, ex) == "hello, the cat</s>it is four.</s>"
    assert eos in base.stop_token_ids


def test_gemma_template_trains_model_turns(tmp_path):
    """Gemma's turns: only each model answer and its <end_of_turn> are trained, as transformers' assistant
    mask says of the same template with {% generation %} around the answer; the system text is in the first turn."""
    pytest.importorskip("transformers", reason="transformers' assistant mask is the oracle")
    specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    backend = train_bpe(CORPUS + ["what is the capital of france? paris. user model"], 400, specials=specials)
    ours = make_tokenizer(tmp_path / "g", backend, template=GEMMA, bos_token="<bos>", eos_token="<eos>")
    _masks_match_transformers(ours, backend, GEMMA, '{{- m.content | trim ~ "<end_of_turn>" }}', "<bos>", "<eos>")
    ex = tokenize_example(ours, MISTRAL_CHATS[0], max_seq_len=512)
    assert trained_text(ours, ex) == "paris<end_of_turn>"
    assert ours.apply_chat_template(MISTRAL_CHATS[0]).startswith("<bos><start_of_turn>user\nbe brief.\n\n")


def test_phi3_template_trains_assistant_turns(tmp_path):
    """Phi-3's turns: each answer and its <|end|> are trained, as transformers' assistant mask says of the same
    template with {% generation %} around the answer; the end-of-text token after the conversation is not."""
    pytest.importorskip("transformers", reason="transformers' assistant mask is the oracle")
    specials = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    backend = train_bpe(CORPUS + ["what is the capital of france? paris."], 400, specials=specials)
    ours = make_tokenizer(tmp_path / "p", backend, template=PHI3, bos_token="<|endoftext|>",
                          eos_token="<|endoftext|>")
    _masks_match_transformers(ours, backend, PHI3, '{{- m.content ~ "<|end|>" }}', "<|endoftext|>", "<|endoftext|>")
    ex = tokenize_example(ours, MISTRAL_CHATS[0], max_seq_len=512)
    assert trained_text(ours, ex) == "paris<|end|>"
    assert ours.apply_chat_template(MISTRAL_CHATS[0]).startswith("<|system|>\nbe brief.<|end|>\n<|user|>\n")


def test_template_refusal_names_file_and_line(tmp_path):
    backend = train_bpe(CORPUS, 340, specials=MISTRAL_SPECIALS)
    mistral = make_tokenizer(tmp_path / "m", backend, template=LAST_USER_SYSTEM, bos_token="<s>", eos_token="</s>")
    rows = [{"messages": SINGLE}] * 9
    rows[3] = {"messages": [{"role": "user", "content": "hello"}] + SINGLE}  # two user turns in a row
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    splits = resolve_data(path, valid_split=0.3, seed=0)
    errors = []
    for records in (splits.train, splits.valid):  # wherever the split put line 4
        try:
            tokenize_dataset(mistral, records, 64)
        except DataError as e:
            errors.append(str(e))
    assert errors == [f"{path}:4: chat template refused the conversation: expected alternating user and assistant "
                      "messages after the system message"]
    stats = [tokenize_dataset(mistral, records, 64, skip_invalid=True)[1] for records in (splits.train, splits.valid)]
    assert sum(st.n_skipped for st in stats) == 1 and sum(st.n_examples for st in stats) == 8
    with pytest.raises(DataError, match=r"^record 1: chat template refused"):  # records built in code
        tokenize_dataset(mistral, [SINGLE, rows[3]["messages"]], 64)


def test_token_straddling_the_answer_start_is_trained(tmp_path, backend):
    # the generation prompt ends in a space, so the answer's first token " the" starts inside the prompt
    template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
                "{% if m['role'] == 'assistant' %}{{ '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    spaced = make_tokenizer(tmp_path / "spaced", backend, template=template)
    ex = tokenize_example(spaced, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the cat"}],
                          max_seq_len=512)
    assert trained_text(spaced, ex) == " the cat<|im_end|>"


def test_mask_matches_transformers_generation_tags(tmp_path, backend):
    transformers = pytest.importorskip("transformers", reason="transformers' assistant mask is the oracle")
    ours = make_tokenizer(tmp_path / "gen", backend, template=QWEN_GENERATION)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=QWEN_GENERATION,
                                              eos_token="<|endoftext|>")
    for messages in (SINGLE, MULTI):
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ex = tokenize_example(ours, messages, max_seq_len=512)
        assert ex.input_ids.tolist() == list(out["input_ids"])
        assert (ex.labels != IGNORE_INDEX).astype(int).tolist() == list(out["assistant_masks"])
        # and the tags change nothing in the text
        assert ours.apply_chat_template(messages) == make_tokenizer(
            tmp_path / "q", backend).apply_chat_template(messages)


def test_raw_text_mode(tok):
    messages = [{"role": "system", "content": "answer briefly."}, {"role": "user", "content": "two plus two?"},
                {"role": "assistant", "content": " it is four."}]
    ex = tokenize_example(tok, messages, max_seq_len=512, use_chat_template=False)
    prompt = raw_prompt_text(messages)
    assert prompt == "answer briefly.\n\ntwo plus two?\n\n"
    ids, offsets = tok.encode_with_offsets(prompt + " it is four.")
    assert ex.input_ids.tolist() == ids + [tok.eos_token_id]
    n_prompt = sum(1 for _, e in offsets if e <= len(prompt))
    assert (ex.labels[:n_prompt] == IGNORE_INDEX).all()
    assert ex.labels[n_prompt:].tolist() == ex.input_ids[n_prompt:].tolist()
    assert ex.labels[-1] == tok.eos_token_id == tok.token_to_id("<|endoftext|>")
    assert tok.decode(ex.input_ids[n_prompt:-1]) == " it is four."


def test_raw_text_multi_turn(tok):
    ex = tokenize_example(tok, MULTI, max_seq_len=512, use_chat_template=False)
    eos = tok.eos_token_id
    assert (ex.input_ids == eos).sum() == 2 and ex.input_ids[-1] == eos
    assert trained_text(tok, ex) == "hello, the cat<|endoftext|>it is four.<|endoftext|>"
    assert tok.decode(ex.input_ids, skip_special_tokens=False) == (
        "answer briefly.\n\nhello world\n\nhello, the cat<|endoftext|>"
        "what is two plus two?\n\nit is four.<|endoftext|>")
    last = tokenize_example(tok, MULTI, max_seq_len=512, use_chat_template=False, train_on_last_turn=True)
    assert trained_text(tok, last) == "it is four.<|endoftext|>"


def test_raw_mode_separator_and_generation_prompt(tmp_path, tok):
    from wgpu_train.cli.commands import prompt_ids
    from wgpu_train.training.evaluate import generation_prompt

    # chat (and Alpaca, instruction) data: a blank line between the prompt and the answer, in the prompt we generate
    # from as well: evaluation's and the generate command's prompts are the untrained prefix
    ex = tokenize_example(tok, SINGLE, max_seq_len=512, use_chat_template=False)
    assert tok.decode(ex.input_ids, skip_special_tokens=False) == "what is two plus two?\n\nit is four.<|endoftext|>"
    assert trained_text(tok, ex) == "it is four.<|endoftext|>"
    prefix = ex.input_ids[:int(np.argmax(ex.labels != IGNORE_INDEX))].tolist()
    assert generation_prompt(tok, SINGLE, use_chat_template=False) == prefix
    assert prompt_ids(tok, "what is two plus two?", chat_template=False) == prefix
    # completions data: prompt and completion concatenated as given
    rows = [{"prompt": "the cat sat on the", "completion": " mat"}]
    (record,), _, _ = load_records(write_jsonl(tmp_path / "c.jsonl", rows))
    ex = tokenize_example(tok, record, max_seq_len=512, use_chat_template=False)
    assert ex.input_ids.tolist() == tok.encode("the cat sat on the mat") + [tok.eos_token_id]
    assert trained_text(tok, ex) == " mat<|endoftext|>"
    assert raw_prompt_text(record) == "the cat sat on the"
    assert generation_prompt(tok, record, use_chat_template=False) == tok.encode("the cat sat on the")


def test_plain_text_all_trained(tok):
    ex = tokenize_example(tok, "the quick brown fox", max_seq_len=512)
    assert ex.input_ids.tolist() == tok.encode("the quick brown fox") + [tok.eos_token_id]
    np.testing.assert_array_equal(ex.labels, ex.input_ids.astype(np.int64))


def test_truncation_and_drop(tok):
    full = tokenize_example(tok, SINGLE, max_seq_len=512)
    n = len(full)
    n_prompt = int(np.argmax(full.labels != IGNORE_INDEX))
    cut = tokenize_example(tok, SINGLE, max_seq_len=n_prompt + 2)
    assert cut.truncated and len(cut) == n_prompt + 2
    np.testing.assert_array_equal(cut.input_ids, full.input_ids[:n_prompt + 2])
    np.testing.assert_array_equal(cut.labels, full.labels[:n_prompt + 2])
    assert tokenize_example(tok, SINGLE, max_seq_len=n_prompt) is None  # only the prompt would remain
    records = [SINGLE, MULTI, "the cat sat on the mat"]
    examples, stats = tokenize_dataset(tok, records + [SINGLE], max_seq_len=n_prompt + 2)
    assert (stats.n_records, stats.n_examples) == (4, len(examples))
    assert stats.n_truncated == sum(e.truncated for e in examples) >= 2
    assert stats.n_dropped == 4 - len(examples)
    assert stats.n_trained_tokens == sum(e.n_trained for e in examples)
    _, stats = tokenize_dataset(tok, records, max_seq_len=n)
    assert stats.n_dropped == 0 and stats.n_examples == 3


# ---------------------------------------------------------------------------------------------------------------
# batches


def fake_examples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for k, n in enumerate(lengths):
        ids = rng.integers(3, 300, size=n).astype(np.int32)
        ids[0] = 1000 + k  # a tag to recognise the example in a batch
        labels = ids.astype(np.int64)
        if k % 2:  # odd examples are trained everywhere (like plain text), so labels[0] is a real label
            labels[: n // 2] = IGNORE_INDEX
        out.append(Example(ids, labels))
    return out


def rows_of(batch):
    """(example tag, start, length) of each sample in each row, read back from segment ids."""
    found = []
    for r in range(batch.input_ids.shape[0]):
        for s in range(1, batch.segment_ids[r].max() + 1):
            cols = np.flatnonzero(batch.segment_ids[r] == s)
            found.append((int(batch.input_ids[r, cols[0]]) - 1000, r, int(cols[0]), len(cols)))
    return found


def test_padded_batches(tok):
    lengths = [5, 9, 3, 12, 7, 7, 2, 10, 4, 6, 8]
    examples = fake_examples(lengths)
    batches = make_batches(examples, 4, np.random.default_rng(0), pad_id=tok.pad_token_id)
    assert [b.input_ids.shape[0] for b in batches].count(3) == 1 and len(batches) == 3
    seen = []
    for b in batches:
        assert b.input_ids.dtype == np.int32 and b.labels.dtype == np.int64
        for arr in (b.attention_mask, b.segment_ids, b.position_ids):
            assert arr.dtype == np.int32 and arr.shape == b.input_ids.shape
        for k, r, start, n in rows_of(b):
            ex = examples[k]
            assert start == 0 and n == len(ex)
            np.testing.assert_array_equal(b.input_ids[r, :n], ex.input_ids)
            np.testing.assert_array_equal(b.labels[r, :n], ex.labels)
            np.testing.assert_array_equal(b.position_ids[r, :n], np.arange(n))
            assert (b.attention_mask[r, :n] == 1).all() and (b.attention_mask[r, n:] == 0).all()
            assert (b.input_ids[r, n:] == tok.pad_token_id).all() and (b.labels[r, n:] == IGNORE_INDEX).all()
            assert (b.position_ids[r, n:] == 0).all() and (b.segment_ids[r, n:] == 0).all()
            seen.append(k)
        assert b.input_ids.shape[1] == max(n for *_, n in rows_of(b))
        assert b.n_tokens == int((b.labels[:, 1:] != IGNORE_INDEX).sum())
        assert b.n_tokens == sum(examples[k].n_trained for k, *_ in rows_of(b))
    assert sorted(seen) == list(range(len(lengths)))
    # bucketing: with one chunk, the rows sorted by length land in consecutive batches
    spans = sorted((min(n for *_, n in rows_of(b)), max(n for *_, n in rows_of(b))) for b in batches)
    assert all(hi1 <= lo2 for (_, hi1), (lo2, _) in zip(spans, spans[1:]))


def test_batches_seeded_and_unshuffled():
    examples = fake_examples([4, 8, 3, 6, 5])
    a = make_batches(examples, 2, np.random.default_rng(5))
    b = make_batches(examples, 2, np.random.default_rng(5))
    assert all((x.input_ids == y.input_ids).all() for x, y in zip(a, b))
    plain = make_batches(examples, 2, np.random.default_rng(5), shuffle=False, bucket=False, pad_to_multiple=8)
    assert [[k for k, *_ in rows_of(x)] for x in plain] == [[0, 1], [2, 3], [4]]
    assert all(x.input_ids.shape[1] == 8 for x in plain)


def test_packing():
    lengths = [5, 9, 3, 12, 7, 7, 2, 10, 4, 6, 8, 16]
    examples = fake_examples(lengths)
    max_len = 16
    batches = make_batches(examples, 2, np.random.default_rng(1), pack=True, max_seq_len=max_len)
    seen = []
    n_rows = 0
    for b in batches:
        assert b.input_ids.shape[1] <= max_len
        n_rows += b.input_ids.shape[0]
        for k, r, start, n in rows_of(b):
            ex = examples[k]
            assert n == len(ex)
            np.testing.assert_array_equal(b.input_ids[r, start:start + n], ex.input_ids)
            np.testing.assert_array_equal(b.position_ids[r, start:start + n], np.arange(n))
            if start > 0:
                # the previous sample's last logit must not be scored against this sample's first token
                assert b.labels[r, start] == IGNORE_INDEX
                assert b.segment_ids[r, start - 1] == b.segment_ids[r, start] - 1
            np.testing.assert_array_equal(b.labels[r, start + 1:start + n], ex.labels[1:])
            seen.append(k)
        used = b.segment_ids > 0
        assert (b.attention_mask == used).all()
        assert (b.labels[~used] == IGNORE_INDEX).all()
        # segments are contiguous and padding only trails
        for r in range(b.segment_ids.shape[0]):
            seg = b.segment_ids[r][used[r]]
            assert (np.diff(seg) >= 0).all() and seg[0] == 1 and used[r][: used[r].sum()].all()
        assert b.n_tokens == sum(examples[k].n_trained for k, *_ in rows_of(b))
    assert sorted(seen) == list(range(len(lengths)))
    assert n_rows < len(lengths) and n_rows >= -(-sum(lengths) // max_len)
    with pytest.raises(ConfigError):
        make_batches(examples, 2, np.random.default_rng(1), pack=True)


def test_packing_first_fit_order():
    from wgpu_train.data.batching import pack_examples
    assert pack_examples([6, 6, 3, 4, 1, 5], 10) == [[0, 2, 4], [1, 3], [5]]


def test_batch_stream_resume():
    examples = fake_examples([3 + (i * 7) % 11 for i in range(13)])
    for pack in (False, True):
        stream = BatchStream(examples, 3, seed=9, pack=pack, max_seq_len=16)
        per_epoch = len(stream)
        it = iter(stream)
        taken = [next(it) for _ in range(per_epoch + 2)]  # into the second epoch
        assert [e for e, *_ in taken] == [0] * per_epoch + [1, 1]
        assert [i for _, i, _ in taken[:per_epoch]] == list(range(per_epoch))
        state = json.loads(json.dumps(stream.state_dict()))
        expected = [next(it) for _ in range(per_epoch + 1)]

        resumed = BatchStream(examples, 3, seed=9, pack=pack, max_seq_len=16)
        resumed.load_state_dict(state)
        got = [b for _, b in zip(range(per_epoch + 1), resumed)]
        for (e1, i1, b1), (e2, i2, b2) in zip(expected, got):
            assert (e1, i1) == (e2, i2)
            for name in ("input_ids", "labels", "attention_mask", "segment_ids", "position_ids"):
                np.testing.assert_array_equal(getattr(b1, name), getattr(b2, name))
        # epochs are shuffled differently
        first = [x.input_ids.tolist() for _, _, x in taken[:per_epoch]]
        second = [x.input_ids.tolist() for x in stream.epoch_batches(1)]
        assert first != second
    with pytest.raises(ConfigError) as e:
        BatchStream(examples[:5], 3, seed=9).load_state_dict(state)
    assert str(e.value).startswith("the training data changed since the checkpoint (13 examples then, 5 now)")


def test_batch_stream_refuses_changed_data():
    examples = fake_examples([3 + (i * 7) % 11 for i in range(13)])
    state = json.loads(json.dumps(BatchStream(examples, 3, seed=9).state_dict()))
    same = fake_examples([3 + (i * 7) % 11 for i in range(13)])
    BatchStream(same, 3, seed=9).load_state_dict(state)  # equal data, other objects
    changed = fake_examples([3 + (i * 7) % 11 for i in range(13)])
    changed[6].labels[-1] = IGNORE_INDEX  # one label
    with pytest.raises(ConfigError) as e:
        BatchStream(changed, 3, seed=9).load_state_dict(state)
    assert str(e.value).startswith("the training data changed since the checkpoint") and "\n" not in str(e.value)
    # a state saved before fingerprints existed is only checked by its number of examples
    old = {k: v for k, v in state.items() if k != "fingerprint"}
    BatchStream(changed, 3, seed=9).load_state_dict(old)
