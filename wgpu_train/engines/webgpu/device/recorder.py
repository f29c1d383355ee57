"""The Recorder: many dispatches and copies in one command encoder and one queue.submit (or several, cut
at split points), with timestamp-timed sections when profiling."""
from __future__ import annotations

import numpy as np

from wgpu_train.errors import DeviceError

MAX_SECTIONS = 2048      # timed sections of one profiled recording (timestamp query pairs)


class Recorder:
    """Records dispatches and copies into one command encoder; `submit()` sends them in one queue.submit.
    With max_dispatches, each split_point() after that many dispatches since the last cut submits what is
    recorded and goes on in a new encoder (a long step in several submissions).

    With `profile=True`, `section(label)` starts a compute pass timed by timestamp queries (where
    the adapter has them; consecutive sections with the same label share a pass), and `timings()`
    after the submit returns seconds per label. `profile="total"` times every pass under one label
    (the GPU's busy time, with fewer passes). Without profiling, `section` does nothing. rt: the
    runtime.Runtime it records for (Runtime.recorder() makes one).
    """

    def __init__(self, rt, profile: bool = False, max_dispatches: int = 0):
        self.rt = rt
        self.encoder = rt.device.create_command_encoder()
        self._pass = None
        self.dispatches = 0
        self.max_dispatches = int(max_dispatches)   # split_point() submits after this many (0: never)
        self.flushed_at = 0                         # dispatches recorded before the last cut
        self._readback = None
        self._read_size = 0
        self.profile = bool(profile) and rt.has_timestamps
        self._total = profile == "total"
        self._labels: list = []
        self._label = "GPU busy" if self._total else None
        self._submitted_at = None

    def section(self, label):
        """Attribute the following dispatches to `label` (profiling only)."""
        if not self.profile or self._total or label == self._label:
            return
        self.end_pass()
        self._label = label

    def _compute_pass(self):
        if self._pass is None:
            kw = {}
            if self.profile and self._label is not None and len(self._labels) < MAX_SECTIONS:
                i = 2 * len(self._labels)
                kw["timestamp_writes"] = {"query_set": self.rt.query_set(), "beginning_of_pass_write_index": i,
                                          "end_of_pass_write_index": i + 1}
                self._labels.append(self._label)
            self._pass = self.encoder.begin_compute_pass(**kw)
        return self._pass

    def end_pass(self):
        if self._pass is not None:
            self._pass.end()
            self._pass = None

    def dispatch(self, pipeline, resources, groups):
        """One dispatch of `pipeline` with bind group 0 built from `resources`; groups (x[, y[, z]])."""
        groups = tuple(int(g) for g in (groups if isinstance(groups, (tuple, list)) else (groups,)))
        limit = self.rt.limits.get("max-compute-workgroups-per-dimension", 65535)
        if any(g > limit for g in groups):
            raise DeviceError(f"dispatch of {groups} workgroups exceeds max-compute-workgroups-per-dimension {limit}")
        if any(g == 0 for g in groups):
            return
        p = self._compute_pass()
        p.set_pipeline(pipeline)
        p.set_bind_group(0, self.rt.bind_group(pipeline, resources))
        p.dispatch_workgroups(*groups)
        self.dispatches += 1

    def copy(self, src, src_offset, dst, dst_offset, nbytes):
        self.end_pass()
        self.encoder.copy_buffer_to_buffer(src, src_offset, dst, dst_offset, nbytes)

    def clear(self, buf, offset=0, nbytes=None):
        self.end_pass()
        self.encoder.clear_buffer(buf, offset, buf.size - offset if nbytes is None else nbytes)

    def read_back(self, buf, dtype=np.float32, shape=(1,), offset: int = 0):
        """Copy prod(shape) elements of buf (from byte offset) to the staging buffer at the end of this
        recording, in its own command buffer's last commands; `result()` after `submit()` returns them."""
        self._readback = (buf, np.dtype(dtype), tuple(shape), int(offset))

    def split_point(self):
        """A place where a long recording may be cut into another submission (see max_dispatches)."""
        if self.max_dispatches and self.dispatches - self.flushed_at >= self.max_dispatches:
            self._flush()
            self.flushed_at = self.dispatches

    def _send(self):
        """Submit the encoder's commands so far."""
        self.end_pass()
        try:
            self.rt.queue.submit([self.encoder.finish()])
        except self.rt.wgpu.GPUError as e:
            raise DeviceError(f"device error on submit: {e}") from None

    def _flush(self):
        self._send()
        self.encoder = self.rt.device.create_command_encoder()

    def submit(self):
        """Send what is recorded (with the timestamp resolve and the read_back copy, if any)."""
        self.end_pass()
        if self._labels:
            n = 2 * len(self._labels)
            self.encoder.resolve_query_set(self.rt.query_set(), 0, n, self.rt.query_buffer(), 0)
        if self._readback is not None:
            buf, dtype, shape, offset = self._readback
            nbytes = int(np.prod(shape)) * dtype.itemsize
            self._read_size = (nbytes + 3) // 4 * 4
            self.encoder.copy_buffer_to_buffer(buf, offset, self.rt.staging(self._read_size), 0, self._read_size)
        self._send()

    def result(self) -> np.ndarray:
        """The array read_back asked for (waits for the submitted work)."""
        buf, dtype, shape, _ = self._readback
        mem = self.rt.map_staging(self._read_size)
        n = int(np.prod(shape)) * dtype.itemsize
        return np.frombuffer(mem, dtype=np.uint8)[:n].view(dtype).reshape(shape).copy()

    def timings(self) -> dict:
        """Seconds of GPU time per section label (after submit; reads the timestamps back)."""
        if not self._labels:
            return {}
        ticks = self.rt.read(self.rt.query_buffer(), np.uint64, (2 * len(self._labels),))
        out: dict = {}
        for i, label in enumerate(self._labels):
            dt = max(0, int(ticks[2 * i + 1]) - int(ticks[2 * i])) * 1e-9
            out[label] = out.get(label, 0.0) + dt
        return out


def count_submissions(rt, counters: dict, before: dict):
    """Add the runtime's submissions, readbacks and bytes since `before` (a copy of rt.counters) to counters."""
    for k in ("submits", "readbacks", "bytes_uploaded", "bytes_read"):
        counters[k] += rt.counters[k] - before[k]


def submit(rt, counters: dict, rec):
    """Submit a recording, counted."""
    before = dict(rt.counters)
    rec.submit()
    count_submissions(rt, counters, before)
