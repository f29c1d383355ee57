"""Tensor arguments of the GPU ops: a buffer, or a (buffer, element offset) view into one."""
from __future__ import annotations


def split(t) -> tuple:
    """(buffer, element offset) of a buffer or a (buffer, offset) view."""
    if isinstance(t, tuple):
        buf, off = t
        return buf, int(off)
    return t, 0


def at(t, offset: int):
    """The tensor argument t shifted by offset elements."""
    if isinstance(t, tuple):
        return (t[0], t[1] + offset)
    return (t, offset) if offset else t
