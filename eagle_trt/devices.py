"""Where the PyTorch models run: --device / --dtype for every CLI, resolved the same way.

Kept free of heavy imports at module level, so that CLIs add the options before loading torch."""
from __future__ import annotations

from .config import ConfigError

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str = "auto"):
    """'auto': CUDA when PyTorch sees a GPU, else the CPU; 'cuda' without one is an error."""
    import torch
    if device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device 'cuda': PyTorch sees no CUDA device (torch {torch.__version__}, built for CUDA "
                          f"{torch.version.cuda or 'none: a CPU-only build'}); use --device cpu or auto")
    return torch.device(device)


def add_device_options(parser, dtype: bool = True) -> None:
    """--device (and --dtype) for every CLI that runs PyTorch models."""
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="PyTorch device: auto = CUDA when PyTorch sees a GPU, else the CPU")
    if dtype:
        parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                            help="PyTorch dtype; default: bfloat16 on CUDA, float32 on the CPU")


def resolve_dtype(dtype: str | None, device) -> str:
    """None: bfloat16 on CUDA (what the GPUs run fastest), float32 on the CPU (exact parity)."""
    dtype = dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    return dtype


def cpu_has_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic natively (AVX-512 BF16 or AMX): there bf16
    autocast about halves a training step (2.2x the tokens/s, docs/training.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 autocast pays on `device`: CUDA, or a CPU with native bf16 (without it, bf16
    autocast computed training features 7x slower than float32 on an AVX2 EPYC)."""
    return device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16())


def torch_dtype(name: str):
    import torch
    return getattr(torch, name)
