"""A checkpoint's tensors, read one at a time from its files.

A safetensors file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end]}} and then the tensors' bytes. `TensorFiles` reads the header of every
file of a checkpoint folder when it is made (model.safetensors, or the shards its index lists)
and checks it against the file: a missing shard, a header that does not parse, or a tensor whose
bytes run past the end of its file (a truncated download or copy) is an error naming the file and
the tensor, before any stage spends time on the checkpoint. `read(name)` then reads that one
tensor into memory with plain reads into the tensor's own buffer: no mapping of the file stays
in the process, so going through an 8B checkpoint layer by layer holds one layer at a time.

pytorch_model.bin checkpoints are read through torch.load's memory map (their format has no
header to read first); GGUF targets are converted to safetensors once (checkpoints.py).

The model's side of the files is here too, below both the checkpoint loaders (checkpoints.py) and
the streamed target (models/streamed.py), so that models/ never imports checkpoints: the files'
names for our modules (HF_PREFIX), the found tensors checked against a module's (check_shapes),
modules built without weights (parameters_on_meta), and the tokenizer saved beside the weights."""
from __future__ import annotations

import json
import math
import re
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                      "F8_E5M2": torch.float8_e5m2}
MAX_HEADER = 100 << 20          # safetensors refuses headers above 100 MB too
READ_BLOCK = 64 << 20


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")   # in this order


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or does not fit its partner model."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int            # absolute byte offset in the file
    nbytes: int


def _header(path: Path) -> tuple[dict, int]:
    """(header, offset of the data) of a safetensors file, checked against the file's size."""
    if not path.is_file():
        raise CheckpointError(f"{path}: weight file not found")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a readable safetensors file ({size} bytes: truncated before its header)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER or 8 + length > size:
            raise CheckpointError(f"{path}: not a readable safetensors file (a {length}-byte header in a file of "
                                  f"{size} bytes: truncated or not safetensors)")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    return header, 8 + length


def _entries(path: Path) -> dict[str, TensorEntry]:
    header, data = _header(path)
    size = path.stat().st_size
    out = {}
    for name, info in header.items():
        try:
            dtype, shape = SAFETENSORS_DTYPES[info["dtype"]], tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor '{name}': unreadable header entry {info!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise CheckpointError(f"{path}: tensor '{name}': header gives {end - begin} bytes for a "
                                  f"{info['dtype']} tensor of shape {list(shape)} ({nbytes} bytes)")
        if data + end > size:
            raise CheckpointError(f"{path}: truncated: tensor '{name}' needs bytes up to {data + end}, the file has "
                                  f"{size}; copy or download this file again")
        out[name] = TensorEntry(name, path, dtype, shape, data + begin, nbytes)
    return out


class TensorFiles:
    """The tensors of a checkpoint folder by their names in the files: shapes and dtypes from the
    headers, values read when asked for."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.entries: dict[str, TensorEntry] = {}
        self._torch_bin: dict[str, torch.Tensor] | None = None
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: checkpoint folder not found")
        if single.is_file():
            self.source = single
            self.entries = _entries(single)
        elif index.is_file():
            self.source = index
            self._read_index(index)
        elif (self.folder / "pytorch_model.bin").is_file():
            self.source = self.folder / "pytorch_model.bin"
            self._read_torch_bin(self.source)
        else:
            raise CheckpointError(f"{self.folder}: no weights found (expected one of {', '.join(WEIGHT_FILES)})")

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a readable index ({exc})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: missing 'weight_map'")
        for shard in sorted(set(weight_map.values())):
            path = self.folder / shard
            if not path.is_file():
                names = sorted(k for k, v in weight_map.items() if v == shard)
                raise CheckpointError(f"{path}: shard listed in {index.name} is missing ({len(names)} tensors, "
                                      f"e.g. '{names[0]}')")
            self.entries.update(_entries(path))
        missing = sorted(set(weight_map) - set(self.entries))
        if missing:
            raise CheckpointError(f"{index}: tensors listed but absent from their shards: {missing[:5]}")

    def _read_torch_bin(self, path: Path) -> None:
        try:
            self._torch_bin = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - the legacy (pre-zip) format cannot be mapped: read whole
            try:
                self._torch_bin = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - surface the file name with any unpickling error
                raise CheckpointError(f"{path}: cannot read ({exc})") from None
        for name, t in self._torch_bin.items():
            self.entries[name] = TensorEntry(name, path, t.dtype, tuple(t.shape), 0, t.numel() * t.element_size())

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def read(self, name: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """The tensor `name` (a file's name for it), converted to `dtype` when given."""
        entry = self.entries[name]
        if self._torch_bin is not None:
            value = self._torch_bin[name]
        elif dtype is not None and dtype != entry.dtype and entry.dtype.is_floating_point and dtype.is_floating_point:
            value = _read_converted(entry, dtype)
        else:
            value = torch.empty(entry.shape, dtype=entry.dtype)
            _read_into(entry, value)
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        value = value.to(device)
        # a tensor of the mapped .bin file as it is: copied, so that the file's memory can go
        return value.clone() if self._torch_bin is not None and value is self._torch_bin[name] else value


def _read_into(entry: TensorEntry, value: torch.Tensor, start: int = 0) -> None:
    """The file's bytes [start, start + value's size) of `entry` into `value` (its own dtype)."""
    buf = value.reshape(-1).view(torch.uint8).numpy() if value.numel() else None
    if buf is None:
        return
    done, size = 0, buf.nbytes
    with open(entry.file, "rb", buffering=0) as f:
        f.seek(entry.start + start)
        while done < size:
            n = f.readinto(memoryview(buf)[done:done + READ_BLOCK])
            if not n:
                raise CheckpointError(f"{entry.file}: truncated: tensor '{entry.name}' ends at byte "
                                      f"{entry.start + entry.nbytes}, the file ended at {entry.start + start + done}")
            done += n


def _read_converted(entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
    """The tensor in another float type, converted a block at a time: a 70B-wide lm_head read as
    float32 from bf16 holds its float32 copy and one block, not the bf16 copy beside it."""
    value = torch.empty(entry.shape, dtype=dtype)
    flat = value.reshape(-1)
    step = max(1, READ_BLOCK // entry.dtype.itemsize)
    block = torch.empty(min(step, flat.numel()), dtype=entry.dtype)
    for first in range(0, flat.numel(), step):
        n = min(step, flat.numel() - first)
        _read_into(entry, block[:n], first * entry.dtype.itemsize)
        flat[first:first + n] = block[:n]
    return value


# ----------------------------------------------------------------------------- the model's side

HF_PREFIX = re.compile(r"^model\.")     # transformers' names: model.layers.0... for our layers.0...


def _file_namer(origin: dict[str, str]):
    """Module name -> the name this file would give it, learned from the names the file has:
    per top-level module, the prefix the file uses in its place (`midlayer.` -> `layers.0.`,
    `layers.` -> `model.layers.`)."""
    heads: dict[str, tuple[str, str]] = {}
    for name, key in origin.items():
        common = 0
        while common < min(len(name), len(key)) and name[-1 - common] == key[-1 - common]:
            common += 1
        heads.setdefault(name.split(".", 1)[0], (name[:len(name) - common], key[:len(key) - common]))

    def file_name(name: str) -> str:
        ours, theirs = heads.get(name.split(".", 1)[0], ("", ""))
        return theirs + name[len(ours):] if name.startswith(ours) else name
    return file_name


def check_shapes(expected: dict[str, tuple], found: dict[str, tuple], source: Path,
                 optional: tuple[str, ...] = (), origin: dict[str, str] | None = None) -> None:
    """Every expected tensor found with its shape and nothing more (both {module name: shape}),
    naming every missing, unexpected or mis-shaped tensor as the file names it (`origin`:
    module name -> file name, from checkpoints.rename_tensors)."""
    file_name = _file_namer(origin) if origin else (lambda name: name)
    missing = sorted(file_name(k) for k in expected if k not in found and k not in optional)
    extra = sorted(file_name(k) for k in found if k not in expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing}")
        if extra:
            parts.append(f"unexpected tensors {extra}")
        raise CheckpointError(f"{source}: " + "; ".join(parts))
    for name, shape in found.items():
        if tuple(shape) != tuple(expected[name]):
            raise CheckpointError(f"{source}: tensor '{file_name(name)}' has shape {tuple(shape)}, "
                                  f"the config implies {tuple(expected[name])}")


@contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no random
    init) and their buffers as usual; checkpoints.load_exact(..., assign=True) or a StreamedTarget
    then gives them weights."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":    # a meta one is shared (tied): keep it
            param = torch.nn.Parameter(param.to("meta"), param.requires_grad)
        register(module, name, param)
    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def load_tokenizer(folder: Path):
    """The tokenizer saved in a checkpoint folder (transformers' files beside the weights)."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{folder}: cannot load a tokenizer ({exc})") from None


__all__ = ["HF_PREFIX", "WEIGHT_FILES", "CheckpointError", "TensorEntry", "TensorFiles", "check_shapes",
           "load_tokenizer", "parameters_on_meta"]
