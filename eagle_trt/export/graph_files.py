"""How a graph lies on disk: `name.onnx`, plus one `name.onnx.data` beside it when its weights pass
1 GB, as TensorRT-Edge-LLM and ModelOpt write them.

Every stage that writes a graph writes it through `save_graph`, so two graphs in one folder
never share or overwrite each other's weight files (the exporter's own external data is one
file per tensor, named after exporter internals). `graph_files` lists what a graph needs, for
copying it (the Triton repository) and for checking it (`check_graph_files`)."""
from __future__ import annotations

import os
from pathlib import Path

import onnx
from google.protobuf.message import EncodeError
from onnx.external_data_helper import uses_external_data

# Graphs whose protobuf would pass this many bytes keep their weights in `name.onnx.data`.
# Protobuf refuses 2 GiB; below that a graph file is parsed whole into memory by whatever loads
# it, while ONNX Runtime memory-maps a data file: 1 GB keeps a real-size graph's weights out of
# the loaders' heaps (an fp16 0.83 B target's parity: 4.9 GB -> see docs/build.md) and SmolLM2's
# graphs (at most 0.55 GB) in one file. EAGLE_TRT_EXTERNAL_DATA_BYTES sets it (tests lower it).
EXTERNAL_DATA_BYTES = 1_000_000_000
MIN_EXTERNAL_TENSOR = 1024       # smaller tensors stay inside the graph


class GraphFileError(ValueError):
    pass


def external_data_threshold() -> int:
    value = os.environ.get("EAGLE_TRT_EXTERNAL_DATA_BYTES")
    if value is None:
        return EXTERNAL_DATA_BYTES
    try:
        return int(value)
    except ValueError:
        raise GraphFileError(f"EAGLE_TRT_EXTERNAL_DATA_BYTES={value!r}: expected a number of bytes") from None


def data_file_name(graph: Path) -> str:
    return f"{Path(graph).name}.data"


def proto_bytes(model: onnx.ModelProto) -> int:
    """The serialized size, or 2 GiB where protobuf refuses to size a message that large."""
    try:
        return model.ByteSize()
    except EncodeError:
        return 1 << 31


def save_graph(model: onnx.ModelProto, path: str | Path, source_dir: str | Path | None = None) -> list[Path]:
    """Write `model` to `path`, with its weights in `path.data` when the graph is past the
    threshold; returns the files written (the graph first).

    source_dir: `model` was loaded without its external data (onnx.load(...,
    load_external_data=False)) from a graph in this folder, e.g. the exporter's one file per
    tensor: those tensors are copied one at a time into `path.data`, so the weights are never
    all in memory (a real-size target would otherwise be, once more, beside the PyTorch model);
    tensors made in memory since (a quantized graph's new weights) go into the same file."""
    path = Path(path)
    data = path.with_name(data_file_name(path))
    if data.exists():
        data.unlink()   # onnx appends to an existing data file
    if source_dir is not None and any(uses_external_data(t) for t in _tensors(model)):
        _copy_external_data(model, Path(source_dir), data)
        onnx.save(model, str(path))
        return [path, data]
    external = proto_bytes(model) > external_data_threshold()
    onnx.save(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
              location=data.name, size_threshold=MIN_EXTERNAL_TENSOR)
    return [path, data] if data.exists() else [path]     # no data file when no tensor is large enough


def point_to_data(tensor: onnx.TensorProto, data: Path, offset: int, size: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", data.name), ("offset", str(offset)), ("length", str(size))):
        tensor.external_data.add(key=key, value=value)
    tensor.data_location = onnx.TensorProto.EXTERNAL


def _copy_external_data(model: onnx.ModelProto, source_dir: Path, data: Path, chunk: int = 64 << 20) -> None:
    """Append every external tensor of `model` (read from source_dir, in chunks) and every large
    initializer held in memory to `data`, and point the tensor there."""
    offset, moved = 0, set()
    with open(data, "wb") as out:
        for tensor in model.graph.initializer:
            if not uses_external_data(tensor) and len(tensor.raw_data) >= MIN_EXTERNAL_TENSOR:
                out.write(tensor.raw_data)
                point_to_data(tensor, data, offset, len(tensor.raw_data))
                offset += len(tensor.raw_data)
                tensor.ClearField("raw_data")
                moved.add(tensor.name)
        for tensor in _tensors(model):
            if not uses_external_data(tensor) or tensor.name in moved:
                continue
            size = 0
            for block in _external_blocks(tensor, source_dir, chunk):
                out.write(block)
                size += len(block)
            point_to_data(tensor, data, offset, size)
            offset += size


def load_weights(model: onnx.ModelProto, source_dir: str | Path) -> None:
    """Read every external tensor of `model` (loaded with load_external_data=False from a graph in
    source_dir) into the graph. onnx.load refuses a data file with several hard links, which is
    how a Triton repository shares a build's graphs: this reads them as _copy_external_data does."""
    for tensor in _tensors(model):
        if uses_external_data(tensor):
            tensor.raw_data = b"".join(_external_blocks(tensor, Path(source_dir)))
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT


def _external_blocks(tensor: onnx.TensorProto, source_dir: Path, chunk: int = 64 << 20):
    """The bytes of an external tensor, in blocks of at most `chunk`."""
    info = {e.key: e.value for e in tensor.external_data}
    location = Path(info["location"])
    if location.is_absolute() or ".." in location.parts:
        raise GraphFileError(f"tensor {tensor.name!r}: external data location {info['location']!r} is outside "
                             f"the graph's folder {source_dir}")
    src = source_dir / location
    start, length = int(info.get("offset", 0)), info.get("length")
    left = int(length) if length is not None else src.stat().st_size - start
    size = left
    with open(src, "rb") as f:
        f.seek(start)
        while left:
            block = f.read(min(chunk, left))
            if not block:
                raise GraphFileError(f"{src}: ends before the {size} bytes tensor {tensor.name!r} needs")
            yield block
            left -= len(block)


def install_graph(written: list[Path], dst: str | Path) -> None:
    """Move a graph that `save_graph` wrote into a temporary folder to `dst`: its weights file
    first and the graph last, so a present graph always has complete weights; a weights file
    left by an earlier, larger graph of that name is removed."""
    dst = Path(dst)
    stale = dst.with_name(data_file_name(dst))
    if len(written) == 1 and stale.exists():
        stale.unlink()
    for f in written[1:]:
        os.replace(f, dst.parent / f.name)
    os.replace(written[0], dst)


def _tensors(model: onnx.ModelProto):
    yield from model.graph.initializer
    for node in model.graph.node:        # Constant nodes may keep their value outside too
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t


def external_references(path: str | Path) -> dict[Path, int]:
    """{external file: bytes the graph reads from it} for the graph at `path` (weights not loaded)."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    need: dict[Path, int] = {}
    for tensor in _tensors(model):
        if not uses_external_data(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = path.parent / info["location"]
        end = int(info.get("offset", 0)) + int(info.get("length", 0))
        need[location] = max(need.get(location, 0), end)
    return need


def graph_files(path: str | Path) -> list[Path]:
    """The graph file and every file it reads its weights from."""
    return [Path(path)] + sorted(external_references(path))


def check_graph_files(path: str | Path) -> None:
    """Raise GraphFileError naming the file when a graph's weight file is missing or too short."""
    for location, end in external_references(path).items():
        if not location.is_file():
            raise GraphFileError(f"{path}: its weights file {location} is missing")
        if location.stat().st_size < end:
            raise GraphFileError(f"{path}: its weights file {location} has {location.stat().st_size} bytes, the graph "
                                 f"reads up to byte {end} (truncated or replaced)")


__all__ = ["EXTERNAL_DATA_BYTES", "GraphFileError", "check_graph_files", "data_file_name", "external_data_threshold",
           "external_references", "graph_files", "install_graph", "proto_bytes", "save_graph"]
