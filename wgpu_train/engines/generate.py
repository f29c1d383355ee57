"""Token generation over an engine's KV cache: a DecodeBatch of rows that join and leave at any step (continuous
batching), each with its own sampling (greedy or seeded; temperature, top-k, top-p, presence and frequency
penalties) and log-probabilities; generate and generate_batch run one."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from wgpu_train.engines.protocol import PREFILL_TOKENS
from wgpu_train.engines.shared.decode_call import DecodeCall
from wgpu_train.engines.shared.image_tokens import ImageTokens
from wgpu_train.engines.shared.recurrent_state import release
from wgpu_train.errors import ConfigError


def sample_next(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> int:
    """One token id from logits (V,): argmax when temperature is 0, else a draw from the filtered softmax.

    The logits are scaled after their maximum is subtracted, so a temperature too small for the division (even
    5e-324) gives the softmax's limit, the argmax (ties shared), never inf - inf; top_p 0 keeps the smallest
    nucleus, the one likeliest token."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64)
    with np.errstate(over="ignore"):                # a tiny temperature: -inf but at the maxima, as in the limit
        z = (z - z.max()) / temperature             # <= 0, the largest exactly 0: exp never overflows
    if top_k and top_k < z.shape[0]:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p) + 1)]   # the smallest set reaching top_p (one at 0)
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.shape[0], p=p))


def _check_sampling(temperature: float, top_k: int, top_p: float):
    if not (0 <= temperature < np.inf) or top_k < 0 or not 0.0 <= top_p <= 1.0:
        raise ConfigError("need a finite temperature >= 0, top_k >= 0 and 0 <= top_p <= 1")


def generate(engine, input_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed=None, stop_token_ids=(), on_token=None, max_len=None) -> list[int]:
    """New token ids after the prompt input_ids (T,) (prefill, then one token per step on the KV cache).

    Stops after max_new_tokens or at a token in stop_token_ids (which is included); `on_token(id)`
    is called as each token is chosen, for streaming, and ends the generation there when it returns True.
    generate_batch with this one prompt (a (1, T) array
    is that prompt too; several rows are refused: generate_batch answers them).
    """
    ids = one_prompt(input_ids)
    stream = None if on_token is None else (lambda _, tok: on_token(tok))
    return generate_batch(engine, [ids], max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, max_len,
                          stream)[0]


def one_prompt(input_ids) -> np.ndarray:
    """The token ids (T,) of one prompt given as (T,) or (1, T); a batch of several or an empty prompt is
    refused (generate_batch takes several)."""
    ids = np.asarray(input_ids)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise ConfigError(f"generate takes one prompt of shape (T,), got shape {ids.shape}; use generate_batch "
                          f"for several prompts")
    if ids.size == 0:
        raise ConfigError("generate needs a prompt of at least one token")
    return ids.astype(np.int64)


def _per_row(value, n: int, what: str) -> list:
    """One value per prompt: a list, tuple or array of n, or one value for all."""
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != n:
            raise ConfigError(f"{what}: {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n


def generate_batch(engine, prompts, max_new_tokens=64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                   seed=None, stop_token_ids=(), max_len=None, on_token=None, images=None) -> list[list[int]]:
    """New token ids after each of `prompts` (1-D id arrays of any lengths), generated together on one KV
    cache with a row per prompt (a DecodeBatch): each engine call takes up to PREFILL_TOKENS prompt tokens
    packed together beside every decoding row's newest token.

    max_new_tokens and seed: one value for all prompts or a list with one per prompt. A row stops at its
    budget, at a token in stop_token_ids (included), or when its cache row is full (max_len positions;
    by default room for the longest prompt plus its budget). A row that could reach beyond the model's
    max_position_embeddings (its prompt plus its budget, within max_len) is refused. Row i samples from
    np.random.default_rng(seed_i) exactly as generate() does, so it gives generate(prompts[i], seed=seed_i)'s
    tokens whenever its logits come out the same; they can differ in the last bits where the engine sums
    a batch in another order than one row, which matters only at a near-tie (pass distinct seeds to draw
    independent samples of one prompt). `on_token(i, id)` is called as each token of prompt i is chosen; when
    it returns True, row i ends there (a server's client gone, a stop string seen), the others run on.
    images: one per prompt, None or its ImageTokens (1, T) (VisionModel.prompt_images): DecodeBatch.add's.
    """
    prompts = [np.asarray(p) for p in prompts]
    if not prompts:
        raise ConfigError("generate_batch needs at least one prompt")
    flat = [i for i, p in enumerate(prompts) if p.ndim != 1]
    if flat:
        raise ConfigError(f"generate_batch takes prompts of shape (T,) each; prompt {flat[0]} has shape "
                          f"{prompts[flat[0]].shape}")
    if any(p.size == 0 for p in prompts):
        raise ConfigError("generate_batch needs prompts of at least one token each")
    prompts = [p.astype(np.int64) for p in prompts]
    _check_sampling(temperature, top_k, top_p)
    b = len(prompts)
    budgets = _per_row(max_new_tokens, b, "max_new_tokens")
    if any(int(n) != n or n < 0 for n in budgets):
        raise ConfigError("max_new_tokens must be whole numbers >= 0")
    seeds, images = _per_row(seed, b, "seed"), _per_row(images, b, "images")
    lengths = [p.size for p in prompts]
    running = [i for i in range(b) if budgets[i] > 0]
    out: list[list[int]] = [[] for _ in range(b)]
    if not running:
        return out
    limit = max_len or max(lengths[i] + budgets[i] for i in running)
    too_long = [i for i in running if lengths[i] > limit]
    if too_long:
        raise ConfigError(f"prompt {too_long[0]} has {lengths[too_long[0]]} tokens, more than max_len {limit}")
    positions = engine.cfg.max_position_embeddings
    # a row ends at its budget, or with max_len - length + 1 tokens when its cache row fills first
    beyond = [i for i in running if min(lengths[i] + budgets[i], limit + 1) > positions]
    if beyond:
        i = beyond[0]
        room = (f"at most {positions - lengths[i]} new tokens fit" if lengths[i] < positions else
                "the prompt alone fills them")
        raise ConfigError(f"{'the prompt' if b == 1 else f'prompt {i}'} has {lengths[i]} tokens and max_new_tokens "
                          f"{budgets[i]}: more than the "
                          f"model's max_position_embeddings {positions} ({room})")
    batch = DecodeBatch(engine, b, limit)
    try:
        prompt_of = {batch.add(prompts[i], budgets[i], Sampling(temperature, top_k, top_p, seeds[i]),
                               stop_token_ids, images=images[i]): i for i in running}
        while len(batch):
            for token in batch.step():
                i = prompt_of[token.slot]
                out[i].append(token.id)
                if on_token is not None and on_token(i, token.id) and not token.finished:
                    batch.remove(token.slot)
    finally:
        batch.close()       # the cache freed now, not when the garbage collector gets to it
    return out


@dataclass(frozen=True)
class Sampling:
    """How one row chooses its tokens: greedy at temperature 0, else a draw from default_rng(seed) of the
    filtered softmax (sample_next); the penalties are OpenAI's, subtracted from the logits of the tokens the
    row generated so far (frequency times each one's count, presence once) before either."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@dataclass(frozen=True)
class Token:
    """A token chosen for the row in cache slot `slot` by DecodeBatch.step.

    logprob and top (the row asked for log-probabilities): its log-probability under the model (the
    log-softmax of the logits, before penalties and temperature), and the `top` likeliest (id, logprob)
    pairs. prompt: on a row's first token, when it asked for them, (id, logprob, top) of each prompt token
    after the first. finished: "stop" (a stop token, included), "length" (its budget, or its cache row
    full), None while it runs on; a finished row's slot is free again."""

    slot: int
    id: int
    finished: str | None
    logprob: float | None = None
    top: list | None = None
    prompt: list | None = None


@dataclass(eq=False)
class _Row:
    prompt: np.ndarray              # (T,) int64
    budget: int
    sampling: Sampling
    stops: frozenset
    logprobs: int | None            # how many top alternatives to give with each token; None: no logprobs
    prompt_logprobs: bool
    rng: np.random.Generator
    adapter: int = -1               # its adapter in the engine's bank (set_adapter_bank); negative: none
    key: object = None              # what its keys and values depend on beside its tokens (prefix reuse)
    images: ImageTokens | None = None   # its prompt's images as one row (1, T): prefilled whole, in one call
    shift: int | None = None        # Qwen3-VL's: a new token's M-RoPE position less its cache position (None: none)
    out: list = field(default_factory=list)
    fed: int = 0                    # prompt tokens written into the cache
    counts: dict = field(default_factory=dict)      # token id -> times generated (the penalties)
    prompt_entries: list = field(default_factory=list)
    hold: bool = False              # kept in its slot when it finishes, for extend
    paused: bool = False            # finished and held: not stepped until extend (or remove)


class DecodeBatch:
    """Rows of one KV cache that join (add) and leave (remove, or at their end) between steps: continuous
    batching. Each step is one engine call (two under longrope, one per set of RoPE factors) that takes every
    decoding row's newest token and up to token_budget tokens in all of the prompts still being prefilled,
    oldest row first (chunked prefill), and chooses each row's next token when its logits come. A row's
    tokens do not depend on which rows share its steps (but for the last bits of sums the engine orders
    otherwise, as generate_batch says). Not thread-safe: one thread drives it.

    Prefix reuse: a free slot keeps the keys and values its last row wrote, with that row's prefix_key (add); a
    row of the same key whose prompt begins with some of those tokens takes that slot and prefills only the
    rest (reused counts the tokens saved). Not under longrope (a row's factors follow its length), nor for a model
    with recurrent layers (LFM2's short convolutions: a slot's recurrent state holds its last row's end, not each
    prefix; snapshots per prefix would cost a state per kept position, so such rows prefill whole). A row that
    leaves frees its recurrent state (shared/recurrent_state.release).

    Held rows (add with hold=True) stay in their slot when they finish, paused; extend appends tokens (a tool's
    result) after what the row generated and runs it on from there, its cache row kept: only the new tokens are
    prefilled. len() counts the rows still running, not the paused ones."""

    def __init__(self, engine, rows: int, max_len: int, token_budget: int = PREFILL_TOKENS):
        self.engine = engine
        self.rows = rows
        self.max_len = max_len
        self.token_budget = token_budget
        self.cache = engine.new_kv_cache(rows, max_len)
        self._free = list(range(rows - 1, -1, -1))      # a stack: the lowest slot is taken first
        self._rows: dict[int, _Row] = {}               # slot -> row, in the order they joined
        self._kept: dict[int, tuple] = {}              # free slot -> (prefix_key, the token ids (P,) its cache holds)
        cfg = engine.cfg
        self._reuse = not cfg.rope_long(cfg.max_position_embeddings - 1) and not cfg.recurrent
        self.reused = 0

    def __len__(self) -> int:
        return sum(not r.paused for r in self._rows.values())

    def free_slots(self) -> int:
        """Rows that may join now."""
        return len(self._free)

    def prefilling(self) -> int:
        """Prompt tokens of the rows still waiting to be written into the cache."""
        return sum(r.prompt.size - r.fed for r in self._rows.values() if not r.paused)

    def add(self, prompt, max_new_tokens: int, sampling: Sampling = Sampling(), stop_token_ids=(),
            logprobs: int | None = None, prompt_logprobs: bool = False, adapter: int = -1,
            prefix_key=None, images: ImageTokens | None = None, hold: bool = False) -> int:
        """A row for the prompt (T,) ids, to run until max_new_tokens (>= 1) tokens, a stop token, or its
        cache row full; its slot. adapter: its own adapter in the engine's bank (set_adapter_bank), the rows
        of several in one engine call; negative: the engine's model as it is. prefix_key: None, or what the
        row's keys and values depend on beside its tokens (the adapter a server's model has on): rows of one
        key reuse each other's prompt prefixes (not with prompt_logprobs, which needs every position's
        logits). images: the prompt's images (shared/image_tokens.ImageTokens of the prompt as one row (1, T), the
        engine's set_images takes them; the NumPy engine's), its whole prompt prefilled in one call (an image's
        tokens see each other both ways), never reused; with M-RoPE positions (Qwen3-VL's), each new token's
        position counts on from the prompt's last, not from its cache row. hold: the row stays in its slot,
        paused, when it finishes (extend runs it on; remove ends it). The caller checks sizes against the cache
        (ValueError past them)."""
        prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
        if not self._free or not 0 < prompt.size <= self.max_len or max_new_tokens < 1:
            raise ValueError(f"DecodeBatch.add: {len(self._free)} free slots, a prompt of {prompt.size} tokens "
                             f"for rows of {self.max_len}, max_new_tokens {max_new_tokens}")
        _check_sampling(sampling.temperature, sampling.top_k, sampling.top_p)
        if images is not None and (images.blocks.shape != (1, prompt.size) or not hasattr(self.engine, "set_images")
                                   or self.engine.cfg.rope_long(self.max_len - 1)):
            raise ValueError("DecodeBatch.add: images need blocks (1, T) of the prompt, an engine with set_images "
                             "and no longrope")
        slot, reuse = self._free[-1], 0
        if images is not None:
            prefix_key = None
        if prefix_key is not None and self._reuse and not prompt_logprobs:
            for free in self._free:
                key, held = self._kept.get(free, (None, None))
                if key == prefix_key:
                    common = _common_prefix(held, prompt[:-1])     # the last token's logits are wanted
                    if common > reuse:
                        slot, reuse = free, common
        self._free.remove(slot)
        self._kept.pop(slot, None)
        self._rows[slot] = _Row(prompt, int(max_new_tokens), sampling, frozenset(int(s) for s in stop_token_ids),
                                logprobs, prompt_logprobs, np.random.default_rng(sampling.seed), int(adapter),
                                prefix_key, images=images, fed=reuse, hold=hold,
                                shift=None if images is None or images.positions is None else
                                int(images.positions.max()) + 1 - prompt.size)
        self.reused += reuse
        return slot

    def extend(self, slot: int, ids, max_new_tokens: int):
        """Run the paused held row in `slot` on: `ids` (N,) follow the tokens it generated (its last one, not yet
        in its cache row, included) and up to max_new_tokens (>= 1) new tokens follow them. Its cache row keeps
        what it holds; the next steps prefill only the tokens after it (a row with images: they stay in its cache
        row, `ids` are text). Its out starts again empty."""
        r = self._rows.get(slot)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if r is None or not r.paused or max_new_tokens < 1:
            raise ValueError(f"DecodeBatch.extend: slot {slot} holds no paused row, or max_new_tokens "
                             f"{max_new_tokens} < 1")
        prompt = np.concatenate([r.prompt, np.asarray(r.out, np.int64), ids])
        if prompt.size > self.max_len:
            raise ValueError(f"DecodeBatch.extend: {prompt.size} tokens for rows of {self.max_len}")
        r.fed = r.prompt.size + len(r.out) - 1          # the cache row holds all but the newest token
        r.prompt, r.out, r.budget, r.paused = prompt, [], int(max_new_tokens), False
        r.images = None         # its images are in its cache row: the new tokens are text (M-RoPE's shift kept)

    def remove(self, slot: int):
        """End a row now (its client gone, a stop string met): its slot is free for the next add, keeping the
        tokens its cache row holds for prefix reuse."""
        r = self._rows.pop(slot, None)
        if r is not None:
            self._free.append(slot)
            release(self.cache, slot)
            if r.key is not None:       # written: the prompt's fed tokens, then every token but the newest
                done = r.out[:-1] if r.fed == r.prompt.size else []
                self._kept[slot] = (r.key, np.concatenate([r.prompt[:r.fed], np.array(done, np.int64)]))

    def close(self):
        """Free the cache."""
        self._rows.clear()
        self._kept.clear()
        self.engine.free_kv_cache(self.cache)

    def step(self) -> list[Token]:
        """One engine call: the tokens chosen in it, a row's at most, in the rows' order."""
        cfg = self.engine.cfg
        calls = {False: DecodeCall(), True: DecodeCall()}     # by RoPE factors (longrope: long or not)
        room = self.token_budget - sum(r.fed == r.prompt.size and not r.paused for r in self._rows.values())
        for slot, r in self._rows.items():
            if r.paused:
                continue
            if r.fed < r.prompt.size:                   # prefilling: the next chunk of its prompt
                take = min(r.prompt.size - r.fed, room)
                if take <= 0:
                    continue
                if r.images is not None:                # whole: an image is never cut between calls
                    take = r.prompt.size - r.fed
                room -= take
                ends = r.fed + take == r.prompt.size
                wants = range(r.fed, r.fed + take) if r.prompt_logprobs else [r.fed + take - 1] if ends else []
                calls[cfg.rope_long(r.prompt.size - 1)].add(slot, r.prompt[r.fed:r.fed + take], r.fed, wants,
                                                             r.adapter, r.images, r.shift)
                r.fed += take
                continue
            pos = r.prompt.size + len(r.out) - 1        # the newest token's position
            if cfg.rope_long(pos) and not cfg.rope_long(pos - 1):
                # its length first passes original_max_position_embeddings: prefilled again, whole, with the long
                # factors (its cached keys had the short ones), as transformers' Phi-3 generation has it
                calls[True].add(slot, np.concatenate([r.prompt, r.out]), 0, [pos], r.adapter)
            else:
                calls[cfg.rope_long(pos)].add(slot, np.array(r.out[-1:]), pos, [pos], r.adapter, shift=r.shift)
        mixed = any(r.adapter >= 0 for r in self._rows.values())
        chosen = []
        try:
            for long, call in calls.items():
                if call.ids:
                    images = call.images(cfg.hidden_size, (cfg.rotary_dim or cfg.head_dim) // 2)
                    if images is not None:
                        self.engine.set_images(images)
                    try:
                        logits = self.engine.forward_rows(np.concatenate(call.ids), np.concatenate(call.rows),
                                                          np.concatenate(call.positions), self.cache,
                                                          np.array(call.last, dtype=np.int64), long,
                                                          np.concatenate(call.adapters) if mixed else None)  # (m, V)
                    finally:
                        if images is not None:
                            self.engine.set_images(None)
                    chosen += self._choose(call, logits)
        except BaseException:
            for r in self._rows.values():       # what their cache rows hold is unknown now: never reused
                r.key = None
            raise
        return chosen

    def _choose(self, call, logits: np.ndarray) -> list[Token]:
        tokens = []
        for (slot, pos), lg in zip(call.wants, logits):
            r = self._rows[slot]
            if pos + 1 < r.prompt.size:                 # a prompt token's log-probability (echo)
                r.prompt_entries.append((int(r.prompt[pos + 1]), *log_probs(lg, r.prompt[pos + 1], r.logprobs or 0)))
                continue
            tok = sample_next(penalised(lg, r.counts, r.sampling), r.sampling.temperature, r.sampling.top_k,
                              r.sampling.top_p, r.rng)
            r.out.append(tok)
            r.counts[tok] = r.counts.get(tok, 0) + 1
            lp, top = log_probs(lg, tok, r.logprobs) if r.logprobs is not None else (None, None)
            finished = ("stop" if tok in r.stops else
                        "length" if len(r.out) >= r.budget or r.prompt.size + len(r.out) > self.max_len else None)
            prompt = r.prompt_entries if r.prompt_logprobs and len(r.out) == 1 else None
            tokens.append(Token(slot, tok, finished, lp, top, prompt))
            if finished and r.hold:
                r.paused = True
            elif finished:
                self.remove(slot)
        return tokens


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids a (P,) and b (T,) share."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def penalised(logits: np.ndarray, counts: dict, sampling: Sampling) -> np.ndarray:
    """Logits (V,) less OpenAI's presence and frequency penalties of the tokens generated so far."""
    if not counts or not (sampling.presence_penalty or sampling.frequency_penalty):
        return logits
    ids = np.fromiter(counts, np.int64)
    n = np.fromiter(counts.values(), np.float64)
    out = logits.astype(np.float64)
    out[ids] -= sampling.frequency_penalty * n + sampling.presence_penalty
    return out


def log_probs(logits: np.ndarray, token: int, top: int) -> tuple:
    """(log-probability of `token`, [(id, logprob)] of the `top` likeliest, likeliest first, lower ids first
    at a tie) under the float64 log-softmax of logits (V,)."""
    z = logits.astype(np.float64)
    z = z - z.max()
    lp = z - np.log(np.exp(z).sum())
    best = np.lexsort((np.arange(lp.size), -lp))[:top] if top else []
    return float(lp[token]), [(int(i), float(lp[i])) for i in best]
