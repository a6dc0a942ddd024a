"""How a graph lies on disk: `name.onnx`, plus one `name.onnx.data` beside it when its weights pass
1 GB, as TensorRT-Edge-LLM and ModelOpt write them.

Every stage that writes a graph writes it through `save_graph`, so two graphs in one folder
never share or overwrite each other's weight files (the exporter's own external data is one
file per tensor, named after exporter internals). `graph_files` lists what a graph needs, for
copying it (the Triton repository) and for checking it (`check_graph_files`)."""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TypeVar

import onnx
from onnx import helper
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


class DiskFull(GraphFileError):
    """A graph file could not be written: its file system is full (`writing`)."""


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


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)   # no space, no quota, a file size limit


@contextmanager
def writing(path: str | Path):
    """Turn a full disk (or a file size limit) while writing `path` into an error naming the file,
    how far it got and where space is needed: the build's stage folders are written whole or not
    at all (build/store.py), so the rerun after freeing space resumes at the stage that failed."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in DISK_FULL_ERRNOS:
            raise
        path = Path(path)
        size = path.stat().st_size if path.is_file() else 0
        try:
            free = shutil.disk_usage(path.parent).free
        except OSError:
            free = 0
        raise DiskFull(f"{path}: {exc.strerror} after writing {size / 1e9:.2f} GB of this file ({free / 1e9:.2f} GB "
                       f"free on its file system); free space there and run the build again (completed stages "
                       f"are kept, the unfinished one starts over)") from None


class DataFile:
    """A graph's weights file written a tensor at a time: each tensor's bytes are appended and the
    tensor is pointed there, so the graph in memory never holds them."""

    def __init__(self, path: str | Path):
        self.path, self.offset, self.names = Path(path), 0, set()
        self._file = open(self.path, "wb")

    def append(self, tensor: onnx.TensorProto, blocks) -> onnx.TensorProto:
        """Write `blocks` (bytes-like objects: a tensor's bytes in order) and point `tensor` at them."""
        size = 0
        with writing(self.path):
            for block in blocks:
                self._file.write(block)
                size += memoryview(block).nbytes
        point_to_data(tensor, self.path, self.offset, size)
        self.offset += size
        self.names.add(tensor.name)
        return tensor

    def close(self) -> None:
        with writing(self.path):
            self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


def new_tensor(name: str, elem: int, dims: list[int], raw: bytes, data: DataFile | None) -> onnx.TensorProto:
    """A tensor a rewrite makes (its bytes `raw`): appended to the new graph's weights file `data`
    there and then where one is open and the tensor is large enough to live outside the graph
    (a real-size graph's new weights are never all in memory), else kept in the graph."""
    if data is not None and len(raw) >= MIN_EXTERNAL_TENSOR:
        return data.append(onnx.TensorProto(name=name, data_type=elem, dims=dims), [raw])
    return helper.make_tensor(name, elem, dims, raw, raw=True)


Result = TypeVar("Result")


def rewrite_graph(src: str | Path, dst: str | Path, rewrite: Callable[[onnx.ModelProto, DataFile | None], Result],
                  check: Callable[[Path], None] | None = None, external: bool = False) -> Result:
    """Read the graph at `src` without its external weights, let `rewrite(model, data)` change it
    in place (`data`: the new graph's weights file, open where `src` keeps weights outside the
    graph or `external` asks for one, for its new tensors: new_tensor), write it in a temporary
    folder beside `dst` with the weights it kept copied from `src`'s files a tensor at a time,
    `check` the written file, then install it as `dst` (a failed run leaves no `dst`). Returns what
    `rewrite` returned."""
    src, dst = Path(src), Path(dst)
    model = onnx.load(str(src), load_external_data=False)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.stem}.", dir=dst.parent))
    try:
        out = tmp / dst.name
        external = external or any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
        with DataFile(out.with_name(data_file_name(out))) if external else nullcontext() as data:
            result = rewrite(model, data)
            written = save_graph(model, out, source_dir=src.parent, data=data)
        if check is not None:
            check(out)
        install_graph(written, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def save_graph(model: onnx.ModelProto, path: str | Path, source_dir: str | Path | None = None,
               data: DataFile | None = None, share_data: bool = False,
               sources: dict[str, Path] | None = None) -> list[Path]:
    """Write `model` to `path`, with its weights in `path.data` when the graph is past the
    threshold; returns the files written (the graph first).

    source_dir: `model` was loaded without its external data (onnx.load(...,
    load_external_data=False)) from a graph in this folder, e.g. the exporter's one file per
    tensor: those tensors are copied one at a time into `path.data`, so the weights are never
    all in memory (a real-size target would otherwise be, once more, beside the PyTorch model);
    tensors made in memory since (a quantized graph's new weights) go into the same file.
    data: `path.data` already open, holding tensors written as they were made (the caller closes
    it); the rest is appended. share_data: the external tensors keep their weights files, hard-
    linked beside `path` (no copy: the iteration graph reads the target graph's own weights
    file); copied where a hard link cannot be made. sources: {tensor name: folder} for external
    tensors read from a folder other than source_dir (a graph composed of two graphs)."""
    path = Path(path)
    data_path = path.with_name(data_file_name(path))
    if data is None and data_path.exists():
        data_path.unlink()   # onnx appends to an existing data file
    external = source_dir is not None and any(uses_external_data(t) for t in _tensors(model))
    if external or data is not None:
        own = data if data is not None else DataFile(data_path)
        try:
            linked = _write_external_data(model, Path(source_dir) if source_dir else None, own, share_data,
                                          sources or {})
        finally:
            if data is None:
                own.close()
        with writing(path):
            onnx.save(model, str(path))
        if own.offset == 0 and data is None:
            data_path.unlink()
            return [path] + linked
        return [path, data_path] + linked
    external = proto_bytes(model) > external_data_threshold()
    with writing(path):
        onnx.save(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                  location=data_path.name, size_threshold=MIN_EXTERNAL_TENSOR)
    return [path, data_path] if data_path.exists() else [path]     # no data file when no tensor is large enough


def point_to_data(tensor: onnx.TensorProto, data: Path, offset: int, size: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", data.name), ("offset", str(offset)), ("length", str(size))):
        tensor.external_data.add(key=key, value=value)
    tensor.data_location = onnx.TensorProto.EXTERNAL


def _write_external_data(model: onnx.ModelProto, source_dir: Path | None, data: DataFile,
                         share: bool, sources: dict[str, Path]) -> list[Path]:
    """Append every large initializer held in memory and every external tensor of `model` (read
    from its folder, sources' or source_dir, in chunks) to `data`, and point the tensor there;
    with `share`, an external tensor keeps its weights file where that file can be hard-linked
    beside `data`. Returns the files linked."""
    for tensor in model.graph.initializer:
        if not uses_external_data(tensor) and len(tensor.raw_data) >= MIN_EXTERNAL_TENSOR:
            data.append(tensor, [tensor.raw_data])
            tensor.ClearField("raw_data")
    linked: dict[Path, Path | None] = {}
    for tensor in _tensors(model):
        if not uses_external_data(tensor) or tensor.name in data.names:
            continue
        folder = Path(sources.get(tensor.name, source_dir))
        if share:
            src = folder / _location(tensor, folder)
            if src not in linked:
                linked[src] = _link_beside(src, data.path.parent)
            if linked[src] is not None:
                continue
        data.append(tensor, _external_blocks(tensor, folder))
    return [p for p in linked.values() if p is not None]


def _link_beside(src: Path, folder: Path) -> Path | None:
    """`src` hard-linked into `folder` under its name (or already there); None where it cannot be."""
    dst = folder / src.name
    try:
        if dst.exists():
            return dst if os.path.samefile(src, dst) else None
        os.link(src, dst)
        return dst
    except OSError:
        return None


def load_weights(model: onnx.ModelProto, source_dir: str | Path) -> None:
    """Read every external tensor of `model` (loaded with load_external_data=False from a graph in
    source_dir) into the graph. onnx.load refuses a data file with several hard links, which is
    how a Triton repository shares a build's graphs: this reads them as save_graph does."""
    for tensor in _tensors(model):
        if uses_external_data(tensor):
            tensor.raw_data = b"".join(_external_blocks(tensor, Path(source_dir)))
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT


def read_array(tensor: onnx.TensorProto, source_dir: str | Path):
    """One float or integer tensor as a numpy array, read straight into it from its weights file
    where it lies outside the graph (a data file with several hard links is read too)."""
    import numpy as np
    from onnx import numpy_helper
    if not uses_external_data(tensor):
        return numpy_helper.to_array(tensor)
    info = {e.key: e.value for e in tensor.external_data}
    src = Path(source_dir) / _location(tensor, Path(source_dir))
    array = np.empty(tuple(tensor.dims), dtype=helper.tensor_dtype_to_np_dtype(tensor.data_type))
    with open(src, "rb") as f:
        f.seek(int(info.get("offset", 0)))
        got = f.readinto(memoryview(array.reshape(-1)).cast("B"))
    if got != array.nbytes or int(info.get("length", array.nbytes)) != array.nbytes:
        raise GraphFileError(f"{src}: tensor {tensor.name!r} needs {array.nbytes} bytes, the file gives {got}")
    return array


def _location(tensor: onnx.TensorProto, source_dir: Path) -> Path:
    location = Path({e.key: e.value for e in tensor.external_data}["location"])
    if location.is_absolute() or ".." in location.parts:
        raise GraphFileError(f"tensor {tensor.name!r}: external data location {str(location)!r} is outside "
                             f"the graph's folder {source_dir}")
    return location


def _external_blocks(tensor: onnx.TensorProto, source_dir: Path, chunk: int = 64 << 20):
    """The bytes of an external tensor, in blocks of at most `chunk`."""
    info = {e.key: e.value for e in tensor.external_data}
    src = source_dir / _location(tensor, source_dir)
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


def check_structure(model: onnx.ModelProto) -> None:
    """onnx.checker on the graph with its initializers as graph inputs of their type and shape:
    nodes, types and opsets are checked whatever the weights' size and wherever they are (the
    checker refuses a weights file with several hard links, which a graph sharing another's
    weights file has)."""
    g = model.graph
    inputs = {i.name for i in g.input}
    weights = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in g.initializer
               if t.name not in inputs]
    skeleton = helper.make_model(helper.make_graph(list(g.node), g.name, list(g.input) + weights, list(g.output),
                                                   value_info=list(g.value_info)),
                                 opset_imports=list(model.opset_import), ir_version=model.ir_version)
    onnx.checker.check_model(skeleton)


def check_graph_files(path: str | Path) -> None:
    """Raise GraphFileError naming the file when a graph's weight file is missing or too short."""
    for location, end in external_references(path).items():
        if not location.is_file():
            raise GraphFileError(f"{path}: its weights file {location} is missing")
        if location.stat().st_size < end:
            raise GraphFileError(f"{path}: its weights file {location} has {location.stat().st_size} bytes, the graph "
                                 f"reads up to byte {end} (truncated or replaced)")


__all__ = ["EXTERNAL_DATA_BYTES", "DataFile", "DiskFull", "GraphFileError", "writing", "check_graph_files",
           "check_structure", "data_file_name", "external_data_threshold",
           "external_references", "graph_files", "install_graph", "new_tensor", "proto_bytes", "read_array",
           "rewrite_graph", "save_graph"]
