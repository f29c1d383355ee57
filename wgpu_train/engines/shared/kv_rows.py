"""The KV cache's calls as both engines take them: forward_rows' arguments checked against the cache, the
vocabulary and the adapter bank, and forward_cached (every row advanced together) written once over an
engine's forward_rows."""
from __future__ import annotations

import numpy as np


def check_rows(ids, rows, positions, last, kv: dict, vocab_size: int) -> tuple:
    """The arguments of an engine's forward_rows as int arrays, after checking that they fit the cache and
    the vocabulary, and that no two tokens of the call write the same cache slot (row, position)."""
    ids, rows, positions, last = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (ids, rows, positions, last))
    n = ids.shape[0]
    if rows.shape[0] != n or positions.shape[0] != n:
        raise ValueError(f"forward_rows: {n} ids but {rows.shape[0]} rows and {positions.shape[0]} positions")
    if n and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"forward_rows: token ids must lie in [0, {vocab_size})")
    if np.unique(rows * kv["max_len"] + positions).size < n:
        raise ValueError("forward_rows: two tokens of one call write the same cache row and position")
    if n and (rows.min() < 0 or rows.max() >= kv["batch"] or positions.min() < 0 or positions.max() >= kv["max_len"]):
        raise ValueError(f"forward_rows: rows must lie in [0, {kv['batch']}) and positions in [0, {kv['max_len']})")
    if last.size and (last.min() < 0 or last.max() >= n or last.size > n):
        raise ValueError(f"forward_rows: need at most {n} indices `last` in [0, {n})")
    return ids, rows, positions, last


def check_adapters(adapters, n: int, bank: dict):
    """forward_rows' per-token adapters as an int array (n,), checked against the bank's size; None stays None."""
    if adapters is None:
        return None
    adapters = np.asarray(adapters, dtype=np.int64).reshape(-1)
    size = next(iter(bank.values())).k if bank else 0          # every module's bank holds them all
    if adapters.shape[0] != n or (n and adapters.max() >= size):
        raise ValueError(f"forward_rows: {adapters.shape[0]} adapters for {n} tokens, each below the bank's {size}")
    return adapters


def forward_cached(engine, ids, kv: dict) -> np.ndarray:
    """Every row b of the cache takes tokens ids[b] (B, Tq) after its kv["len"] cached ones (forward_rows with
    all rows at the same length); returns logits (B, V) of each row's last token."""
    b, tq = ids.shape
    start = kv["len"]
    if b > kv["batch"] or start + tq > kv["max_len"]:
        raise ValueError("KV cache is full")
    rows = np.repeat(np.arange(b), tq)
    positions = np.tile(np.arange(start, start + tq), b)
    logits = engine.forward_rows(ids.reshape(-1), rows, positions, kv, np.arange(1, b + 1) * tq - 1)
    kv["len"] = start + tq
    return logits
