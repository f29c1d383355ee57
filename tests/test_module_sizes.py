"""Module sizes (ARCHITECTURE.md): no module of the package over 450 lines without saying why in its header,
none over 650."""
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "wgpu_train"
REASON = "(Over 450 lines"        # how a header says why, within its first lines
HEADER_LINES = 8


def oversized(files) -> dict:
    """{file: why it is too long} of (name, text) pairs."""
    out = {}
    for name, text in files:
        lines = text.splitlines()
        if len(lines) > 650:
            out[name] = f"{len(lines)} lines, over 650"
        elif len(lines) > 450 and REASON not in "\n".join(lines[:HEADER_LINES]):
            out[name] = f"{len(lines)} lines and no reason in its header"
    return out


def test_no_module_is_too_long():
    files = [(str(p.relative_to(PACKAGE)), p.read_text()) for p in PACKAGE.rglob("*.py")]
    assert len(files) > 100                     # the whole package, not an empty glob
    assert oversized(files) == {}


def test_the_check_catches_a_long_module():
    short, long_ = "x = 1\n" * 450, "x = 1\n" * 451
    reasoned = '"""A module.\n(Over 450 lines on purpose: one table.)"""\n' + long_
    assert oversized([("a.py", short), ("b.py", long_), ("c.py", reasoned), ("d.py", reasoned + long_)]) == {
        "b.py": "451 lines and no reason in its header", "d.py": "904 lines, over 650"}
