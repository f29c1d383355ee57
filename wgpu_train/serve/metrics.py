"""The server's Prometheus metrics (prometheus_client, the serve extra), in a registry of each scheduler's own:
requests and tokens counted, the queue and the running batch as gauges, time to the first token and between
tokens as histograms; /metrics renders them in Prometheus' text format."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
# seconds: a token of a tiny model on a GPU takes about a millisecond, one of a 1B model on lavapipe a second
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServeMetrics:
    """What a scheduler reports (prefix wgpu_train_serve_)."""

    def __init__(self, max_batch: int):
        self.registry = CollectorRegistry()
        p, r = "wgpu_train_serve_", self.registry
        self.requests = Counter(p + "requests", "answers ended, by served model and finish reason "
                                "(stop, length, cancelled, error)", ["model", "finish_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of the answers admitted", registry=r)
        self.prefix_reused = Counter(p + "prefix_reused_tokens", "prompt tokens whose keys and values a row found "
                                     "in its cache row already (prefix reuse), not prefilled", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=r)
        self.steps = Counter(p + "steps", "engine steps of the running batch", registry=r)
        self.queue = Gauge(p + "queue_length", "answers waiting for a row of the running batch", registry=r)
        self.running = Gauge(p + "batch_rows_running", "rows of the running batch in use (its occupancy)",
                             registry=r)
        Gauge(p + "batch_rows", "rows of the running batch (--max-batch)", registry=r).set(max_batch)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "from queueing to the first token chosen",
                              buckets=TTFT_BUCKETS, registry=r)
        self.per_token = Histogram(p + "time_per_output_token_seconds", "between two tokens of one answer",
                                   buckets=TOKEN_BUCKETS, registry=r)

    def render(self) -> bytes:
        """The metrics in Prometheus' text exposition format."""
        return generate_latest(self.registry)
