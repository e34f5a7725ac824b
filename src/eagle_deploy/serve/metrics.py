"""Prometheus metrics of eagle-serve (`GET /metrics`), in a registry of their own per app.

    eagle_serve_requests_total{endpoint, outcome}     outcome: ok | invalid | rejected | error | cancelled | timeout
    eagle_serve_prompt_tokens_total                   prompt tokens of finished requests
    eagle_serve_completion_tokens_total               tokens delivered by finished requests
    eagle_serve_acceptance_length{mode}               histogram of tau per request (tokens per target forward)
    eagle_serve_verification_rounds_total{mode}       target verification forwards of finished requests, drafted
                                                      or not: vllm:spec_decode_num_drafts_total over its
                                                      {mode="eagle"} is the share of rounds that drafted (a
                                                      cost-aware drafter skips drafting where it does not pay)
    eagle_serve_time_to_first_token_seconds           histogram, from arrival (queue wait included)
    eagle_serve_time_per_output_token_seconds         histogram, (last - first token time) / (tokens - 1)
    eagle_serve_queue_length                          gauge: requests waiting for a slot
    eagle_serve_active_requests                       gauge: requests being decoded
    eagle_serve_slots                                 gauge: requests decoded at once (--slots)
    eagle_serve_batched_forwards                      gauge: forwards run for 2+ slots at once, since start
    eagle_serve_solo_forwards                         gauge: batched forwards run for one slot alone
                                                      (prefills, a lone busy slot); both 0 with --slots 1
    eagle_serve_prefill_chunks                        gauge: of those, chunks of a chunked prefill (--prefill-chunk)
    eagle_serve_prefix_cache_hits_total               finished requests whose prompt reused prefix-cache KV
    eagle_serve_prefix_cache_cached_tokens_total      prompt tokens read from the prefix cache (their
                                                      usage.prompt_tokens_details.cached_tokens summed)
    eagle_serve_prefix_cache_bytes                    gauge: bytes the prefix cache holds (--prefix-cache-mb)

and vLLM's speculative-decoding counters, named and labelled as vLLM names them (labels
model_name, engine = "0": vLLM's label names, kept so its dashboards read them), from each
finished request's `Stats` (see `SpecCounts`):

    vllm:spec_decode_num_drafts_total                 rounds that verified at least one draft token
    vllm:spec_decode_num_draft_tokens_total           draft positions proposed (tree depth per round)
    vllm:spec_decode_num_accepted_tokens_total        draft tokens accepted (committed - 1 per round)
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position}   rounds that accepted position p (0-based)
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from eagle_deploy.runtime.acceptance import SpecCounts

TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 17.0)  # 17: a 16-token lookup chain
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0, 10.0, 30.0)


class ServeMetrics:
    """The metrics of one server. queue_length / active_requests are read from `scheduler`
    at scrape time (pass it to `bind`)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = ""):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("eagle_serve_requests", "Requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("eagle_serve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("eagle_serve_completion_tokens", "Completion tokens delivered", registry=r)
        self.tau = Histogram("eagle_serve_acceptance_length", "tau per request: tokens committed per target "
                             "verification forward (bonus included)", ["mode"], buckets=TAU_BUCKETS, registry=r)
        self.rounds = Counter("eagle_serve_verification_rounds", "Target verification forwards of finished "
                              "requests, drafted or not", ["mode"], registry=r)
        self.ttft = Histogram("eagle_serve_time_to_first_token_seconds", "Time to first token, queue wait included",
                              buckets=TIME_BUCKETS, registry=r)
        self.tpot = Histogram("eagle_serve_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=TIME_BUCKETS, registry=r)
        self.queue_length = Gauge("eagle_serve_queue_length", "Requests waiting for a slot", registry=r)
        self.active = Gauge("eagle_serve_active_requests", "Requests being decoded", registry=r)
        self.slots = Gauge("eagle_serve_slots", "Requests decoded at once (--slots)", registry=r)
        self.batched = Gauge("eagle_serve_batched_forwards", "Forwards run for two or more slots at once",
                             registry=r)
        self.solo = Gauge("eagle_serve_solo_forwards", "Forwards run for one slot alone", registry=r)
        self.chunks = Gauge("eagle_serve_prefill_chunks", "Prefill chunks run between other slots' forwards",
                            registry=r)
        self.cache_hits = Counter("eagle_serve_prefix_cache_hits", "Finished requests whose prompt reused "
                                  "prefix-cache KV", registry=r)
        self.cached_tokens = Counter("eagle_serve_prefix_cache_cached_tokens", "Prompt tokens read from the prefix "
                                     "cache", registry=r)
        self.cache_bytes = Gauge("eagle_serve_prefix_cache_bytes", "Bytes the prefix cache holds", registry=r)
        vllm = ["model_name", "engine"]
        self.spec_labels = (model_name, "0")
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", vllm, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", vllm,
                                         registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", vllm,
                                     registry=r)
        self.spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", [*vllm, "position"], registry=r)
        for mode in ("eagle", "vanilla"):
            self.rounds.labels(mode)  # exported as 0 from the start
        for c in (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted):
            c.labels(*self.spec_labels)  # exported as 0 from the start

    def bind(self, scheduler) -> None:
        self.queue_length.set_function(lambda: scheduler.queued)
        self.active.set_function(lambda: scheduler.active)
        self.slots.set_function(lambda: scheduler.batching["slots"])
        self.batched.set_function(lambda: scheduler.batching["batched_forwards"])
        self.solo.set_function(lambda: scheduler.batching["solo_forwards"])
        self.chunks.set_function(lambda: scheduler.batching["prefill_chunks"])
        self.cache_bytes.set_function(lambda: cache.nbytes if (cache := scheduler.prefix_cache) is not None else 0)

    def finished(self, endpoint: str, job, result) -> None:
        """Record a request that ran to its end (`job`: scheduler.Job, `result`: GenerationResult)."""
        s = result.stats
        self.requests.labels(endpoint, "ok").inc()
        self.prompt_tokens.inc(s.prompt_tokens)
        self.completion_tokens.inc(len(result.token_ids))
        if s.cached_tokens:
            self.cache_hits.inc()
            self.cached_tokens.inc(s.cached_tokens)
        if s.rounds:
            self.tau.labels(s.mode).observe(s.mean_accept_len)
            self.rounds.labels(s.mode).inc(s.rounds)
        first = job.t_first if job.t_first is not None else job.t_done
        if first is not None:
            self.ttft.observe(first - job.t_submit)
        n = len(result.token_ids)
        if n > 1 and job.t_first is not None and job.t_done is not None:
            self.tpot.observe((job.t_done - job.t_first) / (n - 1))
        self.speculative(SpecCounts.from_stats(s))

    def speculative(self, spec: SpecCounts) -> None:
        self.spec_drafts.labels(*self.spec_labels).inc(spec.drafts)
        self.spec_draft_tokens.labels(*self.spec_labels).inc(spec.draft_tokens)
        self.spec_accepted.labels(*self.spec_labels).inc(spec.accepted_tokens)
        for pos, count in enumerate(spec.accepted_per_pos):
            self.spec_per_pos.labels(*self.spec_labels, str(pos)).inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
