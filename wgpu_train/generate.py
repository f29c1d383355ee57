"""Token generation: greedy or seeded sampling (temperature, top-k, top-p) over an engine's KV cache."""
from __future__ import annotations

import numpy as np

from .errors import ConfigError


def sample_next(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> int:
    """One token id from logits (V,): argmax when temperature is 0, else a draw from the filtered softmax."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if top_k and top_k < z.shape[0]:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p) + 1)]   # the smallest set reaching top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.shape[0], p=p))


def generate(engine, input_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed=None, stop_token_ids=(), on_token=None, max_len=None) -> list[int]:
    """New token ids after the prompt input_ids (T,) (prefill, then one token per step on the KV cache).

    Stops after max_new_tokens or at a token in stop_token_ids (which is included); `on_token(id)`
    is called as each token is chosen, for streaming.
    """
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise ConfigError("generate needs a prompt of at least one token")
    if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ConfigError("need temperature >= 0, top_k >= 0 and 0 < top_p <= 1")
    limit = max_len or ids.size + max_new_tokens
    cache = engine.new_kv_cache(1, limit)
    rng = np.random.default_rng(seed)
    stops = set(int(s) for s in (stop_token_ids or ()))
    logits = engine.forward_cached(ids[None].astype(np.int32), cache)[0]
    out: list[int] = []
    for i in range(max_new_tokens):
        tok = sample_next(logits, temperature, top_k, top_p, rng)
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if tok in stops or i == max_new_tokens - 1 or cache["len"] + 1 > limit:
            break
        logits = engine.forward_cached(np.array([[tok]], dtype=np.int32), cache)[0]
    return out
