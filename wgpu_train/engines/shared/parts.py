"""An engine's attributes that live in one of the parts it owns (both engines are made of parts)."""
from __future__ import annotations


def part_field(part: str, name: str, doc: str) -> property:
    """An engine attribute that is the part `part`'s attribute `name`, read and set there."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)
