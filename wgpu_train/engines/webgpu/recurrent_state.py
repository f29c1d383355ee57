"""Generation's per-row recurrent state on the WebGPU engine, for every recurrent op kind (models/layer_plan.RECURRENT:
a short convolution's last K-1 inputs, a linear attention's (Hv, Dk, Dv) state): one float32 buffer (rows, *one
row's shape) per recurrent op, in the cache object beside the KV buffers, under the keys and host bookkeeping of
engines/shared/recurrent_state.py ("state", "state_pos"; row_runs, advance, release). A call's row runs are
uploaded as the short convolution's step table ("runs", "runs_table"), and a row that starts (position 0) has its
state zeroed first, so a kernel may read every row's state as it stands."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.shared.recurrent_state import advance, row_runs
from wgpu_train.engines.webgpu.short_conv import step_table

__all__ = ["new_states", "begin", "advance", "free"]


def new_states(rt, plans, layers, batch: int) -> dict:
    """The cache entries of the recurrent ops among `layers` (plans: every layer's LayerPlan, by layer): a zeroed
    float32 buffer (batch, *shape) per op param of each layer; {} for a model without recurrent layers."""
    shapes = {i: plans[i].states for i in layers if plans[i].states}
    if not shapes:
        return {}
    state = {i: {name: rt.upload(np.zeros((batch, *shape), np.float32), "recurrent_state")
                 for name, shape in layer.items()} for i, layer in shapes.items()}
    return {"state": state, "state_pos": np.zeros(batch, np.int64), "shapes": shapes, "runs": [],
            "runs_table": None}


def begin(rt, kv: dict, rows, positions) -> list | None:
    """Before recording a forward_rows call over the real tokens' rows and positions: its row runs checked
    (shared row_runs), the states of rows that start zeroed, the runs table uploaded (kv["runs_table"], grown as
    needed). None for a cache without recurrent state; pass the result to advance after the call."""
    runs = row_runs(kv, np.asarray(rows), np.asarray(positions))
    if runs is None:
        return None
    for row, _, start in runs:
        if start == 0:
            for i, layer in kv["state"].items():
                for name, buf in layer.items():
                    one = int(np.prod(kv["shapes"][i][name]))
                    rt.write(buf, np.zeros(one, np.float32), offset=4 * row * one)
    table = step_table(runs)
    if kv["runs_table"] is None or kv["runs_table"].size < table.nbytes:
        if kv["runs_table"] is not None:
            rt.release(kv["runs_table"])
        kv["runs_table"] = rt.buffer(max(64, 2 * table.nbytes), "runs_table")
    rt.write(kv["runs_table"], table)
    kv["runs"] = runs
    return runs


def free(rt, kv: dict):
    """Release a cache's state buffers (free_kv_cache)."""
    bufs = [b for layer in kv.get("state", {}).values() for b in layer.values()]
    if kv.get("runs_table") is not None:
        bufs.append(kv["runs_table"])
    rt.release(*bufs)
    kv["state"], kv["runs_table"] = {}, None
