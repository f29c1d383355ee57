"""LoRA initialisations with PEFT's definitions (init_lora_weights): "default" (PEFT's True: kaiming-uniform
A, zero B), "gaussian", and PiSSA / OLoRA, which start A, B from the base weight W and train over the residual
W - scale * B0 A0; and PEFT's conversion of a trained PiSSA / OLoRA adapter into a plain LoRA of rank 2r on
the untouched base (save_pretrained's path_initial_model_for_weight_conversion)."""
from __future__ import annotations

import json
import re

import numpy as np

from wgpu_train.errors import AdapterError, ConfigError

INITS = ("default", "gaussian", "pissa", "pissa_niter_K", "olora")


def check_init(cfg) -> str:
    """cfg.init (a LoraConfig's) checked: one of INITS (K a whole number >= 1; PEFT's True and "true" read
    as "default"); rsLoRA with rank_pattern / alpha_pattern cannot take PiSSA / OLoRA, as PEFT refuses their
    conversion to a plain LoRA (which every save here makes)."""
    init = cfg.init
    if init is True or isinstance(init, str) and init.lower() == "true":
        init = "default"
    if not isinstance(init, str) or not (init in ("default", "gaussian", "pissa", "olora")
                                         or re.fullmatch(r"pissa_niter_[1-9]\d*", init)):
        raise ConfigError(f"LoRA init must be one of {', '.join(INITS)} (K: subspace iterations >= 1), got {init!r}")
    if changes_base(init) and cfg.use_rslora and (cfg.rank_pattern or cfg.alpha_pattern):
        raise ConfigError(f"LoRA init {init} with rsLoRA and rank_pattern / alpha_pattern: PEFT cannot convert such "
                          f"an adapter to a plain LoRA on the original base; drop rsLoRA or the patterns")
    return init


def changes_base(init: str) -> bool:
    """Whether the init trains over a residual base (PiSSA, OLoRA) rather than the base itself."""
    return init.startswith("pissa") or init == "olora"


def peft_value(init: str):
    """init as adapter_config.json's init_lora_weights records it (PEFT's True for the default)."""
    return True if init == "default" else init


def from_peft(value, where) -> str:
    """adapter_config.json's init_lora_weights as an init here. PiSSA / OLoRA values are kept: their residual
    base must be rebuilt, as PEFT rebuilds it on loading. Inits that leave the base alone (true, false,
    "gaussian", "orthogonal", "eva", "mica", or none) give trained weights that load as they are: "default"
    ("gaussian" kept, for the record). Other inits change the base in ways not computed here: refused."""
    if value in (None, True, False, "orthogonal", "eva", "mica"):
        return "default"
    if isinstance(value, str) and (value in ("gaussian", "pissa", "olora") or
                                   re.fullmatch(r"pissa_niter_[1-9]\d*", value)):
        return value
    raise AdapterError(f"{where}: not supported: init_lora_weights={json.dumps(value)} (an init that changes the "
                       f"base weights; supported: true, gaussian, pissa, pissa_niter_K, olora)")


def kaiming_uniform_a(rng: np.random.Generator, r: int, in_features: int) -> np.ndarray:
    """PEFT's default lora_A: kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)); (r, in)."""
    bound = 1.0 / np.sqrt(in_features)
    return rng.uniform(-bound, bound, size=(r, in_features)).astype(np.float32)


def fresh_pair(rng: np.random.Generator, init: str, r: int, out_f: int, in_f: int) -> tuple:
    """(A (r, in), B (out, r)) of an init that leaves the base alone: B zero, A kaiming-uniform ("default")
    or normal with std 1/r ("gaussian")."""
    if init == "gaussian":
        a = rng.normal(0.0, 1.0 / r, size=(r, in_f)).astype(np.float32)
    else:
        a = kaiming_uniform_a(rng, r, in_f)
    return a, np.zeros((out_f, r), np.float32)


def _low_rank_svd(w: np.ndarray, r: int, niter: int, rng: np.random.Generator) -> tuple:
    """(U (out, r), S (r,), Vh (r, in)) of w by randomised subspace iteration (Halko et al.; the algorithm of
    torch.svd_lowrank with q = r, which PEFT's pissa_niter_K calls), from a Gaussian start drawn from rng."""
    tall = w.shape[0] >= w.shape[1]
    a = w if tall else w.T                                  # (m, n), m >= n
    q = np.linalg.qr(a @ rng.standard_normal((a.shape[1], r)))[0]     # (m, r)
    for _ in range(niter):
        q = np.linalg.qr(a.T @ q)[0]                        # (n, r)
        q = np.linalg.qr(a @ q)[0]                          # (m, r)
    u, s, vh = np.linalg.svd(q.T @ a, full_matrices=False)  # (r, r), (r,), (r, n)
    u = q @ u                                               # (m, r)
    return (u, s, vh) if tall else (vh.T, s, u.T)


def decompose(w: np.ndarray, r: int, scale: float, init: str, rng: np.random.Generator) -> tuple:
    """(A (r, in), B (out, r), residual (out, in)) of PiSSA or OLoRA on a base weight w (out, in), computed in
    float64 (PEFT: float32), so that residual + scale * B @ A = w:
    - pissa: w = U S Vh (full SVD); A = sqrt(S_r / scale) Vh_r, B = U_r sqrt(S_r / scale);
    - pissa_niter_K: the same from a randomised SVD of K subspace iterations (seeded by rng);
    - olora: w = Q R (QR); A = R_r (the first r rows), B = Q_r (the first r columns)."""
    if r > min(w.shape):
        raise ConfigError(f"LoRA init {init} needs r <= min(out, in) = {min(w.shape)} of a {w.shape[0]} x "
                          f"{w.shape[1]} weight, got r={r}")
    w64 = np.asarray(w, dtype=np.float64)
    if init == "olora":
        q, rr = np.linalg.qr(w64)                           # (out, k), (k, in), k = min(out, in)
        a, b = rr[:r], q[:, :r]
    else:
        if init == "pissa":
            u, s, vh = np.linalg.svd(w64, full_matrices=False)
            u, s, vh = u[:, :r], s[:r], vh[:r]
        else:
            u, s, vh = _low_rank_svd(w64, r, int(init.rsplit("_", 1)[1]), rng)
        root = np.sqrt(s / scale)                           # (r,)
        a, b = root[:, None] * vh, u * root[None, :]
    residual = w64 - scale * (b @ a)
    return a.astype(np.float32), b.astype(np.float32), residual.astype(np.float32)


def converted(a: np.ndarray, b: np.ndarray, a0: np.ndarray, b0: np.ndarray) -> tuple:
    """PEFT's conversion of a PiSSA / OLoRA pair trained from (a0, b0) into a plain LoRA pair on the original
    base: B A - B0 A0 = [B | -B0] [A ; A0], so A' (2r, in) = [A ; A0] and B' (out, 2r) = [B | -B0]."""
    return np.concatenate([a, a0], axis=0), np.concatenate([b, -b0], axis=1)


def converted_config(cfg):
    """The LoraConfig PEFT records for a converted adapter: init true, r and every rank_pattern value doubled,
    alpha doubled (times sqrt(2) with rsLoRA), so every module keeps its scale."""
    import dataclasses
    import math

    alpha = cfg.alpha * (math.sqrt(2) if cfg.use_rslora else 2)
    return dataclasses.replace(cfg, r=2 * cfg.r, alpha=alpha, init="default",
                               rank_pattern={k: 2 * v for k, v in cfg.rank_pattern.items()},
                               alpha_pattern={k: 2 * v for k, v in cfg.alpha_pattern.items()})
