"""`wgpu-train chat`: an interactive conversation with a model (and adapter) over the same generation as
`generate`, through the chat template, with its history, streaming each answer as it comes; a vision model's
user turns may hold images (/image PATH) and, Qwen3-VL's and Qwen3.5's, videos (/video PATH)."""
from __future__ import annotations

import sys

from wgpu_train.errors import ConfigError
from wgpu_train.cli.options import add_parser, device_options, model_options, sampling_options, stage_options, whole

COMMANDS = {"/image PATH": "attach an image to your next message (a vision model's)",
            "/video PATH": "attach a video (a folder of frames or a video file) to your next message (Qwen3-VL's)",
            "/reset": "forget the conversation (the system message stays)", "/exit": "end the chat (or Ctrl-D)",
            "/help": "these commands"}


def _user(text: str, images: list) -> dict:
    """A user message, its images' pixel_values (and videos, data/qwen_videos.Video) under "images" and
    {"type": "image"} ({"type": "video"}) parts before its text, in the order attached."""
    from wgpu_train.data.qwen_videos import Video

    if not images:
        return {"role": "user", "content": text}
    parts = [{"type": "video" if isinstance(im, Video) else "image"} for im in images]
    return {"role": "user", "content": parts + [{"type": "text", "text": text}], "images": list(images)}


class Conversation:
    """The messages so far, trimmed from the oldest turn when they and an answer outgrow the model's positions."""

    def __init__(self, system: str | None = None):
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict] = []

    def reset(self):
        self.turns = []

    def images(self) -> list:
        """The pixel_values of the images in the turns kept, in order."""
        return [im for t in self.turns for im in t.get("images", ())]

    def prompt_ids(self, tokenizer, user: str, positions: int, answer_room: int, images=(),
                   span=None) -> tuple[list[int], int]:
        """(token ids asking for the answer to `user` (with its `images`, pixel_values or decoded images each) after
        the history, turns dropped to fit): the oldest user / assistant pairs go first, until the prompt leaves
        `answer_room` positions; ConfigError, the history left as it was, when the system message and `user` alone
        leave none. span: the vision model's data/vision_records span, which expands each image's placeholder."""
        from wgpu_train.data.tokenize import generation_prompt_ids
        from wgpu_train.data.vision_records import vision_chat_ids

        dropped, turns = 0, self.turns
        while True:
            messages = self.system + turns + [_user(user, images)]
            shown = [im for m in messages for im in m.get("images", ())]
            plain = [{k: v for k, v in m.items() if k != "images"} for m in messages]
            ids = vision_chat_ids(tokenizer, plain, len(shown), span, shown) if span is not None else \
                generation_prompt_ids(tokenizer, plain)
            if len(ids) + answer_room <= positions or not turns:
                break
            turns = turns[2:]
            dropped += 1
        if len(ids) >= positions:           # the history stays as it was
            raise ConfigError(f"the message has {len(ids)} tokens with the chat template, and the model takes at "
                              f"most {positions} (max_position_embeddings): no room for an answer")
        self.turns = turns
        return ids, dropped

    def answered(self, user: str, answer: str, images=()):
        self.turns += [_user(user, images), {"role": "assistant", "content": answer}]


def cmd_chat(args) -> int:
    from wgpu_train.adapters.files import adapter_folder
    from wgpu_train.cli.adapter_settings import (choose_settings, closing_stages, load_model_and_tokenizer,
                                                 model_folder, trained_settings)

    adapter = adapter_folder(args.adapter_path)
    model_dir = model_folder(args.model, adapter)
    if adapter and not args.chat_template and trained_settings(adapter).get("no_chat_template"):
        raise ConfigError("chat talks through the chat template, and the adapter was trained without it "
                          "(--no-chat-template): ask it with `wgpu-train generate`, or pass --chat-template")
    settings = choose_settings({"base_dtype": args.base_dtype, "embed_dtype": args.embed_dtype}, adapter, model_dir)
    model, tok = load_model_and_tokenizer(model_dir, adapter, args.backend, args.device,
                                          base_dtype=settings["base_dtype"], embed_dtype=settings["embed_dtype"],
                                          kv_dtype=args.kv_dtype, stages=stage_options(args))
    print(f"chatting with {model_dir}{f' + {adapter}' if adapter else ''}; /help for commands, /exit or Ctrl-D to "
          f"end", file=sys.stderr)
    with closing_stages(model):
        from wgpu_train.cli.vision import vision_of

        _talk(args, model, tok, vision_of(model, model_dir))
    return 0


def _attach(args, vision, path: str, pending: list, video_span=None):
    """/image PATH: the image's pixel_values added to the next user turn's (SmolVLM's and Gemma 3's with
    pan-and-scan: the decoded image, whose size gives its tiles or crops); /video PATH (video_span: the model's
    span): Qwen3-VL's video, its frames read; or why not (a line on stderr)."""
    from wgpu_train.data.images import open_image, pixel_values
    from wgpu_train.errors import WgpuTrainError

    video = video_span is not None
    if vision is None:
        print("error: this model takes no images (a Gemma 3 or SmolVLM vision model on the NumPy engine does)",
              file=sys.stderr)
    elif args.temperature:
        print("error: images are answered greedily for now (--temperature 0)", file=sys.stderr)
    elif not path:
        print("error: /video needs a frames folder's or a video file's path: /video PATH" if video else
              "error: /image needs the image file's path: /image PATH", file=sys.stderr)
    elif video and not vision.qwen:
        print("error: this model takes no videos (Qwen3-VL and Qwen3.5 do)", file=sys.stderr)
    else:
        try:
            # where an image's size gives its tokens, the image itself is kept
            keep = vision.qwen or vision.lfm2 or vision.vision.scale_factor or vision.settings.pan_and_scan
            pending.append(video_span.as_video(path, path) if video else open_image(path, path) if keep else
                           pixel_values(path, vision.settings, path))
        except WgpuTrainError as e:
            print(f"error: {e}", file=sys.stderr)
            return
        print(f"({'video' if video else 'image'} {path} attached to your next message)", file=sys.stderr)


def _talk(args, model, tok, vision=None):
    """Answer each line of stdin until /exit or its end; vision: the model's VisionModel, or None (no images)."""
    from wgpu_train.cli.commands import GENERATE_TOKENS, stream_printer

    positions = model.config.max_position_embeddings
    max_new = min(args.max_new_tokens or GENERATE_TOKENS, positions - 1)
    chat = Conversation(args.system)
    span, pending = None, []             # pending: the images attached to the next user turn
    if vision is not None:
        span = vision.image_span(tok)
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:                    # Ctrl-D: end the prompt's line before the shell's
            if interactive:
                print()
            break
        user = line.strip()
        if not user:
            continue
        if user.startswith("/"):
            word = user.split()[0]
            if word == "/exit":
                break
            if word in ("/image", "/video"):
                _attach(args, vision, user[len(word):].strip(), pending, span if word == "/video" else None)
            elif word == "/reset":
                chat.reset()
                pending = []
                print("(the conversation is forgotten)", file=sys.stderr)
            else:
                known = word == "/help"
                print(("" if known else f"unknown command {word}; ") +
                      "; ".join(f"{c}: {what}" for c, what in COMMANDS.items()), file=sys.stderr)
            continue
        try:
            ids, dropped = chat.prompt_ids(tok, user, positions, max_new, pending, span)
        except ConfigError as e:            # that message alone is too long: say so, and ask again
            print(f"error: {e}", file=sys.stderr)
            continue
        if dropped:
            print(f"(the {dropped} oldest turn{'s' if dropped > 1 else ''} dropped: the conversation outgrew the "
                  f"model's {positions} positions)", file=sys.stderr)
        on_token, finish = stream_printer(tok)
        images = chat.images() + pending
        try:
            if images:              # greedy (_attach refuses a temperature), each image's tokens prefilled whole
                vision.generate(ids, images, min(max_new, positions - len(ids)), tuple(tok.stop_token_ids),
                                on_token)
            else:
                model.generate(ids, max_new_tokens=min(max_new, positions - len(ids)), temperature=args.temperature,
                               top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_token_ids=tok.stop_token_ids,
                               on_token=on_token)
        except KeyboardInterrupt:             # the answer so far is dropped; the chat goes on
            print("\n(interrupted: that answer is not kept)", file=sys.stderr)
            continue
        chat.answered(user, finish(), pending)
        pending = []


def register(sub):
    p = add_parser(sub, "chat", "chat with a model (and adapter) interactively, streaming each answer",
                    "An interactive chat over the model's chat template: each line you type is a user message, "
                    "answered with the conversation so far (the oldest turns dropped when it outgrows the "
                    "model's positions). /reset forgets it, /exit or Ctrl-D ends, Ctrl-C stops an answer.")
    model_options(p)
    p.add_argument("--system", default=None, help="a system message before the conversation")
    p.add_argument("--chat-template", action="store_true",
                   help="chat through the model's template even with an adapter trained without it")
    p.add_argument("--max-new-tokens", type=whole(1), default=None,
                   help="most tokens of each answer (default: 256, or what the model's positions leave)")
    sampling_options(p)
    device_options(p, storage=True, kv_cache=True)
    p.set_defaults(func=cmd_chat)
