"""The thin WebGPU runtime: adapter choice, one device per adapter, shader/pipeline/bind-group caches,
buffers; its Recorder (recorder.py) puts many dispatches into one command encoder and one submit."""
from __future__ import annotations

import functools
import logging
import os
import struct
import threading
from dataclasses import dataclass
import numpy as np

from wgpu_train.engines.webgpu.device.launch import DEFAULT_LIMITS, Compiled
from wgpu_train.engines.webgpu.device.recorder import MAX_SECTIONS, Recorder
from wgpu_train.engines.webgpu.device.shaders import shader_error, shader_path, shader_text
from wgpu_train.errors import DeviceError

log = logging.getLogger("wgpu_train")

_TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3, "Unknown": 4}
_BACKEND_RANK = {"Vulkan": 0, "Metal": 0, "D3D12": 0, "OpenGL": 1}
OPTIONAL_FEATURES = ("subgroup", "shader-f16", "timestamp-query")
_runtimes: dict = {}


@dataclass(frozen=True)
class AdapterInfo:
    """One WebGPU adapter as wgpu reports it."""

    index: int
    name: str
    vendor: str
    backend: str
    adapter_type: str
    max_storage_binding: int = 0     # bytes one storage binding may hold (0: not reported)
    features: tuple = ()             # of OPTIONAL_FEATURES, those it offers
    limits: tuple = ()               # (name, value) of the launch.DEFAULT_LIMITS it reports

    def describe(self) -> str:
        return f"[{self.index}] {self.name} ({self.backend}, {self.adapter_type})"

    def details(self) -> str:
        """The limits and features that matter here, for `wgpu-train devices`."""
        used = ", ".join(self.features) or "none of " + ", ".join(OPTIONAL_FEATURES)
        lim = dict(self.limits)
        shown = "".join(f"; {label} {fmt(lim[name])}" for name, label, fmt in _SHOWN_LIMITS if name in lim)
        return f"max storage binding {self.max_storage_binding / 2**20:.0f} MiB{shown}; features: {used}"


# the kernel limits `wgpu-train devices` prints: (name, label, format)
_SHOWN_LIMITS = (("max-storage-buffers-per-shader-stage", "storage buffers per stage", str),
                 ("max-compute-workgroup-storage-size", "workgroup storage", lambda v: f"{v / 1024:g} KiB"),
                 ("max-compute-invocations-per-workgroup", "invocations per workgroup", str))


def _enumerate():
    # Mesa's EGL loader complains on every call when this is unset (headless machines, CI).
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    try:
        import wgpu
    except ImportError as e:  # pragma: no cover - wgpu is a dependency
        raise DeviceError(f"wgpu is not importable: {e}") from None
    try:
        return list(wgpu.gpu.enumerate_adapters_sync())
    except Exception as e:  # noqa: BLE001 - native loader failures come in many types
        log.debug("adapter enumeration failed: %s", e)
        return []


def devices() -> list[AdapterInfo]:
    """Every WebGPU adapter wgpu finds, in enumeration order."""
    out = []
    for i, a in enumerate(_enumerate()):
        info = a.info
        try:
            binding = int(a.limits.get("max-storage-buffer-binding-size", 0))
            features = tuple(f for f in OPTIONAL_FEATURES if f in a.features)
            limits = tuple((name, int(a.limits[name])) for name in DEFAULT_LIMITS if name in a.limits)
        except Exception:  # noqa: BLE001 - an adapter that cannot report them is still listed
            binding, features, limits = 0, (), ()
        out.append(AdapterInfo(i, info.get("device", "") or "unknown", info.get("vendor", ""),
                               info.get("backend_type", ""), info.get("adapter_type", "Unknown"), binding, features,
                               limits))
    return out


def _preference(info: AdapterInfo):
    return (_TYPE_RANK.get(info.adapter_type, 4), _BACKEND_RANK.get(info.backend, 2), info.index)


def choose_adapter(spec=None) -> AdapterInfo:
    """Pick an adapter: `spec` (or WGPU_TRAIN_DEVICE) as an index or a case-insensitive substring of
    the name or backend; otherwise a discrete GPU, then an integrated one, then a CPU adapter."""
    found = devices()
    if not found:
        raise DeviceError("no WebGPU adapter found (on Linux install a Vulkan driver, e.g. Debian's "
                          "mesa-vulkan-drivers, or use backend='numpy')")
    spec = spec if spec is not None else os.environ.get("WGPU_TRAIN_DEVICE")
    if spec is None or str(spec).strip() == "":
        return min(found, key=_preference)
    s = str(spec).strip()
    if s.isdigit():
        if int(s) >= len(found):
            raise DeviceError(f"device index {s} out of range: {len(found)} adapter(s) found")
        return found[int(s)]
    matches = [a for a in found if s.lower() in a.name.lower() or s.lower() in a.backend.lower()]
    if not matches:
        names = "; ".join(a.describe() for a in found)
        raise DeviceError(f"no adapter matches device spec {s!r}; found: {names}")
    return min(matches, key=_preference)


_SUBGROUPS_PROBE = ("enable subgroups;\n@compute @workgroup_size(1)\n"
                    "fn main(@builtin(subgroup_size) n: u32) { _ = n; }\n")


class _CountingQueue:
    """The device queue with its submissions counted where they happen (counters["submits"])."""

    def __init__(self, queue, counters: dict):
        self._queue, self._counters = queue, counters

    def submit(self, command_buffers):
        self._queue.submit(command_buffers)
        self._counters["submits"] += 1

    def __getattr__(self, name):
        return getattr(self._queue, name)


class _CallerThreadPoller:
    """Stands in for wgpu-py's per-device poll thread. That thread calls wgpuDevicePoll while the main
    thread goes on recording, which aborts the process on the OpenGL backend (GL contexts are bound
    to one thread); here every wait polls on the thread that waits (Runtime.read)."""

    class _Token:
        def set_done(self):
            pass

    def get_token(self):
        return self._Token()

    def stop(self):
        pass


class Runtime:
    """One device on one adapter, with caches so that nothing is rebuilt per dispatch."""

    def __init__(self, info: AdapterInfo):
        import wgpu

        self.wgpu = wgpu
        self.info = info
        self.adapter = _enumerate()[info.index]
        feats = set(self.adapter.features)
        self.features = {f for f in OPTIONAL_FEATURES if f in feats}
        lim = self.adapter.limits
        wanted = ("max-storage-buffer-binding-size", "max-buffer-size", "max-compute-workgroup-storage-size",
                  "max-compute-invocations-per-workgroup", "max-compute-workgroup-size-x",
                  "max-compute-workgroup-size-y", "max-storage-buffers-per-shader-stage",
                  "max-compute-workgroups-per-dimension")
        self.limits = {k: lim[k] for k in wanted if k in lim}
        try:
            self.device = self.adapter.request_device_sync(required_features=sorted(self.features),
                                                           required_limits=self.limits)
        except Exception as e:  # noqa: BLE001
            raise DeviceError(f"could not open device on {info.describe()}: {e}") from None
        poller = getattr(self.device, "_poller", None)
        if poller is not None:
            poller.stop()
            self.device._poller = _CallerThreadPoller()
        self._local = threading.local()     # each thread's staging buffer (see staging())
        self.max_binding = int(self.limits["max-storage-buffer-binding-size"])
        self.max_buffer = int(self.limits["max-buffer-size"])
        self.offset_alignment = int(lim.get("min-storage-buffer-offset-alignment", 256))
        self.counters = {"submits": 0, "readbacks": 0, "bytes_uploaded": 0, "bytes_read": 0, "buffers_created": 0}
        self.queue = _CountingQueue(self.device.queue, self.counters)
        self._modules: dict = {}
        self._pipelines: dict = {}
        self._compiled: dict = {}      # Kernel -> launch.Compiled
        self._bind_groups: dict = {}
        self._uniforms: dict = {}
        self._shared: dict = {}        # bytes -> read-only storage buffer (shared_storage)
        self._memo: dict = {}          # per-device facts and constant buffers of the op modules (memo)
        self._query_set = self._query_buffer = None
        log.info("wgpu-train: using adapter %s", info.describe())

    # ---- shaders and pipelines ----------------------------------------------------------------
    @property
    def has_timestamps(self) -> bool:
        return "timestamp-query" in self.features

    @functools.cached_property
    def wgsl_enables(self) -> tuple:
        """The WGSL extensions this device's compiler takes an `enable` directive for: f16 (required with the
        shader-f16 feature), and subgroups where a one-line probe compiles with it (the WGSL spec and Tint
        require the directive; naga 29 rejects it and takes the builtins without)."""
        enables = ["f16"]
        if "subgroup" in self.features:
            try:
                self.device.create_shader_module(label="subgroups probe", code=_SUBGROUPS_PROBE)
                enables.append("subgroups")
            except self.wgpu.GPUError:
                pass
        return tuple(enables)

    def module(self, name: str, source: str | None = None, path=None):
        """A compiled shader module, by shader name (shaders/<name>.wgsl) or from given source."""
        key = name if source is None else (name, source)
        if key not in self._modules:
            if source is None:
                path = shader_path(name)
                source = shader_text(name)
            path = path or f"{name}.wgsl"
            try:
                self._modules[key] = self.device.create_shader_module(label=name, code=source)
            except self.wgpu.GPUError as e:
                raise shader_error(path, source, e) from None
        return self._modules[key]

    def pipeline(self, name: str, entry_point: str, constants: dict | None = None, source: str | None = None):
        """A compute pipeline (layout 'auto') for one entry point, cached with its override constants."""
        key = (name, entry_point, tuple(sorted((constants or {}).items())), source)
        if key not in self._pipelines:
            module = self.module(name, source)
            compute = {"module": module, "entry_point": entry_point}
            if constants:
                compute["constants"] = dict(constants)
            try:
                self._pipelines[key] = self.device.create_compute_pipeline(layout="auto", compute=compute,
                                                                           label=f"{name}.{entry_point}")
            except self.wgpu.GPUError as e:
                raise shader_error(shader_path(name) if source is None else f"{name}.wgsl", "", e) from None
        return self._pipelines[key]

    def compiled(self, kernel):
        """A launch.Kernel's pipeline and uniform layout, compiled once."""
        c = self._compiled.get(kernel)
        if c is None:
            c = self._compiled[kernel] = Compiled(self, kernel)
        return c

    def compiled_kernels(self) -> list:
        """Every launch.Kernel compiled on this device so far."""
        return list(self._compiled)

    def memo(self, key, factory):
        """factory(self), computed once per runtime under `key`: the op modules keep their per-device state
        (probed facts, constant buffers) here rather than in module-level dictionaries."""
        if key not in self._memo:
            self._memo[key] = factory(self)
        return self._memo[key]

    def forget(self, key):
        """Drop what memo() holds under `key` (it is computed again on next use)."""
        self._memo.pop(key, None)

    # ---- buffers ------------------------------------------------------------------------------
    def check_size(self, nbytes: int, what: str = "buffer"):
        if nbytes > self.max_buffer:
            raise DeviceError(f"{what} needs {nbytes} bytes, over this device's max-buffer-size of {self.max_buffer}")

    def buffer(self, nbytes: int, label: str = "", usage=None):
        """A storage buffer of at least 4 bytes, rounded up to a multiple of 4 (zero-initialised)."""
        u = self.wgpu.BufferUsage
        usage = usage if usage is not None else (u.STORAGE | u.COPY_SRC | u.COPY_DST)
        nbytes = max(4, (int(nbytes) + 3) // 4 * 4)
        self.check_size(nbytes, label or "buffer")
        try:
            buf = self.device.create_buffer(size=nbytes, usage=usage, label=label)
            self.counters["buffers_created"] += 1
            return buf
        except self.wgpu.GPUError as e:
            raise DeviceError(f"could not allocate {nbytes} bytes for {label or 'a buffer'}: {e}") from None

    def upload(self, array: np.ndarray, label: str = ""):
        """A new storage buffer holding `array` (cast to its own dtype's bytes)."""
        data = np.ascontiguousarray(array)
        buf = self.buffer(data.nbytes, label)
        self.write(buf, data)
        return buf

    def write(self, buf, array: np.ndarray, offset: int = 0):
        data = np.ascontiguousarray(array)
        nbytes = data.nbytes
        if nbytes % 4:
            data = np.frombuffer(data.tobytes() + b"\0" * (4 - nbytes % 4), dtype=np.uint8)
        if data.nbytes:
            self.queue.write_buffer(buf, offset, data)
            self.counters["bytes_uploaded"] += nbytes

    def staging(self, size: int):
        """The calling thread's reused MAP_READ buffer that readbacks copy into, at least `size` bytes. One per
        thread: threads sharing this device (data-parallel workers in threads) each map their own, since a submit
        that copies into a buffer another thread holds mapped fails validation (a fatal abort in wgpu-native)."""
        u = self.wgpu.BufferUsage
        buf = getattr(self._local, "staging", None)
        if buf is None or buf.size < size:
            if buf is not None:
                buf.destroy()
            buf = self._local.staging = self.device.create_buffer(size=max(size, 256),
                                                                  usage=u.MAP_READ | u.COPY_DST, label="staging")
        return buf

    def map_staging(self, size: int) -> memoryview:
        """Wait on this thread for the submitted work, then copy the first `size` bytes of its staging out."""
        staging = self._local.staging
        try:
            promise = staging.map_async("READ_NOSYNC", 0, size)
            while promise._state == "pending":   # wgpu 0.32: the map callback fires inside a device poll
                self.device._poll(True)
            promise.sync_wait()                  # resolves now (raises if the map failed)
            data = staging.read_mapped(0, size, copy=True)
            staging.unmap()
        except self.wgpu.GPUError as e:
            raise DeviceError(f"device error while reading back results: {e}") from None
        self.counters["readbacks"] += 1
        self.counters["bytes_read"] += size
        return data

    def read_bytes(self, buf, offset: int, size: int) -> memoryview:
        """Copy `size` bytes of a buffer into the staging buffer in a submission of its own, and map it."""
        enc = self.device.create_command_encoder()
        enc.copy_buffer_to_buffer(buf, offset, self.staging(size), 0, size)
        try:
            self.queue.submit([enc.finish()])
        except self.wgpu.GPUError as e:
            raise DeviceError(f"device error while reading back results: {e}") from None
        return self.map_staging(size)

    def read(self, buf, dtype=np.float32, shape=None, offset: int = 0) -> np.ndarray:
        """Copy a buffer (or its first prod(shape) elements from offset) back to the CPU."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape)) if shape is not None else (buf.size - offset) // dtype.itemsize
        nbytes = count * dtype.itemsize
        size = (nbytes + 3) // 4 * 4
        mem = self.read_bytes(buf, offset, size)
        out = np.frombuffer(mem, dtype=np.uint8)[:nbytes].view(dtype).copy()
        return out.reshape(shape) if shape is not None else out

    def uniform(self, fmt: str, *values):
        """A small uniform buffer with struct-packed values, shared by every dispatch with the same values."""
        data = struct.pack(fmt, *values)
        data += b"\0" * (-len(data) % 16 or (16 if not data else 0))
        buf = self._uniforms.get(data)
        if buf is None:
            u = self.wgpu.BufferUsage
            buf = self.device.create_buffer_with_data(data=data, usage=u.UNIFORM | u.COPY_DST)
            self._uniforms[data] = buf
        return buf

    def shared_storage(self, array: np.ndarray):
        """A read-only storage buffer holding `array`, shared by every caller with the same bytes (a table
        that many dispatches read at per-invocation indices, where a uniform buffer would serialise them)."""
        data = np.ascontiguousarray(array).tobytes()
        buf = self._shared.get(data)
        if buf is None:
            buf = self._shared[data] = self.upload(np.frombuffer(data, np.uint8), "shared table")
        return buf

    def bind_group(self, pipeline, resources):
        """A cached bind group for group 0; `resources` lists buffers or (buffer, offset, size) in binding order
        (None for a binding number the pipeline does not have)."""
        entries, key = [], [id(pipeline)]
        for i, r in enumerate(resources):
            if r is None:          # a binding number the kernel does not use
                continue
            if isinstance(r, tuple):
                buf, off, size = r
            else:
                buf, off, size = r, 0, r.size
            entries.append({"binding": i, "resource": {"buffer": buf, "offset": off, "size": size}})
            key.append((id(buf), off, size))
        key = tuple(key)
        bg = self._bind_groups.get(key)
        if bg is None:
            bg = self.device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=entries)
            self._bind_groups[key] = (bg, resources)  # keep the buffers alive while cached
            return bg
        return bg[0]

    def release(self, *buffers):
        """Forget cached bind groups that use these buffers (call before dropping them)."""
        ids = {id(b) for b in buffers}
        for k in [k for k in list(self._bind_groups) if any(isinstance(e, tuple) and e[0] in ids for e in k[1:])]:
            self._bind_groups.pop(k, None)       # list(): a snapshot, as another thread may be adding to it
        for b in buffers:
            b.destroy()

    # ---- recording ----------------------------------------------------------------------------
    def recorder(self, profile: bool = False, max_dispatches: int = 0) -> Recorder:
        return Recorder(self, profile, max_dispatches)

    def query_set(self):
        """The timestamp query set shared by profiled recordings (created on first use)."""
        if self._query_set is None:
            self._query_set = self.device.create_query_set(type="timestamp", count=2 * MAX_SECTIONS)
        return self._query_set

    def query_buffer(self):
        if self._query_buffer is None:
            u = self.wgpu.BufferUsage
            self._query_buffer = self.buffer(16 * MAX_SECTIONS, "timestamps",
                                             usage=u.QUERY_RESOLVE | u.COPY_SRC | u.STORAGE)
        return self._query_buffer


def get_runtime(device=None) -> Runtime:
    """The process-wide Runtime for the chosen adapter (created once per adapter, never rebuilt)."""
    info = choose_adapter(device)
    rt = _runtimes.get(info.index)
    if rt is None:
        rt = _runtimes[info.index] = Runtime(info)
    return rt


def has_adapter() -> bool:
    return bool(devices())
