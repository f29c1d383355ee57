"""Generation's per-row recurrent state, for every recurrent layer kind (models/layer_plan.RECURRENT: LFM2's short
convolution keeps its last K-1 inputs; a linear-attention layer would keep its (heads, Dk, Dv) state), held in the
cache object beside the attention layers' keys and values, as both engines take it.

The cache gains "state" ({layer: {op param: (rows, *one row's shape)}}) and "state_pos" ((rows,) int64: the position
each row's state has reached). A state summarises a row up to one position, not each prefix, so a row's tokens in a
forward_rows call are consecutive: they start at 0 (the row's state starts from zero, whatever the slot held: a
new row in a freed slot) or where its state stands. DecodeBatch frees a leaving row's state (release), and keeps no
prefix of it for reuse (nothing to reuse but the whole row)."""
from __future__ import annotations

import numpy as np


def new_states(plans, layers, batch: int, dtype) -> dict:
    """The cache entries of the recurrent layers among `layers` (plans: every layer's LayerPlan, by layer): zeros
    for `batch` rows; {} for layers without state."""
    shapes = {i: plans[i].states for i in layers if plans[i].states}
    if not shapes:
        return {}
    return {"state": {i: {name: np.zeros((batch, *shape), dtype) for name, shape in layer.items()}
                      for i, layer in shapes.items()},
            "state_pos": np.zeros(batch, np.int64)}


def row_runs(kv: dict, rows, positions) -> list | None:
    """Each row's tokens of a forward_rows call as (row, their indices in the call (n,), the first one's position),
    checked: consecutive positions in the call's order, from 0 or from where the row's state stands. None for a
    cache without recurrent state."""
    if "state_pos" not in kv:
        return None
    runs = []
    for row in np.unique(rows):
        idx = np.flatnonzero(rows == row)
        start = int(positions[idx[0]])
        if not np.array_equal(positions[idx], np.arange(start, start + idx.size)):
            raise ValueError(f"forward_rows: row {row}'s tokens must take consecutive positions in order (its "
                             f"recurrent state advances one token at a time)")
        if start and start != kv["state_pos"][row]:
            raise ValueError(f"forward_rows: row {row} starts at position {start}, but its recurrent state holds "
                             f"{int(kv['state_pos'][row])} positions (a row continues where it stopped, or starts "
                             f"at 0)")
        runs.append((int(row), idx, start))
    return runs


def advance(kv: dict, runs):
    """After a forward_rows call: each row's state has reached its last token's position + 1."""
    for row, idx, start in runs or ():
        kv["state_pos"][row] = start + idx.size


def release(kv: dict, row: int):
    """A row left its slot: its state is dropped (the slot's next row must start at position 0)."""
    if "state_pos" in kv:
        kv["state_pos"][row] = 0
