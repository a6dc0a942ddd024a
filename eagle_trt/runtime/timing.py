"""How decoding is timed, in one place: every entry point that prints a speed (`make demo`,
`python -m eagle_trt.bench`, `bench --concurrency`) builds its sessions and runs its decoding
loops through here, so their ratios compare the same things under the same settings.

- Baseline: plain autoregressive decoding on the same target graph, in its fastest setting: a
  session of its own whose worker threads spin between calls (it runs one call after another).
  Speculative decoding alternates two sessions (drafter, target), whose workers spin only
  inside a call (make_session's spin="in-call"): spinning between calls took the cores from
  the other session.
- Host work: the loops' tensor ops (argmax, sampling, masks) run on one PyTorch thread. At the
  default thread count, PyTorch's OpenMP workers spin after each small op and take the cores
  from ONNX Runtime's threads: that slowed plain decoding by a third in a process that had not
  set threads, and speculative decoding hardly at all, so a demo that forgot it printed 1.48x
  where the honest ratio was 1.09x. `decoding_threads()` is entered around every timed loop,
  whatever the process set before.
- Both are warmed up on a prompt that is not measured (first-call allocations stay out).
- Each prompt is decoded `repeats` times in each mode, the modes alternating, and each mode's
  fastest run counts (`OrtDecoding.compare`): this machine has slow spells of a few seconds
  (the autoregressive step of one bench run took 19.7 ms against 15.4 in the next), and one
  landing on one mode's only run moved a ratio by up to 20%."""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from ..config import SamplingConfig, TreeShape
from .loop import DecodingLoop, GenerationResult
from .onnxruntime_backend import OrtDrafter, OrtIteration, OrtTarget
from .ort_engines import OrtBackends, open_backends
from .two_call import TwoCallEngine

HOST_THREADS = 1


def ort_threads(threads: int | None = None) -> int:
    """ONNX Runtime intra-op threads of every timed session: the count asked for, else one per
    CPU, set explicitly. Left to ONNX Runtime's own default, the plain-decoding session ran at
    52.6 tok/s where 2 explicit threads gave 62.4 (AVX-512 EPYC, 2 cores, 4 MT-bench prompts)
    while speculative decoding did not move: `make demo` and a `bench` run without --threads
    printed 1.34-1.36x where the honest ratio was 1.13-1.16x."""
    return threads or os.cpu_count() or 1


def graph_seconds(*backends) -> float | None:
    """Seconds the backends spent inside graph calls so far (None: a backend does not count
    them); wall time minus this is host work."""
    if not all(hasattr(b, "graph_seconds") for b in backends if b is not None):
        return None
    return sum(b.graph_seconds for b in backends if b is not None)


@contextmanager
def decoding_threads():
    """PyTorch at HOST_THREADS threads for the loop inside; the previous setting after it."""
    old = torch.get_num_threads()
    torch.set_num_threads(HOST_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class Compared(NamedTuple):
    """One prompt in both modes: each mode's fastest run, and where that speculative run's graph
    time went: seconds inside each session's calls, by role (OrtDecoding.sessions)."""
    speculative: GenerationResult
    autoregressive: GenerationResult
    graph_seconds: dict[str, float]


@dataclass
class OrtDecoding:
    """Speculative and plain decoding on the same ONNX graphs, each in its fastest session setting."""
    backends: OrtBackends      # the speculative loop's: verification spins only inside a call (alternates with the drafter)
    plain: OrtTarget           # the baseline's own session of the same target graph, spinning
    decoder: DecodingLoop      # speculative, on `backends`
    plain_decoder: DecodingLoop
    eos: set[int]

    @classmethod
    def open(cls, graphs: dict[str, str | Path], shape: TreeShape, max_context: int, eos: set[int], vocab_size: int,
             threads: int | None = None, target: OrtTarget | None = None,
             precision: dict[str, str] | None = None) -> OrtDecoding:
        """graphs: 'target', 'drafter_tree' and optionally 'iteration' (the two composed,
        export/iteration.py: each speculative iteration is then one call of it, the drafter graph
        still catching up on prompts)."""
        threads = ort_threads(threads)
        backends = open_backends(graphs, shape, max_context, threads=threads, target=target, precision=precision)
        plain = open_backends({"target": graphs["target"]}, None, max_context, threads=threads, spin="always",
                              precision=precision).target
        decoder = DecodingLoop(backends.engine(), eos, vocab_size)
        return cls(backends, plain, decoder, DecodingLoop(TwoCallEngine(plain), eos, vocab_size), eos)

    @property
    def sessions(self) -> dict[str, OrtTarget | OrtDrafter | OrtIteration]:
        """The speculative loop's sessions by role (the keys of Compared.graph_seconds)."""
        return {role: s for role, s in zip(("target_graph", "drafter_graph", "iteration_graph"), self.backends)
                if s is not None}

    def warm_up(self, ids: list[int], tokens: int = 8) -> None:
        with decoding_threads():
            self.decoder.generate(ids, tokens)
            self.plain_decoder.generate(ids, tokens)

    def speculative(self, ids: list[int], max_new_tokens: int, sampling: SamplingConfig | None = None):
        with decoding_threads():
            return self.decoder.generate(ids, max_new_tokens, sampling)

    def autoregressive(self, ids: list[int], max_new_tokens: int, sampling: SamplingConfig | None = None):
        with decoding_threads():
            return self.plain_decoder.generate(ids, max_new_tokens, sampling)

    def compare(self, ids: list[int], max_new_tokens: int, repeats: int = 2,
                sampling: SamplingConfig | None = None) -> Compared:
        """Both modes `repeats` times, alternating which goes first; each mode's fastest run
        (sampled: every run of a mode draws with the same seed, so the runs decode the same tokens)."""
        best: dict[str, tuple] = {}
        for r in range(repeats):
            for mode in (("autoregressive", "speculative") if r % 2 == 0 else ("speculative", "autoregressive")):
                before = {role: s.graph_seconds for role, s in self.sessions.items()}
                run = getattr(self, mode)(ids, max_new_tokens, sampling)
                split = {role: s.graph_seconds - before[role] for role, s in self.sessions.items()}
                if mode not in best or run.seconds < best[mode][0].seconds:
                    best[mode] = (run, split)
        spec, split = best["speculative"]
        return Compared(spec, best["autoregressive"][0], split)


__all__ = ["HOST_THREADS", "Compared", "OrtDecoding", "decoding_threads", "graph_seconds", "ort_threads"]
