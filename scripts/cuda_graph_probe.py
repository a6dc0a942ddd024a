"""How much faster would the PyTorch backend's calls be as replayed CUDA graphs? One target call
of fixed shape (T new tokens after P committed rows, batch 1) timed eagerly and as a replayed
CUDA graph, and the two outputs compared. On an H200 (2026-11-27) an eager SmolLM2 call took
~30-42 ms, launch-bound (2,403 ATen ops a plain step), and its replay 3.3-3.8 ms, bit-identical
(docs/benchmarks.md#gpu-runs). On a CPU only the eager call runs (capture needs CUDA), so the
script's own code is exercised there too; `BENCH_MIN=2 bash scripts/gpu_train.sh` runs it on a GPU.

    python scripts/cuda_graph_probe.py [--device cuda] [--dtype bfloat16] [--tokens 1,5] [--past 128] [--calls 50]
"""
from __future__ import annotations

import argparse
import time

import torch

from eagle_trt.api import prepare_models
from eagle_trt.devices import add_device_options, resolve_device, resolve_dtype
from eagle_trt.models.target import causal_mask


def make_inputs(model, T: int, P: int, device) -> dict:
    """Static inputs of one call: T new tokens at positions P.., a causal mask over P past rows
    (random finite values: the timing does not depend on them) and logits for the last token."""
    cfg, dtype = model.cfg, model.embed_tokens.weight.dtype
    gen = torch.Generator().manual_seed(0)
    past = lambda: [torch.randn(1, cfg.num_key_value_heads, P, cfg.head_dim, generator=gen).to(device, dtype)  # noqa: E731
                    for _ in range(cfg.num_hidden_layers)]
    return {"input_ids": torch.randint(0, cfg.vocab_size, (1, T), generator=gen).to(device),
            "position_ids": (torch.arange(T) + P)[None].to(device),
            "attention_mask": causal_mask(T, P, device), "past_k": past(), "past_v": past(),
            "logits_index": torch.tensor([T - 1], device=device)}


def timed(fn, calls: int, sync) -> float:
    """Mean milliseconds of fn over `calls` calls, the device synchronized around them."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return 1e3 * (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--tokens", default="1,5", help="comma-separated new tokens per call (1: a plain step; 5: the default tree)")
    p.add_argument("--past", type=int, default=128, help="committed rows before them")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    add_device_options(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = prepare_models(args.target, None, dtype, None, args.device).target.model.eval()
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(f"{args.target} on {device} ({dtype}), {args.past} past rows, batch 1, {args.calls} calls each")
    for T in (int(t) for t in args.tokens.split(",")):
        inputs = make_inputs(model, T, args.past, device)
        with torch.inference_mode():
            eager = lambda: model(**inputs)  # noqa: E731
            reference = eager()
            eager_ms = timed(eager, args.calls, sync)
            if not cuda:
                print(f"  T={T}: eager {eager_ms:.2f} ms a call (CUDA-graph capture needs CUDA)")
                continue
            side = torch.cuda.Stream()             # capture wants its warm-up on a side stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    model(**inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = model(**inputs)
            replay_ms = timed(graph.replay, args.calls, sync)
        same = torch.equal(captured.logits, reference.logits) and torch.equal(captured.captured, reference.captured)
        diff = (captured.logits.float() - reference.logits.float()).abs().max().item()
        print(f"  T={T}: eager {eager_ms:.2f} ms, CUDA-graph replay {replay_ms:.3f} ms a call "
              f"({eager_ms / replay_ms:.1f}x); outputs {'identical' if same else f'differ (max {diff:.3g})'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
