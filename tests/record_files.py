"""Data files for the reader tests: rows (dicts, or raw lines for JSONL) written as JSONL, JSON or Parquet."""
from __future__ import annotations

import json

import pytest

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def write_json(path, rows):
    path.write_text(json.dumps(rows), encoding="utf-8")
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    return path


WRITERS = {"jsonl": write_jsonl, "json": write_json, "parquet": write_parquet}
