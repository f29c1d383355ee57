"""Tests of GRPO's prompt data: TRL's prompt-only records (standard, conversational) and the prompts of
conversations and prompt-completion records through the readers, their columns kept, bad records and a dataset
without prompts, token ids equal to TRL 1.16's GRPOTrainer._tokenize_prompts, and the embedded demo's prompts."""

import types

import numpy as np
import pytest
from bpe import tokenizer_folder, train_bpe
from chat_templates import LAST_USER_SYSTEM
from tokenizers import processors
from wgpu_train.assets import WORDS
from wgpu_train.data.prompt_demo import DEMO_REWARD, demo_prompt_splits
from wgpu_train.data.prompt_records import PromptRecord
from wgpu_train.data.prompt_tokenize import tokenize_prompts
from wgpu_train.data.sources import load_records, resolve_data
from wgpu_train.data.tokenize import generation_prompt_ids
from wgpu_train.errors import ConfigError, DataError
from wgpu_train.formats.tokenizer import load_tokenizer

from record_files import WRITERS, write_json, write_jsonl, write_parquet

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731
S = lambda text: {"role": "system", "content": text}  # noqa: E731


# ---------------------------------------------------------------------------------------------------------------
# formats through the readers

FORMAT_CASES = [
    ("prompt-only", "prompt", {"prompt": "2+2=", "answer": "4", "level": 1},
     PromptRecord("2+2=", {"answer": "4", "level": 1})),
    ("conversational prompt-only", "conversational prompt",
     {"prompt": [S("be brief"), U("2+2?")], "solution": "4", "level": 2},
     PromptRecord([S("be brief"), U("2+2?")], {"solution": "4", "level": 2})),
    ("prompt-completion", "prompt-completion", {"prompt": "2+2=", "completion": "4", "level": 3},
     PromptRecord("2+2=", {"level": 3, "answer": "4"})),
    ("conversational prompt-completion", "conversational prompt-completion",
     {"prompt": [U("2+2?")], "completion": [A("4")], "level": 4},
     PromptRecord([U("2+2?")], {"level": 4, "answer": "4"})),
    ("chat", "chat", {"messages": [S("be brief"), U("1+1?"), A("2"), U("2+2?"), A("4")], "level": 5},
     PromptRecord([S("be brief"), U("1+1?"), A("2"), U("2+2?")], {"level": 5, "answer": "4"})),
    ("chat ending with a question", "chat", {"messages": [U("1+1?"), A("2"), U("2+2?")], "level": 6},
     PromptRecord([U("1+1?"), A("2"), U("2+2?")], {"level": 6})),
    ("ShareGPT conversation", "chat",
     {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}], "level": 7},
     PromptRecord([U("2+2?")], {"level": 7, "answer": "4"})),
    ("a given solution is kept, not replaced", "prompt-completion",
     {"prompt": "2+2=", "completion": "four", "solution": "4", "level": 8},
     PromptRecord("2+2=", {"solution": "4", "level": 8})),
    ("preference pairs: the prompt, the answers as columns", "prompt",
     {"prompt": "2+2=", "chosen": "4", "rejected": "5"}, PromptRecord("2+2=", {"chosen": "4", "rejected": "5"})),
    # not TRL's: SFT's instruction records, their prompt the user turn SFT trains the answer after
    ("alpaca", "alpaca", {"instruction": "Add.", "input": "2+2", "output": "4", "level": 9},
     PromptRecord([U("Add.\n\n2+2")], {"level": 9, "answer": "4"})),
    ("alpaca without input, with a system message", "alpaca",
     {"instruction": "Add 2+2.", "input": "", "output": "4", "system": "be brief"},
     PromptRecord([S("be brief"), U("Add 2+2.")], {"answer": "4"})),
    ("Dolly's instruction, context and response", "instruction",
     {"instruction": "Add.", "context": "2+2", "response": "4", "category": "math"},
     PromptRecord([U("Add.\n\n2+2")], {"category": "math", "answer": "4"})),
    ("an instruction alone is a prompt", "instruction", {"instruction": "Add 2+2.", "solution": "4"},
     PromptRecord([U("Add 2+2.")], {"solution": "4"})),
]


@pytest.mark.parametrize("suffix", list(WRITERS))
@pytest.mark.parametrize("name,fmt,row,expected", FORMAT_CASES, ids=[c[0] for c in FORMAT_CASES])
def test_prompt_formats(tmp_path, suffix, name, fmt, row, expected):
    path = WRITERS[suffix](tmp_path / f"d.{suffix}", [row, row])
    records, found, skipped = load_records(path, kind="prompts")
    assert (found, skipped) == (fmt, 0)
    assert records[1] == PromptRecord(expected.prompt, expected.columns, f"{path}:2")


def test_alpaca_prompts_are_sfts_conversations_without_the_answer(tmp_path):
    """GRPO reads an Alpaca file SFT trains on: each prompt is SFT's conversation of the row but its answer, which
    becomes the answer column (the exact_match reward's); the rows' other columns stay for the rewards."""
    rows = [{"instruction": "Reverse the words.", "input": f"red fox {i}", "output": f"{i} fox red", "id": i}
            for i in range(3)] + [{"instruction": "Say hi.", "input": "", "output": "hi", "id": 3}]
    path = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    sft = resolve_data(path, valid_split=0.0).train
    grpo = resolve_data(path, valid_split=0.0, kind="prompts")
    assert grpo.format == "alpaca" and len(grpo.train) == len(sft) == 4
    for conversation, record, row in zip(sft, grpo.train, rows):
        assert conversation[-1] == A(row["output"]) and record.prompt == list(conversation[:-1])
        assert record.columns == {"id": row["id"], "answer": row["output"]}
    with pytest.raises(DataError, match=r":2: record looks like prompt format .* do not mix"):
        resolve_data(write_jsonl(tmp_path / "mixed.jsonl", [rows[0], {"prompt": "Q"}]), kind="prompts")
    with pytest.raises(DataError, match=r':1: field "input" must be a string, got int'):
        resolve_data(write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "Add.", "input": 2}]), kind="prompts")


def test_columns_of_any_type_kept_and_completion_ids_left_out(tmp_path):
    row = {"prompt": "Q", "answer": 4, "tests": ["assert f(1) == 2"], "meta": {"id": 7, "tags": None},
           "completion_ids": [1, 2]}   # TRL leaves this column out of the reward functions' columns
    (record,), _, _ = load_records(write_jsonl(tmp_path / "d.jsonl", [row]), kind="prompts")
    assert record.columns == {"answer": 4, "tests": ["assert f(1) == 2"], "meta": {"id": 7, "tags": None}}


def test_columns_mapped_and_folder_splits(tmp_path):
    rows = [{"question": f"Q{i}?", "gold": str(i), "id": i} for i in range(4)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_parquet(tmp_path / "validation.parquet", rows[:1])
    write_json(tmp_path / "test.json", rows[1:3])
    s = resolve_data(tmp_path, columns="prompt=question,answer=gold", kind="prompts")
    assert s.format == "prompt" and not s.valid_held_out
    assert [r.prompt for r in s.train] == ["Q0?", "Q1?", "Q2?", "Q3?"]
    assert s.train[2].columns == {"answer": "2", "id": 2} and len(s.valid) == 1 and len(s.test) == 2
    assert s.test[0].source == f"{tmp_path / 'test.json'}:1"


def test_formats_of_one_form_mix_in_a_file(tmp_path):
    rows = [{"prompt": "Q1", "completion": "A1"}, {"prompt": "Q2"}, {"prompt": "Q3", "completion": None}]
    records, fmt, _ = load_records(write_parquet(tmp_path / "d.parquet", rows), kind="prompts")
    assert fmt == "prompt-completion" and [r.columns for r in records] == [{"answer": "A1"}, {}, {}]
    rows = [{"messages": [U("Q1"), A("A1")]}, {"prompt": [U("Q2")]}]
    records, fmt, _ = load_records(write_jsonl(tmp_path / "c.jsonl", rows), kind="prompts")
    assert fmt == "chat" and [r.prompt for r in records] == [[U("Q1")], [U("Q2")]]


def test_held_out_split_and_skip_invalid(tmp_path):
    rows = [{"prompt": f"Q{i}?"} for i in range(10)] + [{"prompt": ""}, {"text": "no prompt"}]
    s = resolve_data(write_jsonl(tmp_path / "d.jsonl", rows), valid_split=0.2, seed=3, skip_invalid=True,
                     kind="prompts")
    assert (len(s.train), len(s.valid), s.n_skipped) == (8, 2, 2) and s.valid_held_out
    assert all(isinstance(r, PromptRecord) for r in s.train + s.valid)


STRING, MESSAGES = {"prompt": "fine", "answer": "1"}, {"prompt": [U("fine")], "answer": "1"}  # good first records
BAD = [
    (STRING, {"text": "no prompt here"}, 'no prompt (keys: text); expected {"prompt": "..."}'),
    (STRING, {"input": "2+2", "output": "4"}, 'no prompt (keys: input, output)'),
    (STRING, {"chosen": "a", "rejected": "b"}, "no prompt (keys: chosen, rejected)"),
    (STRING, {"prompt": "  "}, 'field "prompt" is empty'),
    (STRING, {"prompt": 3}, 'field "prompt" must be a string, got int'),
    (MESSAGES, {"prompt": []}, '"prompt" must be a non-empty list'),
    (MESSAGES, {"prompt": [U("Q"), A("A")]},
     'the prompt in "prompt" must end with a user message, not with an assistant message'),
    (MESSAGES, {"prompt": [S("sys")]}, 'must end with a user message, not with a system message'),
    (MESSAGES, {"prompt": [{"role": "robot", "content": "hi"}]}, "message 0 has role 'robot'"),
    (STRING, {"prompt": "Q", "completion": [A("4")]},
     '"prompt" and "completion" must both be strings or both message lists'),
    (MESSAGES, {"prompt": [U("Q")], "completion": [U("4")]}, '"completion" has no assistant message'),
    (STRING, {"prompt": "Q", "prompts": ["x"]}, 'column "prompts" is named as an argument reward functions get'),
    (STRING, {"prompt": [U("Q")]}, "record looks like conversational prompt format"),
    (STRING, "[1, 2]", "expected a JSON object, got list"),
]
CHAT_BAD = [
    ({"messages": [A("only an answer")]}, '"messages" holds only an answer, no prompt'),
    ({"messages": [U("Q"), A("a"), A("b")]}, 'must end with a user message, not with an assistant message'),
]


@pytest.mark.parametrize("good,bad,problem", BAD + [({"messages": [U("fine")]},) + c for c in CHAT_BAD])
def test_bad_record_names_file_and_line(tmp_path, good, bad, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [good, bad])
    with pytest.raises(DataError) as e:
        resolve_data(path, kind="prompts")
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{path}:2: ") and problem in line, line


@pytest.mark.parametrize("suffix", list(WRITERS))
def test_a_dataset_without_prompts(tmp_path, suffix):
    path = WRITERS[suffix](tmp_path / f"d.{suffix}", [{"text": "a"}, {"text": "b"}])
    with pytest.raises(DataError, match=rf"^{path}:1: no prompt \(keys: text\)") as e:
        resolve_data(path, kind="prompts")
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"no valid .*\(2 skipped\)$"):
        resolve_data(path, kind="prompts", skip_invalid=True)


def test_string_and_conversational_prompts_do_not_mix_across_files(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Q"}] * 2)
    write_jsonl(tmp_path / "valid.jsonl", [{"messages": [U("Q"), A("a")]}])
    with pytest.raises(DataError, match="string prompts do not mix with conversational"):
        resolve_data(tmp_path, kind="prompts")


# ---------------------------------------------------------------------------------------------------------------
# tokenization: equal to TRL 1.16's GRPOTrainer

CORPUS = ["hello world, the cat sat on the mat.", "what is two plus two? it is four.",
          "you are a helpful assistant. answer the question briefly.", "the quick brown fox jumps over the lazy dog"]
CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> (our Tokenizer, transformers' tokenizer as TRL loads it): ChatML turns without BOS; a Llama-like
    vocabulary whose post-processor adds <s> and whose template writes <s> and folds the system text into the
    last user turn."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("grpo_tok")
    chatml = tokenizer_folder(root / "chatml", train_bpe(CORPUS, vocab_size=330), CHATML)
    llama = train_bpe(CORPUS, vocab_size=330, specials=["<unk>", "<s>", "</s>"])
    llama.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    llama = tokenizer_folder(root / "llama", llama, LAST_USER_SYSTEM, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    return {name: (load_tokenizer(path), AutoTokenizer.from_pretrained(str(path), truncation_side="left",
                                                                       padding_side="left"))
            for name, path in (("chatml", chatml), ("llama", llama))}


STANDARD = [{"prompt": "what is two plus two?", "answer": "four"}, {"prompt": "the quick brown"},
            {"prompt": " hello world<|endoftext|>"}]   # a special token written in the text stays one token
CONVERSATIONAL = [{"prompt": [U("what is two plus two?")], "answer": "four"},
                  {"prompt": [S("answer the question briefly."), U("what is two plus two?"), A("four."),
                              U("sure?")]},
                  {"messages": [S("you are a helpful assistant."), U("hello world"), A("the lazy dog")]}]


def _trl_prompt_ids(hf, prompts):
    """TRL 1.16's own path: GRPOTrainer._tokenize_prompts with a stand-in self holding what it reads."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    trainer = types.SimpleNamespace(processing_class=hf, _is_vlm=False, environment_factories=None, tools=None,
                                    chat_template=None, chat_template_kwargs={})
    prompt_ids, images, fields = GRPOTrainer._tokenize_prompts(trainer, prompts)
    assert images is None and not fields
    return [list(ids) for ids in prompt_ids]


@pytest.mark.parametrize("tok_name", ["chatml", "llama"])
@pytest.mark.parametrize("rows", [STANDARD, CONVERSATIONAL], ids=["standard", "conversational"])
def test_prompt_tokens_equal_trl(tmp_path, tokenizers, tok_name, rows):
    from trl.data_utils import maybe_apply_chat_template

    tok, hf = tokenizers[tok_name]
    if tok_name == "llama":
        rows = [{k: v.replace("<|endoftext|>", "</s>") if isinstance(v, str) else v for k, v in r.items()}
                for r in rows]
    records = resolve_data(write_jsonl(tmp_path / "d.jsonl", rows), valid_split=0.0, kind="prompts").train
    examples, stats = tokenize_prompts(tok, records, max_prompt_length=None)
    expected = _trl_prompt_ids(hf, [r.prompt for r in records])
    assert [e.input_ids.tolist() for e in examples] == expected
    assert all(e.input_ids.dtype == np.int32 and e.record is r and not e.truncated for e, r in zip(examples, records))
    assert (stats.n_examples, stats.n_truncated, stats.n_tokens) == (3, 0, sum(map(len, expected)))
    for r in records:   # the text TRL's maybe_apply_chat_template renders is the text tokenized
        text = maybe_apply_chat_template({"prompt": r.prompt}, hf)["prompt"]
        rendered = tok.apply_chat_template(r.prompt, add_generation_prompt=True) if isinstance(r.prompt, list) \
            else r.prompt
        assert text == rendered
    bos = tok.bos_token_id
    if tok_name == "llama":   # one BOS: the post-processor's on strings, the template's on conversations
        assert all(e.input_ids[0] == bos and (e.input_ids == bos).sum() == 1 for e in examples)
    else:
        assert bos is None


def test_max_prompt_length_keeps_the_prompt_end(tokenizers):
    tok, _ = tokenizers["chatml"]
    records = [PromptRecord([U("what is two plus two? it is four.")], {}, "f.jsonl:1"), PromptRecord("hello", {})]
    whole, _ = tokenize_prompts(tok, records)
    cut, stats = tokenize_prompts(tok, records, max_prompt_length=5)
    assert cut[0].input_ids.tolist() == whole[0].input_ids[-5:].tolist() and cut[0].truncated
    assert cut[1].input_ids.tolist() == whole[1].input_ids.tolist() and not cut[1].truncated
    assert (stats.n_truncated, stats.max_tokens) == (1, 5)
    assert stats.describe() == "2 prompts: 2 kept, up to 5 tokens (1 truncated to max_prompt_length)"
    with pytest.raises(ConfigError, match="max_prompt_length must be at least 1, got 0"):
        tokenize_prompts(tok, records, max_prompt_length=0)


def test_raw_mode_asks_as_sft_raw_mode_asks(tokenizers):
    tok, _ = tokenizers["llama"]
    messages = [S("answer the question briefly."), U("what is two plus two?")]
    (example,), _ = tokenize_prompts(tok, [PromptRecord(messages, {})], use_chat_template=False)
    assert example.input_ids.tolist() == generation_prompt_ids(tok, messages, chat_template=False)
    assert example.input_ids[0] == tok.bos_token_id


def test_template_refusal_names_the_record_or_is_skipped(tokenizers):
    tok, _ = tokenizers["llama"]   # LAST_USER_SYSTEM refuses two user turns in a row
    records = [PromptRecord([U("hello")], {}, "d.jsonl:1"), PromptRecord([U("a"), U("b")], {}, "d.jsonl:2")]
    with pytest.raises(DataError, match=r"^d\.jsonl:2: chat template refused the conversation: expected alternating"):
        tokenize_prompts(tok, records)
    examples, stats = tokenize_prompts(tok, records, skip_invalid=True)
    assert len(examples) == 1 and stats.n_skipped == 1
    assert stats.describe() == f"2 prompts: 1 kept, up to {len(examples[0])} tokens, 1 skipped (refused by the chat template)"


# ---------------------------------------------------------------------------------------------------------------
# the embedded demo

def test_demo_prompts_from_the_embedded_task():
    from wgpu_train.training.rewards import compute_rewards, load_rewards

    s = demo_prompt_splits()
    assert (len(s.train), len(s.valid), len(s.test)) == (2000, 100, 100) and "embedded task" in s.format
    for record in s.train[:50] + s.valid + s.test:
        (message,) = record.prompt
        assert message["role"] == "user" and message["content"].startswith("Reverse the order of these words: ")
        words = message["content"].split(": ", 1)[1].split()
        assert set(words) <= set(WORDS) and record.columns == {"answer": " ".join(reversed(words))}
    answers = [r.columns["answer"] for r in s.test]
    rewards = compute_rewards(load_rewards([DEMO_REWARD]), [r.prompt for r in s.test], [[A(a)] for a in answers],
                              {"answer": answers}, step=0)
    assert rewards.shape == (100, 1) and (rewards == 1.0).all()
