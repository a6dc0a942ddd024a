"""Which prefill chunk should the Triton model use (serving.prefill_chunk)? Runs the decoding loop
the model runs (the repository's graphs and settings, in-process, no server) on 16 requests
submitted at once, chat prompts of 30 to 1,000 tokens (workload `mixed`), greedy, at each chunk
size, and prints time to first token, inter-token latency and tokens/s, measured in one run.

    python scripts/prefill_chunk.py --repository artifacts/smollm2-eagle3.1/triton --chunks 0,64,128,256,512

0: every prompt prefilled whole as it joins (a join stalls every running stream for its whole
prompt). Every chunk size must give each request the tokens it gives prefilled whole (checked)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path



def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoTokenizer

    from eagle_trt.build.triton import served_graphs
    from eagle_trt.concurrency import percentile
    from eagle_trt.config import TreeShape
    from eagle_trt.runtime.cost import CostModel
    from eagle_trt.runtime.loop import DecodingLoop, Request
    from eagle_trt.runtime.ort_engines import open_backends
    from eagle_trt.workloads import build
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", required=True, help="a Triton repository written by python -m eagle_trt.build")
    p.add_argument("--model", default="eagle_trt")
    p.add_argument("--chunks", default="0,64,128,256,512")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = Path(args.repository) / args.model / "1"
    s = json.loads((folder / "eagle.json").read_text())
    if s["backend"] != "onnxruntime":
        print(f"error: {folder}: backend {s['backend']}; this measures the onnxruntime runtime", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"), local_files_only=True)
    prompts = build(tokenizer, "mixed", args.requests)
    shape = TreeShape(*s["tree"])
    backends = open_backends(served_graphs(Path(args.repository), args.model), shape, s["max_context"],
                             threads=args.threads, precision=s["precision"])

    def run(chunk: int, prompts: list[list[int]]):
        engine = backends.engine(CostModel(shape.total_tokens, shape.top_k * (shape.depth - 1)))
        loop = DecodingLoop(engine, s["eos_ids"], s["vocab_size"], prefill_chunk=chunk or None)
        start = time.perf_counter()
        results = loop.generate_batch([Request(p, args.max_tokens) for p in prompts], max_batch=len(prompts))
        return results, time.perf_counter() - start

    # warm-up, as a server that has been running: ONNX Runtime plans each new call shape once, and
    # a cold first pass over these prompts ran at half the speed of the passes after it
    run(0, prompts)
    run(128, prompts)
    rows, reference = [], None
    print(f"{args.requests} requests at once, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_tokens} new tokens each, greedy, {args.threads} threads, {args.repository}")
    for chunk in [int(c) for c in args.chunks.split(",")]:
        results, seconds = run(chunk, prompts)
        tokens = [r.tokens for r in results]
        reference = reference or tokens
        ttft = [r.token_times[0] for r in results]
        itl = [(r.token_times[-1] - r.token_times[0]) / (len(r.tokens) - 1) for r in results if len(r.tokens) > 1]
        row = {"chunk": chunk, "tok_s": sum(map(len, tokens)) / seconds, "ttft_p50": percentile(ttft, 50),
               "ttft_p99": percentile(ttft, 99), "itl_p50": statistics.median(itl), "itl_p99": percentile(itl, 99),
               "same": sum(a == b for a, b in zip(tokens, reference))}
        rows.append(row)
        print(f"chunk {chunk or 'whole':>5}: {row['tok_s']:6.1f} tok/s  TTFT p50 {row['ttft_p50']:5.2f} s "
              f"p99 {row['ttft_p99']:5.2f} s (x{row['ttft_p99'] / row['ttft_p50']:.2f})  per-token latency p50 "
              f"{1e3 * row['itl_p50']:5.0f} ms p99 {1e3 * row['itl_p99']:5.0f} ms  same tokens {row['same']}/{len(tokens)}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["same"] == len(prompts) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
