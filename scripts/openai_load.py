"""How does a built repository hold up under concurrent streams through the OpenAI endpoint? The
twin of scripts/triton_load.py one layer up: starts tritonserver and the front end of
`python -m eagle_trt.serve` on the repository, then streams chat completions with the `openai`
client and prints throughput, time to first token and inter-token latency.

    python scripts/openai_load.py --repository artifacts/smollm2-eagle3.1/triton --streams 16

The server runs as `python -m eagle_trt.serve` in a process of its own.
Phase 1: each request alone, one after another (the single-stream baseline).
Phase 2: all of them at once (the model batches up to serving.max_concurrent; the rest wait).
Prompts (--workload): `mixed`, chat turns of 30 to 1,000 tokens (eagle_trt.workloads.mixed_texts),
or the MT-bench first turns; greedy, --max-tokens each. Checks that every phase-2 stream
equals its phase-1 text, scrapes /metrics during phase 2 (counters before and after, the most
requests running and waiting seen, the accepted-tokens histogram's mean; phase 1's mean too,
the figure `bench` reports for the same prompts one at a time) and that the servers are alive
after. Exit status 1 when a stream differs or a server died."""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

COUNTERS = ("eagle_trt_requests_total", "eagle_trt_prompt_tokens_total", "eagle_trt_generation_tokens_total")


async def stream_once(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat completion: its text, tokens, time to first content and to the end."""
    start = time.perf_counter()
    first, pieces, usage = None, [], None
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  temperature=0, max_tokens=max_tokens, stream=True,
                                                  stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - start
            pieces.append(chunk.choices[0].delta.content)
    total = time.perf_counter() - start
    n = usage.completion_tokens
    return {"text": "".join(pieces), "tokens": n, "prompt_tokens": usage.prompt_tokens, "ttft": first or total,
            "seconds": total, "itl": (total - (first or total)) / (n - 1) if n > 1 else None}



def summary(results: list[dict], seconds: float) -> dict:
    from eagle_trt.concurrency import percentile
    itl = [r["itl"] for r in results if r["itl"] is not None]
    return {"tok_per_s": sum(r["tokens"] for r in results) / seconds, "seconds": seconds,
            "ttft_p50_ms": 1e3 * percentile([r["ttft"] for r in results], 50),
            "ttft_p99_ms": 1e3 * percentile([r["ttft"] for r in results], 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50) if itl else None, "itl_p99_ms": 1e3 * percentile(itl, 99) if itl else None}


async def run(url: str, model: str, prompts: list[str], max_tokens: int) -> dict:
    import httpx
    import openai

    from eagle_trt.server.metrics import parse_metrics
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600)
    async with httpx.AsyncClient(timeout=30) as http:
        async def scrape() -> dict:
            return parse_metrics((await http.get(f"{url}/metrics")).text)
        await stream_once(client, model, prompts[0], 4)     # warm-up: first-call allocations
        alone = await scrape()
        start, solo = time.perf_counter(), []
        for prompt in prompts:
            solo.append(await stream_once(client, model, prompt, max_tokens))
        solo_s = time.perf_counter() - start
        before = await scrape()
        peak = {"eagle_trt_requests_running": 0.0, "eagle_trt_requests_waiting": 0.0}
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(stream_once(client, model, p, max_tokens)) for p in prompts]
        while not all(t.done() for t in tasks):
            now = await scrape()
            for k in peak:
                peak[k] = max(peak[k], now[k])
            await asyncio.wait(tasks, timeout=0.25)
        together = [t.result() for t in tasks]
        load_s = time.perf_counter() - start
        after = await scrape()
        healthy = (await http.get(f"{url}/health")).status_code == 200
    await client.close()
    return {"solo": solo, "solo_s": solo_s, "together": together, "load_s": load_s, "alone": alone, "before": before,
            "after": after, "peak": peak, "healthy": healthy}


def ready(url: str, server, timeout: float = 300) -> bool:
    """Wait until the front end answers /health with 200 (tritonserver loaded the model)."""
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def counter(metrics: dict, name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))   # scripts/: triton_load beside this one
    from triton_load import load_arguments

    from eagle_trt.build.local_triton import free_port
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="OUT", help="also write the numbers to this JSON file")
    args, prompts = load_arguments(p, argv, workload="mixed")
    # The server as a user runs it, a process of its own (its threads do not share this client's
    # interpreter lock); --served-model-name left at the model's name.
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "eagle_trt.serve", "--repository", args.repository,
                               "--model", args.model, "--port", str(port)], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        if not ready(url, server):
            print(f"error: the server did not start:\n{server.stderr.read()[-3000:]}", file=sys.stderr)
            return 2
        out = asyncio.run(run(url, args.model, prompts, args.max_tokens))
        alive = server.poll() is None and out["healthy"]
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    solo, together = out["solo"], out["together"]
    same = sum(a["text"] == b["text"] and a["tokens"] == b["tokens"] for a, b in zip(solo, together))
    one, many = summary(solo, out["solo_s"]), summary(together, out["load_s"])
    lengths = [r["prompt_tokens"] for r in solo]
    def accepted(before: dict, after: dict) -> tuple[float | None, float]:
        """The accepted-tokens histogram's mean between two scrapes, and its count."""
        name = "eagle_trt_accepted_tokens_per_iteration"
        count = after[f"{name}_count"] - before[f"{name}_count"]
        return ((after[f"{name}_sum"] - before[f"{name}_sum"]) / count if count else None), count
    mean_alone, iterations_alone = accepted(out["alone"], out["before"])
    mean_accepted, iterations = accepted(out["before"], out["after"])
    print(f"{len(prompts)} chat requests of {min(lengths)}-{max(lengths)} prompt tokens x {args.max_tokens} tokens, "
          f"greedy, through the OpenAI endpoint, {args.repository}")
    for label, s in (("one stream:       ", one), (f"{len(prompts):2d} streams at once:", many)):
        itl = f"ITL p50 {s['itl_p50_ms']:5.1f} ms, p99 {s['itl_p99_ms']:5.1f} ms" if s["itl_p50_ms"] is not None else ""
        print(f"{label} {s['tok_per_s']:7.1f} tok/s   TTFT p50 {s['ttft_p50_ms']:6.0f} ms, p99 "
              f"{s['ttft_p99_ms']:6.0f} ms   {itl}")
    print(f"{len(prompts)} streams at once: {many['tok_per_s'] / one['tok_per_s']:.2f}x one stream")
    print(f"streams identical to their one-at-a-time output: {same}/{len(prompts)}")
    print("/metrics over phase 2: " + ", ".join(
        f"{name} {counter(out['before'], name):.0f} -> {counter(out['after'], name):.0f}" for name in COUNTERS))
    print(f"  most running {out['peak']['eagle_trt_requests_running']:.0f}, waiting "
          f"{out['peak']['eagle_trt_requests_waiting']:.0f}; accepted tokens per iteration: mean "
          + (f"{mean_accepted:.2f} over {iterations:.0f} iterations" if iterations else "n/a (no drafting iteration)"))
    if iterations_alone:
        print(f"  phase 1 (one at a time): accepted tokens per iteration: mean {mean_alone:.2f} over "
              f"{iterations_alone:.0f} iterations")
    print("servers alive after: " + ("yes" if alive else "NO"))
    if args.json:
        numbers = {"streams": len(prompts), "max_tokens": args.max_tokens, "prompt_tokens": lengths,
                   "one_stream": one, "concurrent": many, "identical": same, "alive": alive,
                   "accepted_mean": mean_accepted, "accepted_mean_alone": mean_alone,
                   "workload": args.workload, "peak": out["peak"],
                   "counters": {n: [counter(out["before"], n), counter(out["after"], n)] for n in COUNTERS}}
        with open(args.json, "w") as f:
            json.dump(numbers, f, indent=2)
    return 0 if same == len(prompts) and alive else 1


if __name__ == "__main__":
    sys.exit(main())
