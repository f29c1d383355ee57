"""A tuned kernel family as one unit (catalogue.FAMILIES lists them): the files its kernels are built from, which
the tuner's cache checksum covers, every kernel it can launch, and the names of its `wgpu-train bench` entries."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from wgpu_train.engines.webgpu.device.runtime import shader_text


@dataclass(frozen=True)
class Family:
    """name: the family's name; shaders: the shaders/<name>.wgsl files its source builders read (the files they
    `// @include` follow them); modules: the paths of its Python files that build sources and list candidates
    (a change there changes what the tuner chose among); all_kernels: every launch.Kernel it can launch (the
    portability tests and `wgpu-train devices`); benches: its benchmarks' names in bench/suite.py's registry."""

    name: str
    shaders: tuple[str, ...]
    modules: tuple[str, ...]
    all_kernels: Callable[[], list]
    benches: tuple[str, ...] = ()

    def sources(self) -> list[tuple[str, bytes]]:
        """(file name, contents) of every file the family is built from: each shader with its includes, then
        each module. A missing file raises FileNotFoundError naming it and this family."""
        try:
            return ([(f"{name}.wgsl", shader_text(name).encode()) for name in self.shaders]
                    + [(Path(path).name, Path(path).read_bytes()) for path in self.modules])
        except FileNotFoundError as e:
            raise FileNotFoundError(f"kernel family {self.name}: {e}") from e
