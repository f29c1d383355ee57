"""`wgpu-train chat` with a vision model: /image PATH attaches an image to the next user turn, answered as
`generate --image` answers it, the image kept in the history for the turns after; the refusals are one line each
and the chat goes on."""
from __future__ import annotations

import io

import pytest

from test_gemma3_vision import images
from test_gemma3_vision_training import chat_vlm  # noqa: F401  (the tiny chat vision model fixture)

pytest.importorskip("PIL.Image")
QUESTION = "what colour is it?"


def run_chat(monkeypatch, capsys, folder, lines: str, *extra) -> tuple[list[str], str]:
    from wgpu_train.cli.main import main

    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert main(["chat", "--model", str(folder), "--backend", "numpy", "--max-new-tokens", "5", *extra]) == 0
    out, err = capsys.readouterr()
    return out.splitlines(), err


def image_question(folder, tmp_path, capsys):
    """(the path of a picture written under tmp_path, `generate --image`'s answer to QUESTION about it on the
    NumPy engine): what a chat's image turn is held to."""
    from wgpu_train.cli.main import main

    path = tmp_path / "x.png"
    images(1, seed=9)[0].save(path)
    assert main(["generate", "--model", str(folder), "--prompt", QUESTION, "--image", str(path),
                 "--max-new-tokens", "5", "--backend", "numpy"]) == 0
    return path, capsys.readouterr().out.removesuffix("\n")


def test_an_image_turn_answers_as_generate_image(chat_vlm, tmp_path, monkeypatch, capsys):  # noqa: F811
    """The first turn with its image: generate --image's answer; the next turn (no new image) the greedy answer
    to the whole conversation, the first image in it."""
    import numpy as np

    from wgpu_train.data.images import pixel_values
    from wgpu_train.data.vision_records import ImageSpan, vision_chat_ids
    from wgpu_train.engines.vision_model import load_vision_model
    from wgpu_train.formats.tokenizer import load_tokenizer

    _, folder, _ = chat_vlm
    path, want = image_question(folder, tmp_path, capsys)
    answers, err = run_chat(monkeypatch, capsys, folder, f"/image {path}\n{QUESTION}\ndescribe the picture\n")
    assert answers[0] == want and f"(image {path} attached to your next message)" in err
    vm, tok = load_vision_model(folder), load_tokenizer(folder)
    vc = vm.vision
    span = ImageSpan.from_ids(tok, vc.boi_token_id, vc.image_token_id, vc.eoi_token_id, vc.mm_tokens_per_image)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                {"role": "assistant", "content": answers[0]}, {"role": "user", "content": "describe the picture"}]
    ids = vision_chat_ids(tok, messages, 1, span)
    new = vm.generate(ids, np.stack([pixel_values(path, vm.settings)]), 5, tuple(tok.stop_token_ids))
    assert answers[1] == tok.decode([t for t in new if t not in tok.stop_token_ids])
    assert len(answers) == 2


def test_image_refusals_are_one_line_and_the_chat_goes_on(chat_vlm, tmp_path, monkeypatch, capsys):  # noqa: F811
    """An image that does not decode, /image without a path, and /image with a temperature: an error line each,
    no image attached, the next message answered."""
    _, folder, _ = chat_vlm
    (tmp_path / "bad.png").write_bytes(b"\x89PNG broken")
    answers, err = run_chat(monkeypatch, capsys, folder, f"/image {tmp_path / 'bad.png'}\n/image\nhi\n")
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 2 and "cannot decode the image" in lines[0] and "/image PATH" in lines[1]
    assert len(answers) == 1 and "attached" not in err
    answers, err = run_chat(monkeypatch, capsys, folder, f"/image {tmp_path / 'bad.png'}\nhi\n",
                            "--temperature", "0.5", "--seed", "1")
    assert "error: images are answered greedily for now (--temperature 0)" in err and len(answers) == 1


def test_a_text_model_refuses_images(tmp_path, monkeypatch, capsys):
    from finetune_helpers import make_model_dir

    folder = make_model_dir(tmp_path / "model")
    answers, err = run_chat(monkeypatch, capsys, folder, f"/image {tmp_path / 'x.png'}\nhi\n")
    assert "error: this model takes no images" in err and len(answers) == 1
