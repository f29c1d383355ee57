"""Configurations and source specialisation of the flash attention kernels: the register-blocked ones for CPU
adapters (shaders/attention_regs.wgsl, RegsConfig) and the workgroup-tiled ones for GPUs
(shaders/attention_tiles.wgsl, TilesConfig). Each configuration is one candidate for the autotuner.

Their sizes also size the kernels' register blocks, which WGSL cannot index by a loop variable without them
ending up in memory, so source() writes the blocks out: it rewrites the marked const block of the .wgsl text,
keeps the sections of one pass (forward, dq or dkv), writes the workgroup's index set-up that the passes share
(SETUPS) on each `// @setup` line, and writes each line holding a marker ($r, $k, $d, ...)
once per index of that marker (once per combination when a line holds several), with the marker replaced by
the index, on the same line, so that line numbers stay those of the file; shaders/attention_common.wgsl's
helpers and the pass's bindings follow the file's last line. The pass's activations are tensors in any storage
format: tensor markers, which launch expands for the formats of a dispatch (device/storage.py), read and written
through their vec4 views, which source() declares for the formats it is given (storage.views).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import product

from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.runtime import shader_text

PASSES = ("forward", "dq", "dkv")
ENTRIES = {"forward": "attention_forward", "dq": "attention_backward_dq", "dkv": "attention_backward_dkv"}
MAX_HEAD_DIM = 256
REGS_BUDGET = 2304       # f32 values an invocation of the register-blocked kernels may keep (llvmpipe's compile
                         # time grows steeply with it: about 30 s for the three passes of r8 at head dim 64)
TILES_BUDGET = 384       # f32 accumulators per invocation of the workgroup-tiled kernels (GPU registers)
COMMON = "attention_common"   # helpers appended to both kernels' text
_BEGIN, _END = "// @flash-config begin", "// @flash-config end"
SETUP = "// @setup "
# The index set-up of a workgroup, the same in the forward and the backward passes of both kernels, written once:
# source() writes it on the one line of a `// @setup KIND ROWS` marker (ROWS: the block's rows per workgroup).
SETUPS = {
    # a block of queries of head h of batch row b (the forward and dq passes); g is h's kv head
    "queries": "let lid = lid3.x; let t = p.s1; let h = wid.y; let b = wid.z; let g = h / (p.s2 / p.s3); "
               "let q0 = wid.x * {rows}; let qend = min(q0 + {rows}, t);",
    # a block of keys of kv head g of batch row b (the dk / dv pass), which rep query heads share
    "keys": "let lid = lid3.x; let t = p.s1; let g = wid.y; let b = wid.z; let rep = p.s2 / p.s3; "
            "let k0 = wid.x * {rows}; let kend = min(k0 + {rows}, t);",
}


@dataclass(frozen=True)
class RegsConfig:
    """shaders/attention_regs.wgsl: `rows` rows per invocation, `lanes` invocations per workgroup, the other
    side `chunk` rows at a time in tiles of `tile` rows."""

    rows: int
    lanes: int
    chunk: int
    tile: int = 32
    shader = "attention_regs"

    def __post_init__(self):
        if self.tile % self.chunk:
            raise ValueError(f"{self.name}: the tile must be a multiple of the chunk")

    @property
    def name(self) -> str:
        return f"regs/r{self.rows}l{self.lanes}k{self.chunk}t{self.tile}"

    @property
    def block(self) -> int:
        return self.rows * self.lanes

    def fits(self, head_dim: int) -> bool:
        return head_dim % 4 == 0 and head_dim <= MAX_HEAD_DIM and self.registers(head_dim) <= REGS_BUDGET

    def registers(self, head_dim: int) -> int:
        """f32 values per invocation the dk / dv pass keeps (the largest): k, v, dk, dv rows, a chunk of q, dout."""
        return (4 * self.rows + 2 * self.chunk) * head_dim

    def loop_iterations(self, T: int, rep: int, head_dim: int) -> int:
        """Loop iterations of one invocation at most (the dk / dv pass): per tile its segment ids, then a chunk
        loop per query head of the group."""
        tiles = -(-T // self.tile) + 1
        return tiles * (self.tile + 1 + rep * (self.tile // self.chunk + 1)) + 2 * self.block

    def workgroup_bytes(self, pass_: str) -> int:
        return 0

    def consts(self, head_dim: int) -> str:
        return (f"const D4: u32 = {head_dim // 4}u; const R: u32 = {self.rows}u; const NI: u32 = {self.lanes}u; "
                f"const TK: u32 = {self.chunk}u; const BT: u32 = {self.tile}u;")

    def counts(self, head_dim: int) -> dict:
        return {"$r": self.rows, "$k": self.chunk, "$d": head_dim // 4}


@dataclass(frozen=True)
class TilesConfig:
    """shaders/attention_tiles.wgsl: `rows` block rows (queries, or keys in the dk / dv pass) per workgroup of
    `lanes` invocations; the other side in tiles of 4 * groups * lanes rows (4 * groups per invocation in the
    score phase); the product phase splits the block's rows x head dim over (lanes / col_groups) x col_groups
    invocations."""

    rows: int
    lanes: int
    groups: int
    col_groups: int
    shader = "attention_tiles"

    def __post_init__(self):
        if self.lanes % 4 or self.lanes % self.col_groups or self.rows % (self.lanes // self.col_groups):
            raise ValueError(f"{self.name}: lanes must be a multiple of 4 and of col_groups, and lanes / "
                             "col_groups must divide the rows")

    @property
    def name(self) -> str:
        return f"tiles/q{self.rows}l{self.lanes}k{4 * self.groups}c{self.col_groups}"

    @property
    def block(self) -> int:
        return self.rows

    @property
    def tile(self) -> int:
        """Rows of the other side per tile."""
        return 4 * self.groups * self.lanes

    def fits(self, head_dim: int) -> bool:
        """Whether the head dim splits into col_groups groups of whole vec4s (and the accumulators stay few)."""
        return (head_dim % 4 == 0 and (head_dim // 4) % self.col_groups == 0 and head_dim <= MAX_HEAD_DIM
                and self.registers(head_dim) <= TILES_BUDGET)

    def loop_iterations(self, T: int, rep: int, head_dim: int) -> int:
        """Loop iterations of one invocation at most: the tile search (invocation 0), then per tile and query
        head the head-dim loop, the product loop and the row-partials loops."""
        tiles = -(-T // self.tile) + 1
        per_tile = head_dim // 4 + self.tile // 4 + 2 * (self.lanes // 4) + 2
        return tiles * (self.tile + 1) + tiles * rep * per_tile + 2 * self.rows

    def registers(self, head_dim: int) -> int:
        """f32 accumulators per invocation in the dk / dv pass (the largest): scores and dP, then dK and dV."""
        rows_each = self.rows // (self.lanes // self.col_groups)
        return 2 * self.rows * 4 * self.groups + 2 * rows_each * head_dim // self.col_groups

    def workgroup_bytes(self, pass_: str) -> int:
        """Workgroup memory of one pass: the P (and dS) tiles, per-row partials and flags."""
        tiles = {"forward": 1, "dq": 2, "dkv": 4}[pass_]     # P / dS tiles, double-buffered in the backward
        return tiles * self.rows * self.tile * 4 + self.rows * self.lanes * 4 + self.rows * 8 + 8

    def consts(self, head_dim: int) -> str:
        return (f"const D4: u32 = {head_dim // 4}u; const TQ: u32 = {self.rows}u; const NI: u32 = {self.lanes}u; "
                f"const KV: u32 = {self.groups}u; const DG: u32 = {self.col_groups}u;")

    def counts(self, head_dim: int) -> dict:
        rows_each = self.rows // (self.lanes // self.col_groups)
        return {"$q": self.rows, "$c": self.groups, "$o": rows_each, "$g": head_dim // 4 // self.col_groups}


def expand(lines: list[str], counts: dict) -> list[str]:
    """Each line holding markers written once per combination of their indices (see the module docstring)."""
    out = []
    for line in lines:
        present = [m for m in counts if m in line]
        if not present:
            out.append(line)
            continue
        body = line.split("//")[0].strip()   # a trailing comment would swallow the copies after it
        copies = []
        for idx in product(*(range(counts[m]) for m in present)):
            text = body
            for m, v in zip(present, idx):
                text = text.replace(m, str(v))
            copies.append(text)
        out.append(" ".join(copies))
    return out


@lru_cache(maxsize=None)
def source(cfg, pass_: str, head_dim: int, formats: tuple = ()) -> str:
    """The WGSL of one pass of cfg's kernels for this head dim, its vec4 views declared for the 16-bit tensors'
    sorted (binding, format) pairs `formats` (launch.Kernel.formats)."""
    if pass_ not in PASSES or not cfg.fits(head_dim):
        raise ValueError(f"flash attention {cfg.name}: pass {pass_!r}, head dim {head_dim}")
    lines = shader_text(cfg.shader).split("\n")
    i, j = lines.index(_BEGIN), lines.index(_END)
    lines[i:j + 1] = [cfg.consts(head_dim)] + [""] * (j - i)
    lines = [_setup(line) for line in lines]
    own = expand(_one_pass(lines, pass_), cfg.counts(head_dim))
    return storage.views("\n".join(own + _one_pass(shader_text(COMMON).split("\n"), pass_)), formats)


def _one_pass(lines: list[str], pass_: str) -> list[str]:
    """The lines with every @forward / @dq / @dkv section but pass_'s blanked (the markers too)."""
    out, keep = [], True
    for line in lines:
        s = line.strip()
        words = s[4:].rsplit(" ", 1) if s.startswith("// @") else []
        if len(words) == 2 and words[0] in PASSES and words[1] in ("begin", "end"):
            keep = words[1] == "end" or words[0] == pass_
            out.append("")
        else:
            out.append(line if keep else "")
    return out


def _setup(line: str) -> str:
    """A `// @setup KIND ROWS` marker line as SETUPS[KIND] for ROWS rows, on that one line; other lines as they are."""
    s = line.strip()
    if not s.startswith(SETUP):
        return line
    kind, rows = s[len(SETUP):].split()
    return line[:len(line) - len(line.lstrip())] + SETUPS[kind].format(rows=rows)
