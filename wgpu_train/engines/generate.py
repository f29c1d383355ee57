"""Token generation: greedy or seeded sampling (temperature, top-k, top-p) over an engine's KV cache."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.protocol import PREFILL_TOKENS
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


def generate_batch(engine, prompts, max_new_tokens=64, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, seed=None, stop_token_ids=(), max_len=None, on_token=None) -> list[list[int]]:
    """New token ids after each of `prompts` (1-D id arrays of any lengths), generated together on one KV
    cache with a row per prompt: the prompts are prefilled packed together (PREFILL_TOKENS tokens per
    call), then each step advances every row still running by one token in one engine call.

    max_new_tokens and seed: one value for all prompts or a list with one per prompt. A row stops at its
    budget, at a token in stop_token_ids (included), or when its cache row is full (max_len positions;
    by default room for the longest prompt plus its budget). A row that could reach beyond the model's
    max_position_embeddings (its prompt plus its budget, within max_len) is refused. Row i samples from
    np.random.default_rng(seed_i) exactly as generate() does, so it gives generate(prompts[i], seed=seed_i)'s
    tokens whenever its logits come out the same; they can differ in the last bits where the engine sums
    a batch in another order than one row, which matters only at a near-tie (pass distinct seeds to draw
    independent samples of one prompt). `on_token(i, id)` is called as each token of prompt i is chosen; when
    it returns True, row i ends there (a server's client gone, a stop string seen), the others run on.
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
    rngs = [np.random.default_rng(s) for s in _per_row(seed, b, "seed")]
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
    cache = engine.new_kv_cache(b, limit)
    try:
        logits = _prefill(engine, cache, prompts, running)
        stops = set(int(s) for s in (stop_token_ids or ()))
        while running:
            feed = []                      # rows whose new token goes into the cache for another step
            for i in running:
                tok = sample_next(logits[i], temperature, top_k, top_p, rngs[i])
                out[i].append(tok)
                if on_token is not None and on_token(i, tok):
                    continue
                if tok not in stops and len(out[i]) < budgets[i] and lengths[i] + len(out[i]) <= limit:
                    feed.append(i)
            if feed:
                logits = _advance(engine, cache, prompts, out, feed)
            running = feed
    finally:
        engine.free_kv_cache(cache)       # now, not when the garbage collector gets to it
    return out


def _prefill(engine, cache, seqs, rows) -> dict:
    """Write the tokens seqs[i] of each row i of `rows` into its cache row; returns row -> logits (V,) of its
    last token. Under longrope the rows whose length takes the long factors go in calls of their own."""
    logits = {}
    for long in (False, True):
        group = [i for i in rows if engine.cfg.rope_long(seqs[i].size - 1) == long]
        if group:
            logits.update(_prefill_rows(engine, cache, seqs, group, long))
    return logits


def _prefill_rows(engine, cache, seqs, rows, long_rope: bool) -> dict:
    ids = np.concatenate([seqs[i] for i in rows])                              # (N,) every token
    token_rows = np.concatenate([np.full(seqs[i].size, i) for i in rows])
    positions = np.concatenate([np.arange(seqs[i].size) for i in rows])
    ends = np.cumsum([seqs[i].size for i in rows]) - 1                        # each row's last token
    logits = {}
    for s in range(0, ids.size, PREFILL_TOKENS):
        e = min(s + PREFILL_TOKENS, ids.size)
        done = np.flatnonzero((ends >= s) & (ends < e))                        # rows whose tokens end here
        chunk = engine.forward_rows(ids[s:e], token_rows[s:e], positions[s:e], cache, ends[done] - s, long_rope)
        logits.update((rows[k], lg) for k, lg in zip(done, chunk))
    return logits


def _advance(engine, cache, prompts, out, feed) -> dict:
    """Each row of `feed` takes its newest token into the cache; returns row -> logits (V,) after it. Under
    longrope a row's RoPE factors follow its length, as transformers' Phi-3 generation has them: a row whose
    length first passes original_max_position_embeddings is prefilled again, whole, with the long factors
    (its cached keys had the short ones), and rows of either set advance in calls of their own."""
    cfg = engine.cfg
    pos = {i: prompts[i].size + len(out[i]) - 1 for i in feed}                # the newest token's position
    crossed = [i for i in feed if cfg.rope_long(pos[i]) and not cfg.rope_long(pos[i] - 1)]
    logits = _prefill(engine, cache, {i: np.concatenate([prompts[i], out[i]]) for i in crossed}, crossed)
    for long in (False, True):
        rows = [i for i in feed if i not in crossed and cfg.rope_long(pos[i]) == long]
        if rows:
            step = engine.forward_rows(np.array([out[i][-1] for i in rows]), np.array(rows),
                                       np.array([pos[i] for i in rows]), cache, np.arange(len(rows)), long)
            logits.update(zip(rows, step))                                     # (len(rows), V)
    return logits
