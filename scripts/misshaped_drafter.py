"""A drafter checkpoint for a target folder whose midlayer.mlp.up_proj.weight has another width
(Llama-3.1-8B's), written as a sparse safetensors file: the bad input of docs/benchmarks.md's
70B-wide build, which the build must refuse at validate from the header alone.

    python scripts/misshaped_drafter.py TARGET_FOLDER OUT_FOLDER
"""
import argparse
import json
import struct
import sys
from pathlib import Path

import torch

from eagle_trt.config import DrafterConfig, TargetConfig, read_json
from eagle_trt.models.drafter import EagleDrafter
from eagle_trt.tensor_files import parameters_on_meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target", type=Path, help="the target checkpoint folder (its config.json)")
    p.add_argument("out", type=Path, help="the drafter folder to write")
    args = p.parse_args(argv)
    target, out = args.target, args.out
    t = TargetConfig.from_hf(read_json(target / "config.json"), str(target / "config.json"))
    dcfg = DrafterConfig(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
            num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
            head_dim=t.head_dim, vocab_size=t.vocab_size, draft_vocab_size=8192,
            target_hidden_size=t.hidden_size, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
            rope_scaling=t.rope_scaling, max_position_embeddings=t.max_position_embeddings, fc_norm=True, norm_output=True)
    with parameters_on_meta():
        d = EagleDrafter(dcfg)
    names = {"F16": 2, "I64": 8, "BOOL": 1}
    header, offset = {}, 0
    for k, v in d.state_dict().items():
        if k == "embed_tokens.weight":
            continue
        shape = list(v.shape)
        if k == "midlayer.mlp.up_proj.weight":
            shape = [14336, 4096]          # Llama-3.1-8B's width
        dt = "I64" if v.dtype == torch.int64 else "BOOL" if v.dtype == torch.bool else "F16"
        n = names[dt]
        for s in shape: n *= s
        header[k] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    out.mkdir(parents=True, exist_ok=True)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)      # sparse: no bytes written
    (out / "config.json").write_text(json.dumps(dcfg.to_hf(), indent=2))
    print(out, offset / 1e9, "GB (sparse)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
