"""Prometheus metrics on their own HTTP port (``/metrics``), apart from the gRPC port so that scrapers need no gRPC
and the service port can stay private.

Every call is counted by method and status code and timed; a stream is one call, counted when it ends, and each of
its steps (a request and its answer) is timed as it is answered, so that the default decoder mode (StreamNextWords)
has per-step latency; calls refused for the concurrency limit are counted by limit. The tokens each call scored (words and ``</s>``, per
model) show the real work behind a request count, and the words among them scored as <unk> show text in another form
than the model's (a share near 1), which would otherwise pass unseen. Micro-batching (``server.batching``) reports
how many calls wait and how many calls and tokens each batch merged, by kind of work; reloads are counted by outcome,
with the generation of the model set served; the state cache reports its bytes and states and counts what it drops.
The registry belongs to the server, not to the process, so two servers in one process (tests) keep separate numbers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# 1 ms .. 10 s: a decoder step is ~1 ms, a 30-best list ~10-50 ms, a large batch seconds
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_CALL_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "lmserve_requests", "Calls by method and status code", ["method", "code"], registry=self.registry
        )
        self.latency = Histogram(
            "lmserve_request_seconds",
            "Call latency in seconds, from the request's bytes to the response",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "lmserve_tokens_scored", "Tokens scored (words and </s>)", ["method", "model"], registry=self.registry
        )
        self.unknown = Counter(
            "lmserve_unknown_words_scored",
            "Words scored as <unk>, outside the model's vocabulary as the server normalises them (a share of the "
            "tokens scored near 1: text in another form than the model's, such as upper case for a lower-case model)",
            ["method", "model"],
            registry=self.registry,
        )
        self.step_latency = Histogram(
            "lmserve_stream_step_seconds",
            "Latency of one step of a stream (a request to its answer) in seconds",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.refused = Counter(
            "lmserve_calls_refused",
            "Calls refused before any work because the server was full, by the limit (server.max_concurrent_calls)",
            ["limit"],
            registry=self.registry,
        )
        self.in_flight = Gauge("lmserve_requests_in_flight", "Calls being handled", registry=self.registry)
        self.queue_depth = Gauge(
            "lmserve_batch_queue_depth", "Calls waiting to join a batch", ["kind"], registry=self.registry
        )
        self.batch_calls = Histogram(
            "lmserve_batch_calls",
            "Calls merged into one scorer call",
            ["kind"],
            buckets=BATCH_CALL_BUCKETS,
            registry=self.registry,
        )
        self.batch_tokens = Histogram(
            "lmserve_batch_tokens",
            "Tokens (words and </s>) in one scorer call",
            ["kind"],
            buckets=BATCH_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.reloads = Counter(
            "lmserve_reloads", "Model reloads by outcome (ok, failed)", ["outcome"], registry=self.registry
        )
        self.generation = Gauge("lmserve_model_generation", "Version of the model set served", registry=self.registry)
        self.state_cache_bytes = Gauge(
            "lmserve_state_cache_bytes", "Bytes of the decoder states in the state cache", registry=self.registry
        )
        self.state_cache_states = Gauge(
            "lmserve_state_cache_states", "Decoder states in the state cache", registry=self.registry
        )
        self.state_cache_removed = Counter(
            "lmserve_state_cache_removed",
            "States the cache dropped by reason (evicted, expired)",
            ["reason"],
            registry=self.registry,
        )
        self.series: dict[tuple[str, str], tuple] = {}  # observe's: calls and latency by method and code
        self.steps: dict[str, Histogram] = {}  # observe_step's: step latency by method
        self.scored: dict[tuple[str, str | None], tuple] = {}  # and tokens and unknown words by method and model
        self.http = None

    def observe(self, method: str, code: str, seconds: float, model: str | None, tokens: int, unknown: int = 0) -> None:
        """One call's counts (``unknown``: of its ``tokens``, the words scored as <unk>). The labelled series are
        looked up once and kept: ``labels`` checks and converts its values under a lock on every call, which was most
        of this method's time."""
        series = self.series.get((method, code))
        if series is None:
            series = self.series[method, code] = (self.requests.labels(method, code), self.latency.labels(method))
        series[0].inc()
        series[1].observe(seconds)
        self.count_tokens(method, model, tokens, unknown)

    def observe_step(self, method: str, model: str | None, seconds: float, tokens: int, unknown: int = 0) -> None:
        """One step of a stream: its latency, and the tokens it scored (a stream's are counted step by step)."""
        step = self.steps.get(method)
        if step is None:
            step = self.steps[method] = self.step_latency.labels(method)
        step.observe(seconds)
        self.count_tokens(method, model, tokens, unknown)

    def count_tokens(self, method: str, model: str | None, tokens: int, unknown: int) -> None:
        if tokens:
            scored = self.scored.get((method, model))
            if scored is None:
                labels = (method, model or "")
                scored = self.scored[method, model] = (self.tokens.labels(*labels), self.unknown.labels(*labels))
            scored[0].inc(tokens)
            scored[1].inc(unknown)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint (port 0: a free one) in a daemon thread; returns its port."""
        self.http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self.http.server_port

    def stop(self) -> None:
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
