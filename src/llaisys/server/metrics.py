"""Prometheus metrics under vLLM's names, in a registry of the app's own.

Per-request figures (time to first token, inter-token latency, end-to-end latency, queue time,
tokens, finish reasons) and the engine's step time (``llaisys:engine_step_seconds``) are
recorded by ``on_step``, which the engine thread calls after every step with that step's
outputs and seconds; an abort, which yields no step output, is recorded by
``aborted``, also run on the engine thread. Gauges and the prefix-cache, preemption and
speculative-decoding counters are refreshed from ``LLMEngine.stats()`` when /metrics is scraped
(``refresh``), so they are current even while the engine is idle.

Names follow vLLM V1 (``vllm:kv_cache_usage_perc``, vLLM's current name for the pool usage,
which replaced ``vllm:gpu_cache_usage_perc``; ``vllm:inter_token_latency_seconds``, which
replaced ``vllm:time_per_output_token_seconds``), each with a ``model_name`` label.
Counters are exposed with prometheus' ``_total`` suffix (``vllm:prompt_tokens_total``).
Speculative decoding has vLLM's counters too: ``vllm:spec_decode_num_drafts``,
``vllm:spec_decode_num_draft_tokens`` and ``vllm:spec_decode_num_accepted_tokens``; the
acceptance rate is accepted / draft tokens, the mean tokens a draft saves accepted / drafts.
"""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine import EngineStats, RequestOutput

log = logging.getLogger(__name__)

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
FINISH_REASONS = ("stop", "length", "abort")


class MetricFamilies:
    """Every metric family, in one registry shared by the models of a server: each model's
    ``Metrics`` writes its own ``model_name`` label of them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted (to be recomputed).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of the requests that started.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.drafts = counter("vllm:spec_decode_num_drafts", "Speculative drafts checked.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Speculative draft tokens run.")
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                       "Speculative draft tokens accepted (acceptance rate: these over the draft "
                                       "tokens).")
        self.success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between two tokens of a request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.request_generation = histogram("vllm:request_generation_tokens", "Tokens generated per request.",
                                            TOKEN_BUCKETS)
        # ours (vLLM has no such metrics): the engine's own step time, to compare with in-process runs,
        # the prefix cache's tiers, and the models' loading and unloading
        self.step = histogram("llaisys:engine_step_seconds", "Wall time of one engine step (forward pass, sampling, "
                              "detokenizing), measured on the engine thread.", STEP_BUCKETS)
        self.prefix_host_hits = counter("llaisys:prefix_cache_host_hits", "Prompt tokens restored from the prefix "
                                        "cache's host-memory tier.")
        self.prefix_disk_hits = counter("llaisys:prefix_cache_disk_hits", "Prompt tokens restored from the prefix "
                                        "cache's directory (--prefix-cache-dir).")
        self.model_loaded = gauge("llaisys:model_loaded", "1 while the model is loaded, else 0.")
        self.model_memory = gauge("llaisys:model_memory_bytes", "Memory the loaded model holds: weights and KV pools.")
        self.model_loads = counter("llaisys:model_loads", "Times the model was loaded.")
        self.model_load_failures = counter("llaisys:model_load_failures", "Loads of the model that failed.")
        self.model_unloads = counter("llaisys:model_unloads", "Times the model was unloaded (evicted, idle, asked).")

    def render(self) -> bytes:
        """The text exposition of every metric (every model's, when the families are shared)."""
        return generate_latest(self.registry)


class Metrics:
    """The server's metrics for one model: its label of ``families`` (its own when None)."""

    def __init__(self, model_name: str, families: MetricFamilies | None = None) -> None:
        self.families = families or MetricFamilies()
        self.registry = self.families.registry
        f = self.families
        for name in ("running", "waiting", "kv_usage", "prefix_queries", "prefix_hits", "preemptions",
                     "prompt_tokens", "generation_tokens", "drafts", "draft_tokens", "accepted_tokens", "ttft", "itl",
                     "e2e", "queue", "request_prompt", "request_generation", "step", "prefix_host_hits",
                     "prefix_disk_hits", "model_loaded", "model_memory", "model_loads", "model_load_failures",
                     "model_unloads"):
            setattr(self, name, getattr(f, name).labels(model_name))
        self.success = {reason: f.success.labels(model_name, reason) for reason in FINISH_REASONS}
        # engine-thread state: requests not yet finished, and each one's last token time
        self._live: set[str] = set()
        self._last_token: dict[str, float] = {}
        self._seen = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0)

    # ---- request lifecycle ------------------------------------------------------------
    def submitted(self, request_id: str) -> None:
        """A request is about to be added to the engine (any thread; before it can finish)."""
        self._live.add(request_id)

    def on_step(self, outputs: list[RequestOutput], step_s: float | None = None) -> None:
        """Record one engine step's outputs and its wall time in seconds (engine thread). Never
        raises: a metrics bug must not stop the engine."""
        try:
            if step_s is not None:
                self.step.observe(step_s)
            for out in outputs:
                self._record(out)
        except Exception:  # noqa: BLE001
            log.exception("recording metrics failed")

    def _record(self, out: RequestOutput) -> None:
        rid, t = out.request_id, out.times
        if out.token_ids:
            last = self._last_token.get(rid)
            if last is None:  # the request's first token
                self.ttft.observe(t.ttft_s)
                self.queue.observe(t.queue_s)
                self.prompt_tokens.inc(out.prompt_tokens)
                self.request_prompt.observe(out.prompt_tokens)
            else:
                self.itl.observe(max(t.last_token - last, 0.0))
            self._last_token[rid] = t.last_token
            self.generation_tokens.inc(len(out.token_ids))
        if out.finished:
            self._last_token.pop(rid, None)
            if rid in self._live:
                self._live.discard(rid)
                self.success[out.finish_reason or "stop"].inc()
                self.e2e.observe(t.e2e_s)
                self.request_generation.observe(out.completion_tokens)

    def aborted(self, request_id: str) -> None:
        """Record that a request was aborted, unless it had finished first (engine thread, after
        the abort ran)."""
        self._last_token.pop(request_id, None)
        if request_id in self._live:
            self._live.discard(request_id)
            self.success["abort"].inc()

    def discard(self, request_id: str) -> None:
        """Forget a request the engine refused."""
        self._live.discard(request_id)

    # ---- scraping ----------------------------------------------------------------------
    def refresh(self, stats: EngineStats) -> None:
        """Set the gauges and advance the counters from ``stats`` (snapshots older than the last
        one seen, from overlapping scrapes, are ignored)."""
        if stats.steps < self._seen.steps:
            return
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)
        seen = self._seen
        self.prefix_queries.inc(max(stats.prefix_queries - seen.prefix_queries, 0))
        self.prefix_hits.inc(max(stats.prefix_hits - seen.prefix_hits, 0))
        self.preemptions.inc(max(stats.preemptions - seen.preemptions, 0))
        self.drafts.inc(max(stats.drafts - seen.drafts, 0))
        self.draft_tokens.inc(max(stats.drafted_tokens - seen.drafted_tokens, 0))
        self.accepted_tokens.inc(max(stats.accepted_tokens - seen.accepted_tokens, 0))
        self.prefix_host_hits.inc(max(stats.prefix_restored_host - seen.prefix_restored_host, 0))
        self.prefix_disk_hits.inc(max(stats.prefix_restored_disk - seen.prefix_restored_disk, 0))
        self._seen = stats

    # ---- the model's life --------------------------------------------------------------
    def loaded(self, memory_bytes: int) -> None:
        """The model is loaded and holds ``memory_bytes``."""
        self.model_loaded.set(1)
        self.model_memory.set(memory_bytes)
        self.model_loads.inc()

    def load_failed(self) -> None:
        """A load of the model failed."""
        self.model_load_failures.inc()

    def unloaded(self) -> None:
        """The model was unloaded; its engine's counters start again from 0 when it is loaded again."""
        self.model_loaded.set(0)
        self.model_memory.set(0)
        self.model_unloads.inc()
        self._seen = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0)

    def render(self) -> bytes:
        """The text exposition of every metric (every model's, when the families are shared)."""
        return generate_latest(self.registry)
