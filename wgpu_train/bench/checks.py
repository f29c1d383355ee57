"""What every kernel benchmark shares: a result's largest relative error, dispatches run and checked against
their reference before they are timed, and a recorder that captures dispatches for the Timer."""
from __future__ import annotations

import numpy as np


def max_rel_err(got, want) -> float:
    """The largest absolute error of got over want's largest magnitude."""
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


def check(rt, dispatches, c_buf, want) -> float:
    """Run the dispatches on a cleared C and return its max relative error; a wrong kernel must not
    report a speed (and one that writes nothing cannot pass on an earlier kernel's result)."""
    rec = rt.recorder()
    rec.clear(c_buf)
    for d in dispatches:
        rec.dispatch(*d)
    rec.submit()
    err = max_rel_err(rt.read(c_buf, np.float32, want.shape), want)
    if not err < 1e-4:
        raise AssertionError(f"benchmark kernel {dispatches[0][0]} gave a wrong result (max rel err {err:.2e})")
    return err


class Capture:
    """A stand-in Recorder that keeps (pipeline, resources, groups) instead of recording them (for Timer)."""

    def __init__(self, rt):
        self.rt, self.dispatches = rt, []

    def dispatch(self, pipeline, resources, groups):
        groups = tuple(int(g) for g in (groups if isinstance(groups, (tuple, list)) else (groups,)))
        self.dispatches.append((pipeline, resources, groups + (1,) * (3 - len(groups))))
