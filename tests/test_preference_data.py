"""Tests of preference data: TRL's paired (explicit, implicit; standard, conversational) and unpaired formats
through the readers, bad records, the embedded demo's pairs, and token ids equal to TRL 1.16's DPOTrainer and
KTOTrainer dataset processing and collators on the same records."""

import types

import numpy as np
import pytest
from bpe import tokenizer_folder, train_bpe
from chat_templates import LAST_USER_SYSTEM
from tokenizers import processors
from wgpu_train.data.preference_demo import demo_preference_records
from wgpu_train.data.preference_records import (PreferenceRecord, UnpairedRecord, extract_prompt,
                                                unpair_preferences)
from wgpu_train.data.preference_batching import kl_partners
from wgpu_train.data.preference_tokenize import (PreferenceExample, UnpairedExample, tokenize_preferences,
                                                 tokenize_unpaired)
from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.data.sources import load_records, resolve_data
from wgpu_train.errors import ConfigError, DataError
from wgpu_train.formats.tokenizer import load_tokenizer

from record_files import WRITERS, write_jsonl, write_parquet

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731
S = lambda text: {"role": "system", "content": text}  # noqa: E731

CORPUS = [
    "hello world, the cat sat on the mat.",
    "what is two plus two? it is four. it is five.",
    "you are a helpful assistant. answer the question briefly.",
    "the quick brown fox jumps over the lazy dog",
]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ---------------------------------------------------------------------------------------------------------------
# formats through the readers

FORMAT_CASES = [
    ("standard", "preference", {"prompt": "Q?", "chosen": " yes", "rejected": " no"},
     PreferenceRecord("Q?", " yes", " no")),
    ("conversational", "preference",
     {"prompt": [S("be brief"), U("Q?")], "chosen": [A("yes")], "rejected": [A("no")]},
     PreferenceRecord([S("be brief"), U("Q?")], [A("yes")], [A("no")])),
    ("multi-turn answers", "preference",
     {"prompt": [U("Q?")], "chosen": [A("yes"), U("sure?"), A("yes")], "rejected": [A("no")]},
     PreferenceRecord([U("Q?")], [A("yes"), U("sure?"), A("yes")], [A("no")])),
    ("implicit standard", "implicit preference", {"chosen": "Q? it is yes", "rejected": "Q? it is no"},
     PreferenceRecord("Q? it is", " yes", " no")),     # TRL's extract_prompt: the space goes with the answers
    ("implicit conversational", "implicit preference",
     {"chosen": [U("Q?"), A("yes")], "rejected": [U("Q?"), A("no")]},
     PreferenceRecord([U("Q?")], [A("yes")], [A("no")])),
    ("prompt column beside whole conversations", "implicit preference",   # UltraFeedback's layout: the prompt
     {"prompt": "Q?", "chosen": [U("Q?"), A("yes")], "rejected": [U("Q?"), A("no")]},  # is left for the shared part
     PreferenceRecord([U("Q?")], [A("yes")], [A("no")])),
]


@pytest.mark.parametrize("suffix", list(WRITERS))
@pytest.mark.parametrize("name,fmt,row,expected", FORMAT_CASES, ids=[c[0] for c in FORMAT_CASES])
def test_preference_formats(tmp_path, suffix, name, fmt, row, expected):
    path = WRITERS[suffix](tmp_path / f"d.{suffix}", [row, row])
    records, found, skipped = load_records(path, kind="preference")
    expected.source = f"{path}:2"
    assert (found, skipped) == (fmt, 0) and records[1] == expected


UNPAIRED_CASES = [
    ({"prompt": "Q?", "completion": " yes", "label": True}, UnpairedRecord("Q?", " yes", True)),
    ({"prompt": [U("Q?")], "completion": [A("no")], "label": False}, UnpairedRecord([U("Q?")], [A("no")], False)),
]


@pytest.mark.parametrize("suffix", list(WRITERS))
@pytest.mark.parametrize("row,expected", UNPAIRED_CASES)
def test_unpaired_formats(tmp_path, suffix, row, expected):
    path = WRITERS[suffix](tmp_path / f"d.{suffix}", [row])
    records, found, _ = load_records(path, kind="unpaired")
    expected.source = f"{path}:1"
    assert found == "unpaired" and records == [expected]


def test_columns_mapped_and_folder_splits(tmp_path):
    rows = [{"question": f"Q{i}?", "good": " yes", "bad": " no"} for i in range(3)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_parquet(tmp_path / "validation.parquet", rows[:1])
    s = resolve_data(tmp_path, columns="prompt=question,chosen=good,rejected=bad", kind="preference")
    assert s.format == "preference" and not s.valid_held_out
    assert [r.prompt for r in s.train] == ["Q0?", "Q1?", "Q2?"] and s.valid[0].chosen == " yes"
    kto = [{"q": "Q?", "a": " yes", "ok": i % 2 == 0} for i in range(4)]
    s = resolve_data(write_jsonl(tmp_path / "kto.jsonl", kto), valid_split=0.0,
                     columns="prompt=q,completion=a,label=ok", kind="unpaired")
    assert [r.label for r in s.train] == [True, False, True, False]


def test_sft_is_the_default_kind(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "P", "completion": "C"}])
    assert resolve_data(path, valid_split=0.0).format == "completions"
    with pytest.raises(DataError, match=":1: not a preference record"):
        resolve_data(path, kind="preference")
    with pytest.raises(ConfigError, match="unknown record kind 'dpo'"):
        resolve_data(path, kind="dpo")


def test_pairs_read_as_unpaired_as_trl_unpairs_them(tmp_path):
    """KTO reads pairs as TRL's unpair_preference_dataset does: per batch of 1000 pairs, chosen then rejected."""
    from datasets import Dataset
    from trl.data_utils import unpair_preference_dataset

    rows = [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(1003)]
    trl = unpair_preference_dataset(Dataset.from_list(rows)).to_list()
    ours = unpair_preferences([PreferenceRecord(r["prompt"], r["chosen"], r["rejected"]) for r in rows])
    assert [(r.prompt, r.completion, r.label) for r in ours] == [(r["prompt"], r["completion"], r["label"])
                                                                  for r in trl]
    s = resolve_data(write_jsonl(tmp_path / "d.jsonl", rows[:4]), valid_split=0.25, kind="unpaired")
    assert len(s.train) == 6 and len(s.valid) == 2 and s.valid[0].prompt == s.valid[1].prompt  # halves together


@pytest.mark.parametrize("chosen,rejected", [
    ("Q? it is yes", "Q? it is no"), ("same text", "same text"), ("abc", "abcd"), ("a b", "a c"),
    ([U("Q"), A("x")], [U("Q"), A("y")]), ([U("Q"), A("x")], [U("Q"), A("x"), U("R"), A("z")]),
    ([U("Q"), A("x")], [U("Q"), A("x")]),
])
def test_extract_prompt_equals_trl(chosen, rejected):
    from trl.data_utils import extract_prompt as trl_extract_prompt

    trl = trl_extract_prompt({"chosen": chosen, "rejected": rejected})
    assert extract_prompt(chosen, rejected) == (trl["prompt"], trl["chosen"], trl["rejected"])


# ---------------------------------------------------------------------------------------------------------------
# bad records

GOOD_PAIR = {"prompt": "Q?", "chosen": " yes", "rejected": " no"}
BAD_PAIRS = [
    ({"prompt": "Q?", "chosen": " yes"}, 'missing field "rejected"'),
    ({"prompt": "Q?", "rejected": " no"}, 'missing field "chosen"'),
    ({"prompt": "Q?", "chosen": " yes", "rejected": ""}, 'field "rejected" is empty'),
    ({"prompt": "", "chosen": " yes", "rejected": " no"}, 'field "prompt" is empty'),
    ({"prompt": "Q?", "chosen": 3, "rejected": " no"}, 'field "chosen" must be a string'),
    ({"prompt": "Q?", "completion": " yes", "label": True}, "not a preference record"),
    ({"chosen": " yes", "rejected": " no"}, "looks like implicit preference format"),
    ({"prompt": [U("Q?")], "chosen": [A("yes")], "rejected": " no"}, "must both be strings or both message lists"),
    ({"prompt": [U("Q?")], "chosen": [U("Q?"), A("yes")], "rejected": [U("Other?"), A("no")]},
     '"chosen" and "rejected" carry different prompts'),
    ({"prompt": [U("Q?")], "chosen": [A("yes")], "rejected": [U("no")]}, '"rejected" has no assistant message'),
    ({"prompt": [U("Q?")], "chosen": [A("yes")], "rejected": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
]
BAD_IMPLICIT = [
    ({"chosen": "yes", "rejected": "no"}, "share no prompt: they differ from their first character"),
    ({"chosen": [U("Q?"), A("yes")], "rejected": [U("R?"), A("no")]},
     "share no prompt: they differ from their first message"),
    ({"chosen": [U("Q?"), A("a"), U("more?"), A("yes")], "rejected": [U("Q?"), A("a"), U("less?"), A("no")]},
     '"chosen" continues the shared prompt with a user message'),
    ({"chosen": [U("Q?"), A("yes")]}, 'missing field "rejected"'),
]


@pytest.mark.parametrize("good,bad,problem", [(GOOD_PAIR, b, p) for b, p in BAD_PAIRS]
                         + [({"chosen": "Q? yes", "rejected": "Q? no"}, b, p) for b, p in BAD_IMPLICIT])
def test_bad_pair_names_file_and_line(tmp_path, good, bad, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [good, "", bad, good])
    with pytest.raises(DataError) as e:
        resolve_data(path, kind="preference")
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: ") and problem in msg and "\n" not in msg, msg
    records, _, skipped = load_records(path, skip_invalid=True, kind="preference")
    assert (len(records), skipped) == (2, 1)


@pytest.mark.parametrize("bad,problem", [
    ({"prompt": "Q?", "completion": " yes"}, 'missing field "label"'),
    ({"prompt": "Q?", "label": True}, 'missing field "completion"'),
    ({"prompt": "Q?", "completion": " yes", "label": "yes"}, "field \"label\" must be true or false, got 'yes'"),
    ({"prompt": "Q?", "completion": [A("yes")], "label": True}, "must both be strings or both message lists"),
    ({"completion": " yes", "label": False}, 'missing field "prompt"'),
    (GOOD_PAIR, "looks like preference format"),
])
def test_bad_unpaired_record(tmp_path, bad, problem):
    good = {"prompt": "Q?", "completion": " yes", "label": True}
    path = write_jsonl(tmp_path / "d.jsonl", [good, bad, dict(good, label=False)])
    with pytest.raises(DataError) as e:
        resolve_data(path, kind="unpaired")
    assert str(e.value).startswith(f"{path}:2: ") and problem in str(e.value)
    s = resolve_data(path, valid_split=0.0, skip_invalid=True, kind="unpaired")
    assert (len(s.train), s.n_skipped) == (2, 1)


def test_unpaired_needs_both_labels(tmp_path):
    rows = [{"prompt": f"Q{i}?", "completion": " yes", "label": True} for i in range(3)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ConfigError) as e:
        resolve_data(path, valid_split=0.0, kind="unpaired")
    assert str(e.value) == (f"{path}: all 3 unpaired records are desirable (label true); KTO needs both desirable "
                            "and undesirable examples")
    mixed = write_jsonl(tmp_path / "pairs.jsonl", [GOOD_PAIR])
    with pytest.raises(DataError, match="paired preference records do not mix with unpaired ones"):
        resolve_data([path, mixed], valid_split=0.0, kind="unpaired")


# ---------------------------------------------------------------------------------------------------------------
# tokenization: equal to TRL 1.16


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> (folder, our Tokenizer, transformers' tokenizer): ChatML turns without BOS; a Llama-like vocabulary
    whose post-processor adds <s> and whose template folds the system text into the last user turn."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("pref_tok")
    chatml = tokenizer_folder(root / "chatml", train_bpe(CORPUS, vocab_size=330), CHATML)
    llama = train_bpe(CORPUS, vocab_size=330, specials=["<unk>", "<s>", "</s>"])
    llama.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    llama = tokenizer_folder(root / "llama", llama, LAST_USER_SYSTEM, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    return {name: (path, load_tokenizer(path), AutoTokenizer.from_pretrained(str(path)))
            for name, path in (("chatml", chatml), ("llama", llama))}


STANDARD = [{"prompt": "what is two plus two?", "chosen": " it is four.", "rejected": " it is five."},
            {"prompt": "the quick brown", "chosen": " fox jumps over the lazy dog", "rejected": " cat"},
            {"prompt": "hello", "chosen": " world<|endoftext|>", "rejected": " the mat."}]  # EOS already there
CONVERSATIONAL = [
    {"prompt": [U("what is two plus two?")], "chosen": [A("it is four.")], "rejected": [A("it is five. it is.")]},
    {"prompt": [S("answer the question briefly."), U("what is two plus two?"), A("four."), U("sure?")],
     "chosen": [A("it is four.")], "rejected": [A("the cat sat on the mat.")]},
    {"prompt": [S("you are a helpful assistant."), U("hello world")],   # prompt renders differently alone with
     "chosen": [A("hello"), U("the quick brown fox?"), A("jumps")],    # LAST_USER_SYSTEM: split where they diverge
     "rejected": [A("the lazy dog")]},
]
IMPLICIT_STANDARD = [{"chosen": "what is two plus two? it is four.", "rejected": "what is two plus two? it is five."},
                     {"chosen": "the quick brown fox", "rejected": "the quick brown dog"}]
IMPLICIT_CONVERSATIONAL = [{"chosen": [U("what is two?"), A("it is four.")], "rejected": [U("what is two?"), A("no")]},
                           {"chosen": [U("hello"), A("world")], "rejected": [U("hello"), A("the cat sat")]}]
DATASETS = {"standard": STANDARD, "conversational": CONVERSATIONAL, "implicit standard": IMPLICIT_STANDARD,
            "implicit conversational": IMPLICIT_CONVERSATIONAL}
# (max_length, truncation_mode): no limit; cuts into answers; cuts into prompts (keep_start drops those pairs)
LIMITS = [(None, "keep_start"), (14, "keep_start"), (14, "keep_end"), (6, "keep_start"), (6, "keep_end")]


def _trl_dpo(hf, rows, max_length, truncation_mode):
    """TRL 1.16's own path: DPOTrainer._prepare_dataset (a stand-in self holding only the tokenizer it reads)
    and DataCollatorForPreference's truncation; -> [(chosen ids, chosen mask, rejected ids, rejected mask)]."""
    from datasets import Dataset
    from trl import DPOConfig
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    args = DPOConfig(output_dir="unused", max_length=max_length, truncation_mode=truncation_mode, use_cpu=True,
                     bf16=False, report_to=[])
    ds = DPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenizer=hf), Dataset.from_list(rows), hf, args, "train")
    collator = DataCollatorForPreference(pad_token_id=-1, max_length=max_length, truncation_mode=truncation_mode)
    out = []
    for ex in ds:
        batch = collator([{k: ex[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}])
        ids, mask, real = (batch[k].numpy() for k in ("input_ids", "completion_mask", "attention_mask"))
        out.append(tuple(a[r][real[r] == 1] for r in (0, 1) for a in (ids, mask)))
    return out


def _ours(example_rows):
    out = []
    for row in example_rows:
        out += [row.input_ids, (row.labels != IGNORE_INDEX).astype(np.int64)]
        assert np.array_equal(row.labels[row.labels != IGNORE_INDEX], row.input_ids[row.labels != IGNORE_INDEX])
    return tuple(out)


@pytest.mark.filterwarnings("ignore:The `'keep_end'` truncation mode is deprecated:FutureWarning")
@pytest.mark.parametrize("tok_name", ["chatml", "llama"])
@pytest.mark.parametrize("data", list(DATASETS))
def test_dpo_tokens_equal_trl(tmp_path, tokenizers, tok_name, data):
    _, tok, hf = tokenizers[tok_name]
    rows = DATASETS[data]
    if tok_name == "llama":  # EOS written into the text is this vocabulary's
        rows = [{k: v.replace("<|endoftext|>", "</s>") if isinstance(v, str) else v for k, v in r.items()}
                for r in rows]
    records = resolve_data(write_jsonl(tmp_path / "d.jsonl", rows), valid_split=0.0, kind="preference").train
    for max_length, mode in LIMITS:
        examples, stats = tokenize_preferences(tok, records, max_length, truncation_mode=mode)
        trl = _trl_dpo(hf, rows, max_length, mode)
        assert len(examples) == len(trl) == stats.n_examples and stats.n_examples + stats.n_dropped == len(rows)
        for ex, expected in zip(examples, trl):
            got = _ours(ex.rows())
            assert all(np.array_equal(a, b) for a, b in zip(got, expected)), (max_length, mode, got, expected)
            assert ex.truncated == any(len(r) == max_length and max_length < len(ex.prompt_ids) + len(c)
                                       for r, c in zip(ex.rows(), (ex.chosen_ids, ex.rejected_ids)))
        if max_length == 6 and mode == "keep_start":
            assert stats.n_dropped > 0 or data.startswith("implicit")
    if tok_name == "llama" and not data.endswith("conversational"):
        assert tok.add_bos_token and examples[0].prompt_ids[0] == tok.bos_token_id  # BOS from the post-processor


def _trl_kto(hf, rows, max_length, batch_size):
    """TRL 1.16's KTOTrainer._prepare_dataset and DataCollatorForUnpairedPreference, per batch of `batch_size`:
    -> [(ids, mask, KL ids, KL mask, label)]."""
    from datasets import Dataset
    from trl import KTOConfig
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference, KTOTrainer

    args = KTOConfig(output_dir="unused", max_length=max_length, per_device_train_batch_size=batch_size,
                     use_cpu=True, bf16=False, report_to=[])
    stub = types.SimpleNamespace(_tokenizer=hf, calculate_KL=True, desirable_weight=1.0, undesirable_weight=1.0)
    ds = KTOTrainer._prepare_dataset(stub, Dataset.from_list(rows), hf, args, "train")
    collator = DataCollatorForUnpairedPreference(pad_token_id=-1, max_length=max_length)
    keys = ("prompt_ids", "completion_ids", "KL_completion_ids", "label")
    out = []
    for ex in ds:
        b = collator([{k: ex[k] for k in keys}])
        out.append((b["input_ids"][0][b["attention_mask"][0] == 1].numpy(),
                    b["completion_mask"][0][b["attention_mask"][0] == 1].numpy(),
                    b["KL_input_ids"][0][b["KL_attention_mask"][0] == 1].numpy(),
                    b["KL_completion_mask"][0][b["KL_attention_mask"][0] == 1].numpy(), bool(b["label"][0])))
    return out


@pytest.mark.parametrize("tok_name", ["chatml", "llama"])
@pytest.mark.parametrize("data", ["standard", "conversational", "paired conversational"])
def test_kto_tokens_and_kl_rows_equal_trl(tmp_path, tokenizers, tok_name, data):
    _, tok, hf = tokenizers[tok_name]
    if data == "paired conversational":
        rows = CONVERSATIONAL  # TRL's KTOTrainer unpairs them; so does resolve_data(kind="unpaired")
    else:
        source = STANDARD if data == "standard" else CONVERSATIONAL
        rows = [{"prompt": r["prompt"], "completion": r[key], "label": key == "chosen"}
                for key in ("chosen", "rejected") for r in source]
    if tok_name == "llama":
        rows = [{k: v.replace("<|endoftext|>", "</s>") if isinstance(v, str) else v for k, v in r.items()}
                for r in rows]
    records = resolve_data(write_jsonl(tmp_path / "d.jsonl", rows), valid_split=0.0, kind="unpaired").train
    batch_size = 4
    for max_length in (None, 14, 6):
        examples, stats = tokenize_unpaired(tok, records, max_length)
        trl = _trl_kto(hf, rows, max_length, batch_size)
        assert len(examples) == len(trl) and stats.n_dropped == len(records) - len(examples)
        partners = kl_partners(len(examples), batch_size)
        for i, (ex, (ids, mask, kl_ids, kl_mask, label)) in enumerate(zip(examples, trl)):
            got = _ours([ex.row(), ex.mismatched_row(examples[partners[i]])])
            assert all(np.array_equal(a, b) for a, b in zip(got, (ids, mask, kl_ids, kl_mask))), (max_length, i)
            assert ex.label == label


def test_max_prompt_length_keeps_the_prompt_end(tokenizers):
    _, tok, _ = tokenizers["chatml"]
    records = [PreferenceRecord(r["prompt"], r["chosen"], r["rejected"]) for r in STANDARD]
    whole, _ = tokenize_preferences(tok, records, None)
    cut, stats = tokenize_preferences(tok, records, 10, max_prompt_length=3)
    assert stats.n_dropped == 0  # every prompt now fits
    for w, c in zip(whole, cut):
        assert np.array_equal(c.prompt_ids, w.prompt_ids[-3:]) and np.array_equal(c.chosen_ids, w.chosen_ids)
        assert len(c.rows()[0]) == min(10, len(c.prompt_ids) + len(c.chosen_ids))


def test_raw_mode_lays_conversations_out_as_sft_does(tokenizers):
    _, tok, _ = tokenizers["chatml"]
    record = PreferenceRecord([U("what is two plus two?")], [A("it is four.")], [A("five.")])
    (ex,), _ = tokenize_preferences(tok, [record], None, use_chat_template=False)
    assert tok.decode(ex.prompt_ids, skip_special_tokens=False) == "what is two plus two?\n\n"
    assert tok.decode(ex.chosen_ids, skip_special_tokens=False) == "it is four.<|endoftext|>"
    (same,), _ = tokenize_preferences(tok, [PreferenceRecord("what is two plus two?\n\n", "it is four.", "five.")],
                                      None)
    assert np.array_equal(ex.rows()[0].input_ids, same.rows()[0].input_ids)


def test_template_refusal_names_the_record_or_is_skipped(tmp_path, tokenizers):
    _, tok, _ = tokenizers["llama"]  # LAST_USER_SYSTEM refuses two user turns in a row
    rows = [CONVERSATIONAL[0], {"prompt": [U("a"), U("b")], "chosen": [A("x")], "rejected": [A("y")]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    records = resolve_data(path, valid_split=0.0, kind="preference").train
    with pytest.raises(DataError, match=f"^{path}:2: chat template refused the conversation"):
        tokenize_preferences(tok, records, 32)
    examples, stats = tokenize_preferences(tok, records, 32, skip_invalid=True)
    assert (len(examples), stats.n_skipped) == (1, 1)
    assert stats.describe() == "2 pairs: 1 kept, 1 skipped (refused by the chat template)"


def test_stats_describe_and_settings(tokenizers):
    _, tok, _ = tokenizers["chatml"]
    records = [PreferenceRecord(r["prompt"], r["chosen"], r["rejected"]) for r in STANDARD]
    _, stats = tokenize_preferences(tok, records, 6)
    assert stats.n_truncated + stats.n_dropped > 0
    assert stats.describe().startswith("3 pairs: ") and "dropped (the prompt fills max_length)" in stats.describe()
    unpaired = unpair_preferences(records)
    _, stats = tokenize_unpaired(tok, unpaired, 64)
    assert stats.describe() == "6 records: 6 kept, 3 desirable / 3 undesirable"
    with pytest.raises(ConfigError, match="keep_start only"):
        tokenize_unpaired(tok, unpaired, 64, truncation_mode="keep_end")
    with pytest.raises(ConfigError, match="truncation_mode must be one of keep_start, keep_end"):
        tokenize_preferences(tok, records, 64, truncation_mode="left")


def test_rows_label_completion_tokens_only():
    ex = PreferenceExample(np.array([5, 6, 7], np.int32), np.array([8, 9], np.int32), np.array([4], np.int32),
                           max_length=4, truncation_mode="keep_end")
    chosen, rejected = ex.rows()
    assert chosen.input_ids.tolist() == [6, 7, 8, 9] and chosen.labels.tolist() == [IGNORE_INDEX] * 2 + [8, 9]
    assert rejected.input_ids.tolist() == [5, 6, 7, 4] and rejected.n_trained == 1 and chosen.truncated
    kto = UnpairedExample(np.array([1, 2], np.int32), np.array([3], np.int32), True, max_length=3)
    other = UnpairedExample(np.array([1], np.int32), np.array([7, 8, 9], np.int32), False, max_length=3)
    assert kto.mismatched_row(other).input_ids.tolist() == [1, 2, 7] and kto.row().n_trained == 1
    assert kl_partners(7, 3).tolist() == [2, 0, 1, 5, 3, 4, 6]


# ---------------------------------------------------------------------------------------------------------------
# the embedded demo's pairs


def test_demo_pairs_from_the_embedded_task():
    from wgpu_train.assets import default_data_dir

    sft = resolve_data(default_data_dir()).valid
    pairs = demo_preference_records(sft, np.random.default_rng(7))
    again = demo_preference_records(sft, np.random.default_rng(7))
    assert len(pairs) == len(sft) and pairs == again
    for record, pair in zip(sft, pairs):
        chosen, rejected = pair.chosen[0]["content"], pair.rejected[0]["content"]
        assert pair.prompt == record[:-1] and chosen == record[-1]["content"] and pair.source == record.source
        assert rejected != chosen and sorted(rejected.split()) == sorted(chosen.split())
    assert any(p.rejected[0]["content"] != q.rejected[0]["content"]
               for p, q in zip(pairs, demo_preference_records(sft, np.random.default_rng(8))))
