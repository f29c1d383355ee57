"""The WGSL files: where they live, a shader's text with the files it `// @include`s, and a compiler message
turned into a ShaderError naming the file and line."""
from __future__ import annotations

import re
from pathlib import Path

from wgpu_train.errors import ShaderError


def shader_dirs() -> list[Path]:
    """Where the WGSL lives: the wheel's wgpu_train/_shaders, else the checkout's top-level shaders/."""
    package = Path(__file__).resolve().parents[3]          # wgpu_train/engines/webgpu/device/shaders.py
    return [package / "_shaders", package.parent / "shaders"]


def shader_path(name: str) -> Path:
    """shaders/<name>.wgsl (or the wheel's copy); FileNotFoundError naming it where neither exists."""
    for d in shader_dirs():
        p = d / f"{name}.wgsl"
        if p.is_file():
            return p
    raise FileNotFoundError(f"shader {name}.wgsl not found in {', '.join(map(str, shader_dirs()))}")


INCLUDE = "// @include "


def shader_text(name: str) -> str:
    """A shader's WGSL, with the shaders its `// @include <name>` lines name (and theirs, each once) appended
    after its own text (WGSL declarations may come in any order, so a compiler message keeps the shader's
    own line numbers)."""
    order: list = []

    def visit(n):
        for line in shader_path(n).read_text().split("\n"):
            if line.startswith(INCLUDE):
                inc = line[len(INCLUDE):].strip()
                if inc not in order and inc != name:
                    order.append(inc)
                    visit(inc)

    visit(name)
    return "\n".join(shader_path(n).read_text() for n in [name] + order)


def shader_error(path, source: str, err: Exception) -> ShaderError:
    """A ShaderError naming the file and line of the first diagnostic in a wgpu/naga message."""
    msg = str(err)
    # naga marks the span "┌─ wgsl:L:C" for parse errors but "┌─ <label>:L:C" for validation errors
    m = re.search(r"┌─\s*[^\s:]*:(\d+):(\d+)", msg) or re.search(r"wgsl:(\d+):(\d+)", msg)
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    reason = next((ln for ln in lines if "error" in ln.lower() and "Validation Error" not in ln), lines[-1] if lines else msg)
    details = [ln[1:].strip() for ln in lines if ln.startswith("= ")]
    if "validation error" in reason.lower() and details:
        reason = f"{reason}: {details[-1]}"  # the specific cause, e.g. "Operation Add can't work with ..."
    where = f"{path}:{m.group(1)}:{m.group(2)}" if m else f"{path}"
    return ShaderError(f"{where}: {reason}")
