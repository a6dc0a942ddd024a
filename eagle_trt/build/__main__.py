"""python -m eagle_trt.build: compile a target + EAGLE drafter into ONNX graphs, quantized
graphs, parity bundles, TensorRT engines and a Triton model repository.

A thin skin over `eagle_trt.build.build`. Exit status: 0 built, 1 parity failure, 2 bad input
(config, checkpoint, missing upstream artifact, --require-tensorrt without TensorRT)."""
from __future__ import annotations

import argparse
import sys

from .pipeline import STAGES


def parse_stages(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [s.strip() for part in text for s in part.split(",") if s.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle_trt.build", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None,
                   help="build config YAML (default: the embedded SmolLM2 + EAGLE 3.1 config, "
                        "build_configs/smollm2-eagle3.1.yaml)")
    p.add_argument("--output", default=None, help="output folder (default: the config's outputs.dir, else "
                                                   "artifacts/<name>)")
    p.add_argument("--stages", nargs="+", default=None, metavar="STAGE",
                   help=f"run only these stages (comma or space separated; validate always runs; others must "
                        f"be up to date where needed): {', '.join(STAGES)}")
    p.add_argument("--force", action="store_true", help="rebuild the selected stages even when cached")
    p.add_argument("--require-tensorrt", action="store_true",
                   help="fail (exit 2) instead of skipping the engines stage where TensorRT or a GPU is missing")
    p.add_argument("--quiet", action="store_true", help="only the summary table and errors")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import io

    from ..config import ConfigError
    from . import ParityFailure, build, load_config, summary_table
    log = io.StringIO() if args.quiet else sys.stderr
    try:
        cfg = load_config(args.config)
        manifest = build(cfg, args.output, parse_stages(args.stages), args.force, args.require_tensorrt, log)
    except ParityFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, ValueError, FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.quiet:
        print(summary_table(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
