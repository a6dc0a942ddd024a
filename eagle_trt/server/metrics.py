"""The OpenAI front end's Prometheus metrics (`GET /metrics`), written in the text exposition
format by hand: a few counters, two gauges and three histograms do not need prometheus_client.

Everything is updated from the event loop's one thread (no locks), by `triton_stream.Generation`."""
from __future__ import annotations

import math

# Tokens one decoding iteration gave one sequence: 1 (no draft accepted) up to the tree's depth + 1.
ACCEPTED_BUCKETS = tuple(range(1, 17))
# Seconds: time to first token is prefill plus any wait for a batch slot; inter-token latency is
# one iteration's time over the tokens it gave, milliseconds on a GPU, tens of them on a CPU.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0)


def _number(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    return repr(int(v)) if float(v).is_integer() else repr(float(v))


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple):
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)     # the last one: +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += times
        self.sum += value * times
        self.count += times

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip(self.buckets + (math.inf,), self.counts):
            total += n
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {total}')
        return lines + [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {self.count}"]


class Metrics:
    """Counters, gauges and histograms of the requests the front end sends to Triton."""

    FINISH = ("stop", "length", "cancelled", "error")

    def __init__(self):
        self.requests = dict.fromkeys(self.FINISH, 0)    # by how they ended
        self.prompt_tokens = self.generation_tokens = 0
        self.running = self.waiting = 0
        self.accepted = Histogram("eagle_trt_accepted_tokens_per_iteration",
                                  "Tokens one decoding iteration gave one sequence (1: no draft token accepted).",
                                  ACCEPTED_BUCKETS)
        self.ttft = Histogram("eagle_trt_time_to_first_token_seconds",
                              "Seconds from sending a request to Triton to its first token.", TTFT_BUCKETS)
        self.itl = Histogram("eagle_trt_inter_token_latency_seconds",
                             "Seconds between two responses of one request over the tokens the later one gave, "
                             "observed once per token.", ITL_BUCKETS)

    # --- one request's life: submitted (waiting), first token (running), finished
    def submitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.waiting += 1

    def first_token(self, seconds: float) -> None:
        self.waiting -= 1
        self.running += 1
        self.ttft.observe(seconds)

    def tokens(self, n: int, accepted: int | None, seconds_since_last: float | None) -> None:
        self.generation_tokens += n
        if accepted:   # 0 on the first response: its token came from the prefill
            self.accepted.observe(accepted)
        if seconds_since_last is not None and n > 0:
            self.itl.observe(seconds_since_last / n, times=n)

    def finished(self, reason: str, started: bool) -> None:
        self.requests[reason] += 1
        if started:
            self.running -= 1
        else:
            self.waiting -= 1

    def render(self) -> str:
        lines = ["# HELP eagle_trt_requests_total Requests sent to Triton that ended, by how they ended.",
                 "# TYPE eagle_trt_requests_total counter"]
        lines += [f'eagle_trt_requests_total{{finish_reason="{r}"}} {n}' for r, n in self.requests.items()]
        for name, kind, value, help in (
                ("eagle_trt_prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens sent to Triton."),
                ("eagle_trt_generation_tokens_total", "counter", self.generation_tokens,
                 "Tokens Triton generated (received by the front end)."),
                ("eagle_trt_requests_running", "gauge", self.running,
                 "Requests that have their first token and have not finished."),
                ("eagle_trt_requests_waiting", "gauge", self.waiting,
                 "Requests sent to Triton without a token yet (waiting for a batch slot, or in prefill).")):
            lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {value}"]
        for h in (self.accepted, self.ttft, self.itl):
            lines += h.render()
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """The samples of a text exposition: 'name{labels}' -> value (tests, scripts/openai_load.py)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
