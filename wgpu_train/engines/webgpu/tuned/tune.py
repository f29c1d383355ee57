"""The kernel autotuner (GEMMs and attention): the first time a shape is needed on an adapter, time the
candidates that fit it (each checked once against NumPy), keep the fastest, and remember the choice in a
per-adapter cache file. A problem (gemm_kernels.Problem, quant_kernels.QProblem,
attention_kernels.AttentionProblem) gives its candidates, key, signature, flops, tolerance and a replica.

Controls: WGPU_TRAIN_TUNE=off (the untuned default choice everywhere), fast (the default: tune on GPUs, a
few candidates each; CPU adapters keep the choice measured on llvmpipe unless `wgpu-train tune` asks),
full (every candidate, on every adapter). WGPU_TRAIN_GEMM_KERNEL=<name prefix>[,<another>...] (or `pinned(...)`) forces the first candidate
whose name starts with the first prefix that any candidate has, for tests. The cache: $XDG_CACHE_HOME/wgpu-train/tune/<adapter>.json,
stale when a family's shader or candidate list changes (a checksum of the sources of catalogue.FAMILIES), written
atomically.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np

from wgpu_train.errors import ConfigError
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.tuned.catalogue import FAMILIES
from wgpu_train.engines.webgpu.tuned.adapter_traits import is_cpu

log = logging.getLogger("wgpu_train")

MODES = ("off", "fast", "full")
FAST_CANDIDATES = 8          # candidates timed per shape in fast mode (the best guesses first)
ROOFLINE_STOP = 0.85         # stop once a candidate reaches this fraction of the FMA peak
DROP_SLOWER = 3.0            # a candidate whose first timed run is this much slower than the best is dropped
CACHE_VERSION = 1
_pins: list = []
_modes: list = []


def mode() -> str:
    """The tuning mode: forced_mode's, else WGPU_TRAIN_TUNE, checked: off, fast (default) or full."""
    if _modes:
        return _modes[-1]
    value = os.environ.get("WGPU_TRAIN_TUNE", "fast").strip().lower() or "fast"
    if value not in MODES:
        raise ConfigError(f"WGPU_TRAIN_TUNE={value!r} is not one of {', '.join(MODES)}")
    return value


@contextlib.contextmanager
def forced_mode(value: str):
    """Within the block, tune in this mode whatever WGPU_TRAIN_TUNE says."""
    if value not in MODES:
        raise ConfigError(f"tuning mode {value!r} is not one of {', '.join(MODES)}")
    _modes.append(value)
    try:
        yield
    finally:
        _modes.pop()


@contextlib.contextmanager
def pinned(prefix: str):
    """Within the block, every GEMM runs the first candidate whose name starts with `prefix` (when one applies;
    "a,b": with a, else with b)."""
    _pins.append(prefix)
    try:
        yield
    finally:
        _pins.pop()


def _pin() -> str | None:
    return _pins[-1] if _pins else (os.environ.get("WGPU_TRAIN_GEMM_KERNEL") or None)


# ---- the cache file ------------------------------------------------------------------------------

def sources_checksum(families=FAMILIES) -> str:
    """sha256 over every tuned family's sources (Family.sources: its shaders as compiled, with the files they
    include, and the modules that build them and list its candidates); a missing file raises, naming it."""
    h = hashlib.sha256()
    for family in families:
        for name, text in family.sources():
            h.update(f"{family.name}/{name}".encode() + b"\0" + text + b"\0")
    return h.hexdigest()[:16]


def adapter_identity(rt) -> dict:
    info = rt.adapter.info
    return {"name": rt.info.name, "vendor": rt.info.vendor, "backend": rt.info.backend,
            "type": rt.info.adapter_type, "driver": str(info.get("description", "") or "")}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "wgpu-train" / "tune"


class TuneCache:
    """The tuned choices of one adapter: {key: {"choice": name, "gflops": {candidate: GFLOP/s}}}."""

    def __init__(self, rt):
        ident = adapter_identity(rt)
        digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
        self.identity, self.checksum = ident, sources_checksum()
        self.path = cache_dir() / f"{digest}.json"
        self.entries: dict = {}
        self.peak_gflops = 0.0
        self._read()

    def _load(self) -> dict | None:
        """The file's valid content, or None (absent; unreadable or stale with a warning)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("wgpu-train: tune cache %s is unreadable (%s); re-tuning", self.path, e)
            return None
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            log.warning("wgpu-train: tune cache %s is not a tune cache; re-tuning", self.path)
            return None
        if data.get("version") != CACHE_VERSION or data.get("checksum") != self.checksum:
            log.warning("wgpu-train: tune cache %s was made by other GEMM kernels; re-tuning", self.path)
            return None
        return data

    def _read(self):
        data = self._load()
        if data:
            self.entries = {k: v for k, v in data["entries"].items() if isinstance(v, dict) and "choice" in v}
            self.peak_gflops = float(data.get("peak_gflops") or 0.0)

    def get(self, key: str) -> str | None:
        e = self.entries.get(key)
        return e["choice"] if e else None

    def put(self, key: str, entry: dict):
        """Record a choice and write the file: merged with what another process wrote meanwhile, under a
        lock where the platform has one, and replaced atomically (a reader never sees half a file)."""
        self.entries[key] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(self.path.with_suffix(".lock")):
            on_disk = self._load() or {}
            merged = dict(on_disk.get("entries", {}))
            merged.update(self.entries)
            self.entries = merged
            data = {"version": CACHE_VERSION, "checksum": self.checksum, "adapter": self.identity,
                    "peak_gflops": self.peak_gflops, "entries": merged}
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise


@contextlib.contextmanager
def _locked(path: Path):
    try:
        import fcntl
    except ImportError:      # Windows: the atomic replace alone
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cache(rt) -> TuneCache:
    """This runtime's tune cache (read once)."""
    return rt.memo("tune.cache", TuneCache)


def forget(rt):
    """Drop this runtime's tuner state (cache contents read, choices made, the log): as a new process."""
    for key in ("tune.cache", "tune.choices", "tune.by_shape", "tune.log"):
        rt.forget(key)


def tuned_log(rt) -> list:
    """[(key, choice, {candidate: GFLOP/s})] of the shapes tuned in this process (for `wgpu-train tune`)."""
    return rt.memo("tune.log", lambda r: [])


# ---- choosing ----------------------------------------------------------------------------------------

def choose(rt, p):
    """The candidate that runs p (a GEMM problem: gemm_kernels.Problem, quant_kernels.QProblem): a pinned one,
    else the cached or freshly tuned choice, else the default (p.candidates()[0]). Remembered per exact shape
    (p.signature()) for this runtime, so that recording a step looks each GEMM up in a dictionary."""
    pin = _pin()
    if pin:
        cands = p.candidates()
        for prefix in pin.split(","):
            for c in cands:
                if c.name.startswith(prefix):
                    return c
    m = mode()
    by_shape = rt.memo("tune.by_shape", lambda r: {})
    chosen = by_shape.get((m, p.signature()))
    if chosen is not None:
        return chosen
    cands = p.candidates()
    key = p.key()
    names = rt.memo("tune.choices", lambda r: {})
    if m == "off" or (m == "fast" and is_cpu(rt) and not _modes) or len(cands) == 1:
        chosen = cands[0]
    else:
        by_name = {c.name: c for c in cands}
        name = names.get(key) or cache(rt).get(key)
        if name not in by_name:
            name = tune_shape(rt, p, cands if m == "full" else fast_set(cands), key)
        chosen = by_name[name]
    names.setdefault(key, chosen.name)
    by_shape[(m, p.signature())] = chosen
    return chosen


def fast_set(cands: list) -> list:
    """The candidates fast mode times: each family's likeliest one, then the likeliest others, FAST_CANDIDATES
    in all, in the candidates' order (so a family ranked last, e.g. the register kernels on a GPU, is tried)."""
    out = []
    for c in cands:
        if all(o.family != c.family for o in out):
            out.append(c)
    for c in cands:
        if len(out) >= FAST_CANDIDATES:
            break
        if c not in out:
            out.append(c)
    return sorted(out, key=cands.index)


def measure(rt, p, cands: list, peak_gflops: float = 0.0, timer=None) -> dict:
    """{candidate name: GFLOP/s, or None when its result is wrong} on p's geometry with fresh random operands,
    each candidate checked once against NumPy before it is timed (timestamp queries where the adapter has
    them). A candidate whose first run is DROP_SLOWER times slower than the best is timed only once; with a
    peak, timing stops at the first one that reaches ROOFLINE_STOP of it."""
    from wgpu_train.engines.webgpu.device.timing import Timer

    timer = timer or Timer(rt)
    q, c_buf, c0, want, bufs = p.replica(np.random.default_rng(0))
    # the replica's result: one buffer, or (buffer, elements) pairs (attention: its outputs, then float32 statistics),
    # each in its storage format
    parts = c_buf if isinstance(c_buf, list) else [(c_buf, c0.size)]
    results: dict = {}
    best_t = float("inf")
    try:
        for cand in cands:
            try:
                dispatches = cand.dispatches(q)
            except Exception as e:  # noqa: BLE001 - a candidate the driver rejects is skipped, not fatal
                log.warning("wgpu-train: GEMM candidate %s failed to build on %s: %s", cand.name, rt.info.name, e)
                continue
            for (buf, n), at in zip(parts, np.cumsum([0] + [n for _, n in parts])):
                rt.write(buf, storage.to_words(c0.reshape(-1)[at:at + n], storage.format_of(buf)))
            rec = rt.recorder()
            for d in dispatches:
                rec.dispatch(*d)
            rec.submit()
            got = np.concatenate([storage.read(rt, buf, n) for buf, n in parts]).reshape(c0.shape)
            err = float(np.max(np.abs(got - want))) if got.size else 0.0
            tol = q.tolerance(want, cand)
            if not err <= tol:
                log.warning("wgpu-train: GEMM candidate %s is wrong on %s for %s (max error %.3g); not used",
                            cand.name, rt.info.name, p.describe(), err)
                results[cand.name] = None
                continue
            first = timer.time(dispatches, repeats=1, budget_s=0.5, warmup=[])
            t = first if first > DROP_SLOWER * best_t else min(first, timer.time(dispatches, repeats=3,
                                                                                    budget_s=0.5, warmup=[]))
            results[cand.name] = round(q.flops / t / 1e9, 2)
            best_t = min(best_t, t)
            if peak_gflops and q.flops / best_t / 1e9 >= ROOFLINE_STOP * peak_gflops:
                break
    finally:
        rt.release(*bufs)
    return results


def tune_shape(rt, p, cands: list, key: str) -> str:
    """Measure `cands` on p's shape; cache and return the fastest correct one's name."""
    from wgpu_train.engines.webgpu.device.timing import Timer, fma_peak

    store = cache(rt)
    timer = Timer(rt)
    if not store.peak_gflops:
        store.peak_gflops = fma_peak(rt, timer)
    results = measure(rt, p, cands, store.peak_gflops, timer)
    timed = {name: g for name, g in results.items() if g is not None}
    if timed:
        best_name = max(timed, key=timed.get)
    else:
        best_name = cands[0].name
        log.warning("wgpu-train: no GEMM candidate passed its check for %s; using %s", p.describe(), best_name)
    entry = {"choice": best_name, "gflops": results, "peak_gflops": round(store.peak_gflops, 1),
             "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    store.put(key, entry)
    tuned_log(rt).append((key, best_name, results))
    log.info("wgpu-train: tuned %s: %s (%s GFLOP/s)", key, best_name, results.get(best_name))
    return best_name
