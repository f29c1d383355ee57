"""Generated token ids -> the text a client sees, piece by piece: stop tokens left out (and the other special
tokens, unless an answer's tool calls are to be parsed from them), the answer cut before the first stop string,
and text that may be the start of one held back until it is known not to be."""
from __future__ import annotations

from wgpu_train.formats.tokenizer import StreamDecoder


class TextStream:
    """One answer's text as its tokens come (push), and the rest at its end (finish)."""

    def __init__(self, tokenizer, stop_strings=(), skip_special_tokens: bool = True):
        self.decoder = StreamDecoder(tokenizer, skip_special_tokens)
        self.stop_ids = set(tokenizer.stop_token_ids)
        self.stops = [s for s in stop_strings if s]
        self.text = ""          # everything decoded so far
        self.sent = 0           # text[:sent] went to the client
        self.stopped = False    # a stop string was met: the answer ends before it

    def push(self, token_id: int) -> str:
        """The text that token completes and that may go out now ('' while held back)."""
        if self.stopped or token_id in self.stop_ids:
            return ""
        self.text += self.decoder.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """The text still held back when the answer ends."""
        if not self.stopped:
            self.text += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        # text before `sent` holds no stop string and does not end inside the start of one
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        else:
            end = len(self.text) if final else len(self.text) - self._maybe_stop_start()
        piece, self.sent = self.text[self.sent:end], end
        return piece

    def _maybe_stop_start(self) -> int:
        """The length of the longest unsent tail of the text that begins some stop string."""
        tail = self.text[self.sent:]
        for n in range(min(len(tail), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stops):
                return n
        return 0
