"""How does a built repository hold up under concurrent streams through the OpenAI endpoint? The
twin of scripts/triton_load.py one layer up: starts tritonserver and the front end of
`python -m eagle_trt.serve` on the repository, then streams chat completions with the `openai`
client and prints throughput, time to first token and inter-token latency.

    python scripts/openai_load.py --repository artifacts/smollm2-eagle3.1/triton --streams 16

Phase 1: each request alone, one after another (the single-stream baseline).
Phase 2: all of them at once (the model batches up to serving.max_concurrent; the rest wait).
Prompts: MT-bench questions concatenated and cut to chat-templated lengths spread evenly over
30..1,000 tokens (deterministic), greedy, --max-tokens each. Checks that every phase-2 stream
equals its phase-1 text, scrapes /metrics during phase 2 (counters before and after, the most
requests running and waiting seen, the accepted-tokens histogram's mean) and that the servers
are alive after. Exit status 1 when a stream differs or a server died."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

COUNTERS = ("eagle_trt_requests_total", "eagle_trt_prompt_tokens_total", "eagle_trt_generation_tokens_total")


def load_prompts(tokenizer, n: int, shortest: int = 30, longest: int = 1000) -> list[str]:
    """n user messages whose chat-templated prompts are spread evenly over [shortest, longest]
    tokens: MT-bench questions, one after another from question i, cut to length."""
    from eagle_trt.data import mtbench_prompts
    questions = mtbench_prompts()
    text = "\n\n".join(questions)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    empty = tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True)
    overhead = len(empty["input_ids"] if hasattr(empty, "keys") else empty)
    prompts = []
    for i in range(n):
        length = shortest + (longest - shortest) * i // max(1, n - 1)
        start = len(tokenizer("\n\n".join(questions[:i % len(questions)]), add_special_tokens=False)["input_ids"])
        window = (ids[start:] + ids)[:max(1, length - overhead)]
        prompts.append(tokenizer.decode(window))
    return prompts


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


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summary(results: list[dict], seconds: float) -> dict:
    itl = [r["itl"] for r in results if r["itl"] is not None]
    return {"tok_per_s": sum(r["tokens"] for r in results) / seconds, "seconds": seconds,
            "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in results], 50),
            "ttft_p99_ms": 1e3 * pct([r["ttft"] for r in results], 99),
            "itl_p50_ms": 1e3 * pct(itl, 50) if itl else None, "itl_p99_ms": 1e3 * pct(itl, 99) if itl else None}


async def run(url: str, model: str, prompts: list[str], max_tokens: int) -> dict:
    import httpx
    import openai

    from eagle_trt.serve_metrics import parse_metrics
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600)
    async with httpx.AsyncClient(timeout=30) as http:
        async def scrape() -> dict:
            return parse_metrics((await http.get(f"{url}/metrics")).text)
        await stream_once(client, model, prompts[0], 4)     # warm-up: first-call allocations
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
    return {"solo": solo, "solo_s": solo_s, "together": together, "load_s": load_s, "before": before,
            "after": after, "peak": peak, "healthy": healthy}


def counter(metrics: dict, name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def main(argv: list[str] | None = None) -> int:
    from eagle_trt.build.local_triton import TritonUnavailable
    from eagle_trt.openai_api import serving
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", required=True)
    p.add_argument("--model", default="eagle_trt")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", metavar="OUT", help="also write the numbers to this JSON file")
    args = p.parse_args(argv)
    try:
        with serving(args.repository, args.model) as (triton, http):
            prompts = load_prompts(http.app.state.backend.tokenizer, args.streams)
            out = asyncio.run(run(http.url, args.model, prompts, args.max_tokens))
            alive = triton.alive() and out["healthy"]
    except (TritonUnavailable, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    solo, together = out["solo"], out["together"]
    same = sum(a["text"] == b["text"] and a["tokens"] == b["tokens"] for a, b in zip(solo, together))
    one, many = summary(solo, out["solo_s"]), summary(together, out["load_s"])
    lengths = [r["prompt_tokens"] for r in solo]
    accepted = "eagle_trt_accepted_tokens_per_iteration"
    iterations = out["after"][f"{accepted}_count"] - out["before"][f"{accepted}_count"]
    mean_accepted = (out["after"][f"{accepted}_sum"] - out["before"][f"{accepted}_sum"]) / iterations \
        if iterations else None
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
    print("servers alive after: " + ("yes" if alive else "NO"))
    if args.json:
        numbers = {"streams": len(prompts), "max_tokens": args.max_tokens, "prompt_tokens": lengths,
                   "one_stream": one, "concurrent": many, "identical": same, "alive": alive,
                   "accepted_mean": mean_accepted, "peak": out["peak"],
                   "counters": {n: [counter(out["before"], n), counter(out["after"], n)] for n in COUNTERS}}
        with open(args.json, "w") as f:
            json.dump(numbers, f, indent=2)
    return 0 if same == len(prompts) and alive else 1


if __name__ == "__main__":
    sys.exit(main())
