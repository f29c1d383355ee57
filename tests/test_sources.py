"""Data as users have it (JSON arrays and objects, Parquet, the hub's folder layout, several sources, globs,
column mapping) gives the same records, token ids and labels as the same records in JSONL; hub ids resolve
from a hub cache built here, offline, and give one clear line when they cannot."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from finetune_helpers import make_model_dir, records, write_jsonl
from wgpu_train.formats import hub
from wgpu_train.cli.main import main
from wgpu_train.data.sources import resolve_data
from wgpu_train.data.tokenize import tokenize_dataset
from wgpu_train.errors import ConfigError, DataError
from wgpu_train.data.sources import load_records, parse_columns
from wgpu_train.formats.tokenizer import load_tokenizer

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

CHATS = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
         for i in range(5)]


def _write_parquet(path, rows, row_group_size=2):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def _same(a, b):
    """Equal records (messages or text), whatever their sources."""
    return [list(r) if isinstance(r, list) else str(r) for r in a] == [list(r) if isinstance(r, list) else str(r)
                                                                       for r in b]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(make_model_dir(tmp_path_factory.mktemp("model")))


def _tokens(tok, recs):
    examples, _ = tokenize_dataset(tok, recs, 64)
    return [(e.input_ids.tolist(), e.labels.tolist()) for e in examples]


@pytest.mark.parametrize("rows", [records(7), CHATS], ids=["completions", "chat"])
def test_json_and_parquet_equal_jsonl(tmp_path, tokenizer, rows):
    want, fmt, _ = load_records(write_jsonl(tmp_path / "d.jsonl", rows) or tmp_path / "d.jsonl")
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=1))
    got_json, fmt_json, _ = load_records(tmp_path / "d.json")
    got_pq, fmt_pq, _ = load_records(_write_parquet(tmp_path / "d.parquet", rows))
    assert fmt_json == fmt_pq == fmt
    assert _same(got_json, want) and _same(got_pq, want)
    assert _tokens(tokenizer, got_json) == _tokens(tokenizer, want) == _tokens(tokenizer, got_pq)
    assert got_json[2].source == f"{tmp_path / 'd.json'}:3" and got_pq[2].source == f"{tmp_path / 'd.parquet'}:3"


def test_json_objects_of_arrays(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({"train": records(6), "validation": records(2, 50),
                                                 "test": records(1, 90)}))
    s = resolve_data(tmp_path / "s.json")
    assert (len(s.train), len(s.valid), len(s.test), s.valid_held_out) == (6, 2, 1, False)
    assert s.train[0].source.endswith("s.json:train[1]")
    (tmp_path / "o.json").write_text(json.dumps({"data": records(3), "more": records(2, 10)}))
    assert len(load_records(tmp_path / "o.json")[0]) == 5
    write_jsonl(tmp_path / "lines.json", records(4))                    # JSONL saved as .json
    assert _same(load_records(tmp_path / "lines.json")[0], load_records(write_jsonl(tmp_path / "l.jsonl", records(4))
                                                                        or tmp_path / "l.jsonl")[0])


def test_split_objects_and_duplicate_split_files_are_refused(tmp_path):
    (tmp_path / "heldout.json").write_text(json.dumps({"validation": records(2), "test": records(1)}))
    with pytest.raises(DataError, match="but no \"train\" array"):
        resolve_data(tmp_path / "heldout.json")
    (tmp_path / "two.json").write_text(json.dumps({"train": records(2), "valid": records(1),
                                                   "validation": records(1)}))
    with pytest.raises(DataError, match="are both the valid split"):
        resolve_data(tmp_path / "two.json")
    folder = tmp_path / "f"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", records(4))
    (folder / "train.json").write_text(json.dumps(records(4)))
    with pytest.raises(DataError, match="found train.jsonl and train.json; keep one train file"):
        resolve_data(folder)
    (folder / "train.json").unlink()
    (folder / "test.json").write_text(json.dumps({"train": records(1), "test": records(1)}))
    with pytest.raises(DataError, match="give this file itself as --data"):
        resolve_data(folder)
    (folder / "test.json").unlink()
    write_jsonl(folder / "train-old.jsonl", records(9))                  # not a shard name: ignored
    assert len(resolve_data(folder, valid_split=0).train) == 4


def test_hub_layout_folder_with_shards(tmp_path):
    data = tmp_path / "ds" / "data"
    data.mkdir(parents=True)
    _write_parquet(data / "train-00000-of-00002.parquet", records(4))
    _write_parquet(data / "train-00001-of-00002.parquet", records(3, 4))
    _write_parquet(data / "validation-00000-of-00001.parquet", records(2, 100))
    s = resolve_data(tmp_path / "ds")
    assert _same(s.train, load_records(write_jsonl(tmp_path / "t.jsonl", records(7)) or tmp_path / "t.jsonl")[0])
    assert len(s.valid) == 2 and not s.valid_held_out and "train-00001-of-00002.parquet" in s.files["train"]


def test_several_sources_and_globs(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", records(3))
    _write_parquet(tmp_path / "b.parquet", records(2, 10))
    (tmp_path / "c.json").write_text(json.dumps(CHATS[:2]))
    one = resolve_data([tmp_path / "a.jsonl", tmp_path / "b.parquet", tmp_path / "c.json"], valid_split=0)
    two = resolve_data(f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.parquet'},{tmp_path / 'c.json'}", valid_split=0)
    assert len(one.train) == 7 and _same(one.train, two.train) and one.format == "completions+chat"
    globbed = resolve_data(str(tmp_path / "*.jsonl"), valid_split=0)
    assert len(globbed.train) == 3
    (tmp_path / "t.jsonl").write_text('{"text": "plain"}\n')
    with pytest.raises(DataError, match="text format does not mix"):
        resolve_data([tmp_path / "a.jsonl", tmp_path / "t.jsonl"])
    with pytest.raises(DataError, match="no file matches"):
        resolve_data(str(tmp_path / "*.csv"))


def test_column_mapping(tmp_path, tokenizer):
    rows = [{"question": r["prompt"], "answer": r["completion"], "id": i} for i, r in enumerate(records(5))]
    _write_parquet(tmp_path / "qa.parquet", rows)
    s = resolve_data(tmp_path / "qa.parquet", valid_split=0, columns="prompt=question,completion=answer")
    want = load_records(write_jsonl(tmp_path / "w.jsonl", records(5)) or tmp_path / "w.jsonl")[0]
    assert s.format == "completions" and _same(s.train, want)
    assert _tokens(tokenizer, s.train) == _tokens(tokenizer, want)
    with pytest.raises(ConfigError, match="unknown field 'question'"):
        parse_columns("question=prompt")
    with pytest.raises(ConfigError, match="is not FIELD=COLUMN"):
        parse_columns("prompt")
    with pytest.raises(DataError, match=r"qa.parquet:1: no column 'reply' \(--columns completion=reply\)"):
        resolve_data(tmp_path / "qa.parquet", columns="prompt=question,completion=reply")


def test_bad_json_documents_and_records(tmp_path):
    (tmp_path / "n.json").write_text("42")
    with pytest.raises(DataError, match="must hold an array of records or an object of record arrays"):
        resolve_data(tmp_path / "n.json")
    rows = records(3) + [{"prompt": "x"}]
    (tmp_path / "bad.json").write_text(json.dumps(rows))
    with pytest.raises(DataError, match=r"bad.json:4: missing field \"completion\""):
        load_records(tmp_path / "bad.json")
    assert load_records(tmp_path / "bad.json", skip_invalid=True)[2] == 1
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_records(tmp_path / "broken.parquet")


# ---- hub ids -------------------------------------------------------------------------------------------------

def _cache_repo(cache, kind, repo, files_from=None, commit="0" * 40):
    """A repository snapshot in the hub cache's own layout (refs/main -> snapshots/<commit>/)."""
    root = cache / f"{kind}s--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    if files_from is not None:
        shutil.copytree(files_from, snap)
    else:
        snap.mkdir(parents=True)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture()
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_ids_resolve_from_the_cache_offline(tmp_path, offline_cache, monkeypatch):
    snap = _cache_repo(offline_cache, "model", "org/tiny")
    assert hub.resolve("org/tiny", "model") == snap
    with pytest.raises(ConfigError, match=r"org/absent is no local file or folder, nor in the Hugging Face cache, "
                                          r"and HF_HUB_OFFLINE is set; if it is a hub id, download it first with: "
                                          r"hf download org/absent$"):
        hub.resolve("org/absent", "model")
    with pytest.raises(ConfigError, match="--repo-type dataset --revision v9"):
        hub.resolve("org/absent@v9", "dataset")
    assert not hub.is_hub_id("just-a-name") and not hub.is_hub_id("a/b/c") and hub.is_hub_id("Qwen/Qwen3-0.6B@main")
    assert not hub.is_hub_id("data/trian.jsonl")                        # a mistyped file, not an id
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    assert not hub.is_hub_id("models/x")                                # under a local folder: a path
    with pytest.raises(ConfigError, match="not a valid Hugging Face hub id"):
        hub.resolve("acme/model--v2", "model")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert hub.resolve("org/tiny", "model") == hub.Path("org/tiny")      # a local folder of the same name wins


def test_finetune_and_eval_by_hub_ids(tmp_path, offline_cache, capsys):
    model = make_model_dir(tmp_path / "m")
    _cache_repo(offline_cache, "model", "org/tiny-llama", model)
    data = tmp_path / "d" / "data"
    data.mkdir(parents=True)
    _write_parquet(data / "train-00000-of-00001.parquet",
                   [{"q": r["prompt"], "a": r["completion"]} for r in records(10)])
    _cache_repo(offline_cache, "dataset", "org/toy", data.parent)
    out = tmp_path / "run"
    code = main(["finetune", "--model", "org/tiny-llama", "--data", "org/toy", "--columns", "prompt=q,completion=a",
                 "--out", str(out), "--backend", "numpy", "--max-steps", "2", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"].endswith("snapshots/" + "0" * 40) and summary["data_format"] == "completions"
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/tiny-llama"
    assert main(["generate", "--adapter-path", str(out), "--prompt", "after red 1?", "--max-new-tokens", "3",
                 "--backend", "numpy"]) == 0     # the base model found from the adapter's hub id, offline
    assert main(["eval", "--model", "org/tiny-llama", "--adapter-path", str(out), "--data", "org/toy",
                 "--columns", "prompt=q,completion=a", "--split", "train", "--backend", "numpy", "--json"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed[printed.index("{"):])
    assert np.isfinite(result["loss"])
    assert main(["finetune", "--model", "org/missing", "--out", str(tmp_path / "x"), "--backend", "numpy"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: org/missing is no local file or folder, nor in the Hugging Face cache, and HF_HUB_OFFLINE "
                   "is set; if it is a hub id, download it first with: hf download org/missing"]
