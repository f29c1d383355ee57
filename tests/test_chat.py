"""`wgpu-train chat`: lines in, streamed answers out, each answered with the conversation so far through the chat
template; /reset, /help, /exit and Ctrl-D; the oldest turns dropped when the conversation outgrows the model."""
from __future__ import annotations

import io
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune_helpers import make_data_dir, make_model_dir, one_line_error
import wgpu_train
from wgpu_train.cli.chat import Conversation
from wgpu_train.cli.main import main
from wgpu_train.engines.loading import load_model
from wgpu_train.formats.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("chat") / "model")


def chat(monkeypatch, capsys, model_dir, lines: str, *extra) -> tuple[list[str], str]:
    """(the answers printed, stderr) of one chat session fed `lines`."""
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert main(["chat", "--model", str(model_dir), "--backend", "numpy", "--max-new-tokens", "5", *extra]) == 0
    out, err = capsys.readouterr()
    return out.splitlines(), err


def answer(model, tok, messages, n=5) -> str:
    """The greedy answer to `messages` through the chat template, as generate computes it."""
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    new = model.generate(ids, max_new_tokens=n, stop_token_ids=tok.stop_token_ids)
    return tok.decode([t for t in new if t not in tok.stop_token_ids])


def test_each_answer_follows_the_conversation(model_dir, monkeypatch, capsys):
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    answers, err = chat(monkeypatch, capsys, model_dir, "hello\n\nred 1?\n/help\n/reset\nred 1?\n/nope\n/exit\nignored\n",
                        "--system", "Be brief.")
    system = [{"role": "system", "content": "Be brief."}]
    first = answer(model, tok, system + [{"role": "user", "content": "hello"}])
    second = answer(model, tok, system + [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                                          {"role": "user", "content": "red 1?"}])
    fresh = answer(model, tok, system + [{"role": "user", "content": "red 1?"}])
    assert answers == [first, second, fresh]          # after /reset: the system message only; /exit ends
    assert second != fresh                            # the history changed the answer, so it was there
    assert "/reset: forget" in err and "unknown command /nope" in err and "forgotten" in err


def test_ctrl_d_ends_the_chat(model_dir, monkeypatch, capsys):
    answers, _ = chat(monkeypatch, capsys, model_dir, "hello\n")
    assert len(answers) == 1


def test_a_message_too_long_is_one_line_and_the_chat_goes_on(model_dir, monkeypatch, capsys):
    """A message that leaves the model no room for an answer: one error line, the history kept, the next
    message answered after it."""
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    answers, err = chat(monkeypatch, capsys, model_dir, "hello\n" + "word " * 200 + "\nred 1?\n")
    first = answer(model, tok, [{"role": "user", "content": "hello"}])
    second = answer(model, tok, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                                 {"role": "user", "content": "red 1?"}])
    assert answers == [first, second]
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [
        line for line in err.splitlines() if "no room for an answer" in line]
    assert err.count("no room for an answer") == 1


def _read_until(fd: int, marker: str, seconds: float = 60) -> str:
    """What the pseudo-terminal shows until `marker` (\r\n as \n), or until the other end closes."""
    seen, deadline = b"", time.monotonic() + seconds
    while marker.encode() not in seen.replace(b"\r\n", b"\n") and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.5)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:             # EIO: the child closed its side
                break
            if not chunk:
                break
            seen += chunk
    return seen.decode(errors="replace").replace("\r\n", "\n")


def test_a_pseudo_terminal_session(model_dir):
    """`wgpu-train chat` on a pseudo-terminal, as a user types: the >>> prompt, one turn answered as generate
    answers it, /reset, then Ctrl-D at an empty prompt ends it with a newline and exit code 0."""
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    expected = answer(model, tok, [{"role": "user", "content": "hello"}])
    root = Path(wgpu_train.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(root), os.environ.get("PYTHONPATH")] if p)}
    leader, follower = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "wgpu_train.cli", "chat", "--model", str(model_dir), "--backend",
                             "numpy", "--max-new-tokens", "5"], stdin=follower, stdout=follower, stderr=follower,
                            env=env, close_fds=True)
    os.close(follower)
    try:
        assert "chatting with" in _read_until(leader, ">>> ")
        os.write(leader, b"hello\n")
        turn = _read_until(leader, ">>> ")
        assert turn.startswith("hello\n") and turn.endswith("\n" + expected + "\n>>> ")     # the echo, the answer
        os.write(leader, b"/reset\n")
        assert "(the conversation is forgotten)" in _read_until(leader, ">>> ")
        os.write(leader, b"\x04")                                          # Ctrl-D at an empty prompt
        assert proc.wait(timeout=30) == 0
        assert _read_until(leader, "\n", 5) == "\n"                        # the prompt's line ended
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)


def test_the_oldest_turns_go_when_the_conversation_outgrows_the_model(model_dir):
    tok = load_tokenizer(model_dir)
    conv = Conversation("sys")
    for i in range(6):
        conv.answered(f"question {i} " * 3, f"answer {i} " * 3)
    whole, dropped = conv.prompt_ids(tok, "now?", positions=10_000, answer_room=5)
    assert dropped == 0 and len(conv.turns) == 12
    ids, dropped = conv.prompt_ids(tok, "now?", positions=len(whole) - 20, answer_room=5)
    assert dropped >= 1 and len(conv.turns) == 12 - 2 * dropped and len(ids) + 5 <= len(whole) - 20
    assert conv.turns[0]["content"].startswith(f"question {dropped} ")         # the oldest went first
    with pytest.raises(Exception, match="no room for an answer"):
        Conversation().prompt_ids(tok, "word " * 200, positions=50, answer_room=5)


def test_an_adapter_trained_without_the_template_is_refused(model_dir, tmp_path, capsys):
    data = make_data_dir(tmp_path / "data")
    out = tmp_path / "raw"
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--backend", "numpy",
                 "--max-steps", "1", "--no-chat-template", "--no-progress"]) == 0
    capsys.readouterr()
    one_line_error(capsys, ["chat", "--model", str(model_dir), "--adapter-path", str(out), "--backend", "numpy"],
                   "trained without it")
