"""The server's Prometheus metrics (`GET /metrics`, `prometheus_client`'s text format).

    v4compile_requests_total{path, status}          HTTP requests answered (path: the API's routes, else "other")
    v4compile_prompt_tokens_total                   prompt tokens of accepted requests (once per request, any n)
    v4compile_generation_tokens_total               tokens generated (every choice's)
    v4compile_time_to_first_token_seconds           a choice's first token after its request arrived (histogram)
    v4compile_time_per_output_token_seconds         a choice's mean time between tokens after its first (histogram)
    v4compile_queue_length                          requests waiting for a slot
    v4compile_live_sequences                        sequences in the running batch (live slots)
    v4compile_pool_blocks_used                      KV-pool blocks held (of v4compile_pool_blocks)

Each server has its own registry (several servers in one process do not share counts). The gauges are read
when scraped. `/metrics` is open like `/health` (no API key, as vLLM's): it gives counts and timings, never a
request's content; the `Host` check still applies.
"""

from __future__ import annotations

import time

PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class Metrics:
    def __init__(self, server):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("v4compile_requests", "HTTP requests answered", ["path", "status"], registry=r)
        self.prompt_tokens = Counter("v4compile_prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("v4compile_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("v4compile_time_to_first_token_seconds", "seconds from a request's arrival to a "
                              "choice's first token", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("v4compile_time_per_output_token_seconds", "a choice's mean seconds per token after "
                              "its first", buckets=TPOT_BUCKETS, registry=r)
        Gauge("v4compile_queue_length", "requests waiting for a slot", registry=r).set_function(
            lambda: len(server.batcher.waiting))
        Gauge("v4compile_live_sequences", "sequences in the running batch", registry=r).set_function(
            lambda: len(server.batcher.live))
        alloc = getattr(server.sess, "alloc", None)
        if alloc is not None:
            total = len(alloc.free_blocks)  # all free before any request
            Gauge("v4compile_pool_blocks", "KV-pool blocks", registry=r).set(total)
            Gauge("v4compile_pool_blocks_used", "KV-pool blocks held by sequences", registry=r).set_function(
                lambda: total - len(alloc.free_blocks))

    def answered(self, path: str, status: int) -> None:
        self.requests.labels(path if path in PATHS else "other", str(status)).inc()

    def prompt(self, n: int) -> None:
        self.prompt_tokens.inc(n)

    def finished(self, r, arrived: float) -> None:
        """A choice's end (on the scheduler's thread): its tokens and timings."""
        n = len(r.ids)
        self.generation_tokens.inc(n)
        if r.first_token_at is not None:
            self.ttft.observe(max(0.0, r.first_token_at - arrived))
            if n > 1:
                self.tpot.observe((time.perf_counter() - r.first_token_at) / (n - 1))

    def text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
