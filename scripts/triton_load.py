"""How does a built Triton repository hold up under concurrent streams? Loads it with concurrent
streaming clients and prints throughput and time to first token against a single stream,
measured in one run on this machine.

    python scripts/triton_load.py --repository artifacts/smollm2-eagle3.1/triton --streams 16

Phase 1: the same requests one at a time on one stream (the single-stream baseline).
Phase 2: all of them at once, one gRPC stream each (the model batches up to
serving.max_concurrent; the rest wait for a slot). Prompts (--workload): MT-bench first turns, or
`mixed`, chat turns of 30 to 1,000 tokens (eagle_trt.workloads); chat template on, each with
--max-tokens (greedy). Also checks that every phase-2 stream equals its phase-1 tokens, and
times the refusal of a malformed request (max_tokens 0) sent one second into phase 2, while
requests wait for a slot: validation must not wait for one."""
from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
import time

import numpy as np


def stream_once(url: str, model: str, prompt: str, max_tokens: int) -> tuple[list[int], float, float]:
    """One streamed request: (tokens, seconds to the first token, seconds to the final flag); a
    refused request raises RuntimeError."""
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = []
    for name, value, dtype in (("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
                               ("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32")):
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        inputs.append(t)
    start = time.perf_counter()
    client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    tokens, first = [], None
    try:
        while True:
            result, error = results.get(timeout=600)
            if error is not None:
                raise RuntimeError(f"request failed: {error}")
            if result.get_response().parameters["triton_final_response"].bool_param:
                return tokens, first, time.perf_counter() - start
            first = first if first is not None else time.perf_counter() - start
            tokens += result.as_numpy("token_ids").tolist()
    finally:
        client.stop_stream()
        client.close()



def load_arguments(p: argparse.ArgumentParser, argv: list[str] | None, workload: str):
    """The load runs' common options parsed, and their prompts (user turns) built with the
    tokenizer the repository's model serves with."""
    from transformers import AutoTokenizer

    from eagle_trt.workloads import serving_texts
    p.add_argument("--repository", required=True)
    p.add_argument("--model", default="eagle_trt")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--workload", choices=("mtbench", "mixed"), default=workload)
    args = p.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(f"{args.repository}/{args.model}/1/tokenizer", local_files_only=True)
    return args, serving_texts(tokenizer, args.workload, args.streams)


def main(argv: list[str] | None = None) -> int:
    from eagle_trt.build.local_triton import LocalTriton, TritonUnavailable
    from eagle_trt.concurrency import percentile
    args, prompts = load_arguments(argparse.ArgumentParser(description=__doc__,
                                                           formatter_class=argparse.RawDescriptionHelpFormatter),
                                   argv, workload="mtbench")
    try:
        server = LocalTriton(args.repository)
        server.__enter__()
    except (TritonUnavailable, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        stream_once(server.grpc_url, args.model, prompts[0], 4)   # warm-up: first-call allocations
        start, solo = time.perf_counter(), []
        for prompt in prompts:
            solo.append(stream_once(server.grpc_url, args.model, prompt, args.max_tokens))
        solo_s = time.perf_counter() - start
        together: list = [None] * len(prompts)

        def one(i):
            together[i] = stream_once(server.grpc_url, args.model, prompts[i], args.max_tokens)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        start = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(1.0)
        refused = time.perf_counter()
        try:
            stream_once(server.grpc_url, args.model, prompts[0], 0)
            refusal = None
        except RuntimeError:
            refusal = time.perf_counter() - refused
        for t in threads:
            t.join()
        load_s = time.perf_counter() - start
    finally:
        server.__exit__(None, None, None)
    solo_rate = sum(len(t) for t, _, _ in solo) / solo_s
    load_rate = sum(len(t) for t, _, _ in together) / load_s
    same = sum(a[0] == b[0] for a, b in zip(solo, together))
    ttft_solo = [f for _, f, _ in solo]
    ttft_load = [f for _, f, _ in together]
    print(f"{len(prompts)} {args.workload} requests x {args.max_tokens} tokens, greedy, {args.repository}")
    print(f"one stream:        {solo_rate:7.1f} tok/s   TTFT p50 {1e3 * statistics.median(ttft_solo):6.0f} ms")
    print(f"{len(prompts):2d} streams at once: {load_rate:7.1f} tok/s   TTFT p50 {1e3 * percentile(ttft_load, 50):6.0f} ms, "
          f"p99 {1e3 * percentile(ttft_load, 99):6.0f} ms   ({load_rate / solo_rate:.2f}x one stream)")
    print(f"streams identical to their one-at-a-time output: {same}/{len(prompts)}")
    print("malformed request under load: " + (f"refused in {1e3 * refusal:.0f} ms" if refusal is not None
                                               else "NOT refused"))
    return 0 if same == len(prompts) and refusal is not None else 1


if __name__ == "__main__":
    sys.exit(main())
