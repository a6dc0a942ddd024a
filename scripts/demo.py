"""`make demo`: the speculative decoder on the embedded default (SmolLM2-135M-Instruct).

Prints each generation, its statistics, and whether it equals the target's own greedy
output (plain autoregressive decoding with the same model, measured in the same run)."""
from __future__ import annotations

import sys

from eagle_trt.api import encode_prompt, load_pipeline
from eagle_trt.config import TreeShape
from eagle_trt.runtime.backend import TorchTarget
from eagle_trt.runtime.decoder import generate_autoregressive

PROMPTS = [
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is in two sentences.",
    "Write a short poem about autumn leaves.",
]


def main() -> int:
    # A tree sized for a 2-core CPU: verifying 60 nodes costs ~6 autoregressive steps here.
    shape = TreeShape(depth=5, top_k=4, total_tokens=16)
    pipe = load_pipeline("smollm2", None, shape, log=sys.stdout)
    print(f"tree: depth {shape.depth}, top_k {shape.top_k}, total_tokens {shape.total_tokens}\n")
    spec_s = ar_s = 0.0
    spec_n = ar_n = 0
    identical = True
    for prompt in PROMPTS:
        out = pipe.generate(prompt, 64, chat=True)
        ids = encode_prompt(pipe.tokenizer, prompt, chat=True)
        ar = generate_autoregressive(TorchTarget(pipe.target.model), ids, 64, pipe.decoder.eos_ids)
        same = out["tokens"] == ar.tokens
        identical &= same
        spec_s, spec_n = spec_s + out["seconds"], spec_n + len(out["tokens"])
        ar_s, ar_n = ar_s + ar.seconds, ar_n + len(ar.tokens)
        print(f"> {prompt}\n{out['text']}\n"
              f"  [{len(out['tokens'])} tokens, {out['target_calls']} target calls, mean accept length "
              f"{out['mean_accept_length']:.2f}, {out['seconds']:.2f}s speculative vs {ar.seconds:.2f}s autoregressive, "
              f"identical to greedy: {same}]\n")
    print(f"drafter: {pipe.drafter_source} ({pipe.drafter.cfg.variant})")
    print(f"speculative {spec_n / spec_s:.1f} tok/s, autoregressive {ar_n / ar_s:.1f} tok/s "
          f"(PyTorch CPU backend, same run): speed-up {(spec_n / spec_s) / (ar_n / ar_s):.2f}x")
    print(f"all outputs token-identical to the target's greedy output: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
