"""Each pipeline stage's memory estimate against its device's memory (--device-memory, since WebGPU does not report
a GPU's memory size): a stage over its device's is refused in one line before any stage loads."""
from __future__ import annotations

import re

from wgpu_train.engines.resources import format_bytes
from wgpu_train.errors import ConfigError
from wgpu_train.models.stage_plan import per_stage

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([a-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes of a size as people write it: 24GiB, 1.5 GB, 512MiB, 1000000 (bytes)."""
    match = SIZE.match(text.lower())
    if match is None or match.group(2) not in UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"--device-memory: {text.strip()!r} is not a size; write e.g. 24GiB, 16GB or 512MiB")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def device_budgets(spec: str, stages: int) -> list[int]:
    """Each stage's device memory in bytes from --device-memory: one size for every stage, or one per stage."""
    return per_stage([parse_size(part) for part in spec.split(",")], stages, "--device-memory", "sizes")


def check_stages_fit(estimates: list, spec: str | None):
    """Refuse the first stage whose estimate (stage_memory's) exceeds its device's memory in `spec`."""
    if spec is None:
        return
    for s, (est, budget) in enumerate(zip(estimates, device_budgets(spec, len(estimates)))):
        if est["total"] > budget:
            raise ConfigError(
                f"pipeline stage {s} (layers {est['layers']}) needs an estimated {format_bytes(est['total'])}, over "
                f"its device's {format_bytes(budget)} (--device-memory): use more stages (--pipeline-stages), "
                f"fewer layers on it (--stage-layers), or --gradient-checkpointing")
