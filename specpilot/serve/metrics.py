"""The server's Prometheus metrics (prometheus-client), in a registry of their own per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


class ServeMetrics:
    """Counters, gauges and histograms of one server; `render()` is the /metrics body."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specpilot_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("specpilot_requests_finished", "Generation requests ended, by finish reason",
                                ["reason"], registry=r)
        self.rejected = Counter("specpilot_requests_rejected_queue_full", "Requests refused: the queue was full",
                                registry=r)
        self.prompt_tokens = Counter("specpilot_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("specpilot_generation_tokens", "Tokens generated", registry=r)
        self.steps = Counter("specpilot_engine_steps", "Engine steps run", registry=r)
        self.running = Gauge("specpilot_requests_running", "Requests the engine is running", registry=r)
        self.waiting = Gauge("specpilot_requests_waiting", "Requests waiting for a slot", registry=r)
        self.ttft = Histogram("specpilot_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("specpilot_request_latency_seconds", "Arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
