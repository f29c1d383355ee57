"""Test helper for device limits: a smaller max storage binding, so that tiny weights are split into chunks as
large ones are on a real device."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def max_binding(rt, n: int):
    """Within the block, rt.max_binding is n (the buffers made there are chunked by it); restored after."""
    saved = rt.max_binding
    rt.max_binding = n
    try:
        yield
    finally:
        rt.max_binding = saved
