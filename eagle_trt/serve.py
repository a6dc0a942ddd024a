"""python -m eagle_trt.serve: an OpenAI-compatible HTTP server over a built Triton repository.

    python -m eagle_trt.serve --repository artifacts/<name>/triton [--host 127.0.0.1 --port 8000]

Starts tritonserver on the repository (build/local_triton.py, the binary nvidia-pytriton bundles)
and the front end of eagle_trt/server/app.py before it; with --triton-url it uses a Triton that
is already running (a real tritonserver on a GPU host) instead. Ctrl-C or SIGTERM stops both."""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_trt.serve", description=__doc__.splitlines()[0])
    p.add_argument("--repository", required=True, help="model repository written by python -m eagle_trt.build")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="eagle_trt", help="the model's name in the repository (serving.model_name)")
    p.add_argument("--served-model-name", default=None, help="the name clients give as `model` (default: --model)")
    p.add_argument("--triton-url", default=None,
                   help="gRPC address of a running Triton serving the repository (default: start one here)")
    p.add_argument("--response-timeout", type=float, default=600.0,
                   help="seconds to wait for each Triton response before answering 503")
    args = p.parse_args(argv)
    if not (Path(args.repository) / ".").is_dir():
        print(f"error: {args.repository}: model repository not found", file=sys.stderr)
        return 2
    import uvicorn

    from .build.local_triton import LocalTriton, TritonUnavailable, stop_on_sigterm
    from .server.app import create_app
    from .server.triton_stream import TritonBackend
    try:   # the tokenizer and eagle.json first: a wrong --model fails before a server starts
        backend = TritonBackend(args.repository, args.triton_url or "", args.model, args.served_model_name,
                                args.response_timeout)
    except (FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    stop_on_sigterm()   # while tritonserver starts; uvicorn handles SIGTERM and Ctrl-C once it runs
    try:
        with (contextlib.nullcontext() if args.triton_url else LocalTriton(args.repository)) as triton:
            if triton is not None:
                backend.url = triton.grpc_url
            print(f"serving {backend.limits.served_name} from {args.repository} (Triton at {backend.url}) on "
                  f"http://{args.host}:{args.port}/v1 (Ctrl-C or SIGTERM stops)", file=sys.stderr, flush=True)
            uvicorn.run(create_app(backend), host=args.host, port=args.port, log_level="info")
    except TritonUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
