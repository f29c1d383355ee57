"""`wgpu-train chat`: lines in, streamed answers out, each answered with the conversation so far through the chat
template; /reset, /help, /exit and Ctrl-D; the oldest turns dropped when the conversation outgrows the model."""
from __future__ import annotations

import io

import pytest

from finetune_helpers import make_data_dir, make_model_dir, one_line_error
from wgpu_train.cli.chat import Conversation
from wgpu_train.cli.main import main
from wgpu_train.engines.model import load_model
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
