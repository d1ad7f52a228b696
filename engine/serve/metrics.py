"""Prometheus metrics under vLLM's names where the meaning matches, in a registry per server.

Names and types follow vLLM v1 (vllm/v1/metrics/loggers.py, docs/design/metrics.md). Counters are
declared without `_total`; prometheus-client appends it on the wire, exactly as vLLM's are
(`vllm:prompt_tokens_total`, `vllm:prefix_cache_queries_total`). Every series carries vLLM's
`model_name` and `engine` labels, so dashboards built for vLLM select them unchanged.
"""
from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the app

from kvchat.engine.events import FinishReason
from kvchat.engine.serve import batch
from kvchat.engine.serve.protocol import openai_finish

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                160.0)
KV_BYTES_INTERVAL_S = 0.2           # per-layer bytes are summed over every sequence: not on every step


class ServeMetrics:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model_name", "engine")
        values = (model_name, "0")
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage: share of the budget's blocks in use, "
                                                          "1 means 100 percent.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.request_success = Counter("vllm:request_success", "Count of finished requests by finish reason.",
                                       labels + ("finished_reason",), registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(*values)
        # speculative decoding, as vLLM v1 counts it (vllm/v1/spec_decode/metrics.py): verification steps, the draft
        # tokens they checked, those accepted, and the accepted ones by their place among the drafts (0 first)
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", labels + ("position",), registry=r)
        # the preemption tier (engine/kv/tier.py): requests resumed from it, those read again, what it holds
        self.resumed_total = counter("kvchat_preemptions_resumed", "Preempted requests whose cache was read back from "
                                     "the second tier (no prompt pass).")
        self.resumed_tokens = counter("kvchat_preemption_resumed_tokens", "Tokens preempted requests got back from "
                                      "the second tier instead of reading them again.")
        self.recomputed_total = counter("kvchat_preemptions_recomputed", "Preempted requests read again (the tier "
                                        "was off, full, or its copy could not be used).")
        self.tier_requests = gauge("kvchat_preemption_tier_requests", "Preempted requests whose cache the tier holds.")
        self.tier_bytes = gauge("kvchat_preemption_tier_bytes", "Bytes the preemption tier holds (host memory "
                                "beside a GPU pool, files beside a host pool).")
        self.kv_bytes = Gauge("kvchat_kv_bytes", "KV cache bytes held, by layer, component (k or v) and format.",
                              ("model_name", "layer", "component", "format"), registry=r)
        self.seq_bytes = Gauge("kvchat_sequence_kv_bytes", "KV cache bytes held by one sequence: a running request "
                               "(its id) or a conversation of the app sharing the engine (seq-N).",
                               ("model_name", "sequence"), registry=r)
        self._seq_labels: set[str] = set()
        self._model_name = model_name
        self._prefix_seen = (0, 0)
        self._kv_at = 0.0
        self._kv_keys: set[tuple] = set()
        self._lock = threading.Lock()

    # ---- from the engine thread ----------------------------------------------------------

    def first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def generated(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def speculated(self, drafted: int, accepted: int) -> None:
        """One verification step: `drafted` draft tokens checked, the first `accepted` of them kept."""
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(drafted)
        self.spec_accepted.inc(accepted)
        for pos in range(accepted):
            self.spec_per_pos.labels(self._model_name, "0", str(pos)).inc()

    def finished(self, reason: FinishReason) -> None:
        self.request_success.labels(self._model_name, "0", openai_finish(reason)).inc()

    def preempted(self) -> None:
        self.preemptions.inc()

    def resumed(self, tokens: int) -> None:
        self.resumed_total.inc()
        self.resumed_tokens.inc(tokens)

    def recomputed(self) -> None:
        self.recomputed_total.inc()

    def scheduler_state(self, num_running: int, num_waiting: int, usage: float,
                        names: dict[int, str] | None = None, tier: tuple[int, int] = (0, 0)) -> None:
        """names: sequence id -> request id of the running requests (other sequences show as seq-N); tier: (requests,
        bytes) the preemption tier holds."""
        self.running.set(num_running)
        self.tier_requests.set(tier[0])
        self.tier_bytes.set(tier[1])
        self.waiting.set(num_waiting)
        self.kv_usage.set(usage)
        queries, hits = batch.prefix_cache_counts(self.engine)
        seen_q, seen_h = self._prefix_seen
        if queries > seen_q or hits > seen_h:
            self.prefix_queries.inc(queries - seen_q)
            self.prefix_hits.inc(hits - seen_h)
            self._prefix_seen = (queries, hits)
        now = time.monotonic()
        if now - self._kv_at >= KV_BYTES_INTERVAL_S or num_running == 0:
            self._kv_at = now
            self.update_kv_bytes(names or {})

    def update_kv_bytes(self, names: dict[int, str] | None = None) -> None:
        rows = batch.kv_bytes_by_layer(self.engine)
        per_seq = {(names or {}).get(i, f"seq-{i}"): b for i, b in batch.bytes_by_sequence(self.engine).items()}
        with self._lock:
            for name, nbytes in per_seq.items():
                self.seq_bytes.labels(self._model_name, name).set(nbytes)
            for name in self._seq_labels - per_seq.keys():       # finished: the series goes away
                self.seq_bytes.remove(self._model_name, name)
            self._seq_labels = set(per_seq)
            keys = set()
            for layer, comp, fmt, nbytes in rows:
                key = (self._model_name, str(layer), comp, fmt)
                keys.add(key)
                self.kv_bytes.labels(*key).set(nbytes)
            for key in self._kv_keys - keys:       # a format no sequence holds any more reads 0
                self.kv_bytes.labels(*key).set(0)
            self._kv_keys |= keys

    # ---- from the HTTP thread --------------------------------------------------------------

    def exposition(self) -> bytes:
        with self._lock:
            return generate_latest(self.registry)
