"""The ONNX Runtime sessions parity runs graphs in: a graph's external float weights are fed as
read-only memory maps of its weights file, whose pages are dropped from the process as each call
reads them, so checking a real-size graph never holds its weights in the process (parity.py)."""
from __future__ import annotations

import mmap
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .runtime.sessions import PROVIDERS, make_session


def parity_session(graph: str | Path, dtype: str = "float32", provider: str = "cpu"):
    """An ONNX Runtime CPU session whose weights are never copied into the process: a graph's
    external float weights are fed as inputs, read-only memory maps of its data file whose pages
    are dropped from the process as each call reads them (WeightsFed): ONNX Runtime's own loading
    maps the file and keeps every page it read mapped, a real-size target's weights once more in
    the process's memory for the rest of the parity stage. Without prepacking, small weights kept
    in the graph are not copied into packed buffers either. A float16 graph runs unoptimized:
    the CPU has no fp16 MatMul, and ONNX Runtime's optimizer turns float16 *initializers* into
    float32 copies (an FP8-on-fp16 build of a 0.83 B target peaked at 1.89x its fp32 weights
    there), while a float16 *input* is cast when its node runs. A parity run makes a handful of
    calls; their speed does not matter. provider 'cuda': ONNX Runtime's CUDA execution provider
    (onnxruntime-gpu) on the graph as it is, its weights on the GPU."""
    import onnxruntime as ort
    if provider != "cpu":
        return make_session(graph, providers=PROVIDERS[provider], level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    so = _one_off_options()
    so.add_session_config_entry("session.disable_prepacking", "1")
    if dtype == "float16":
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        # The default order runs the weights' casts early, holding most float32 copies at once
        # (2.5 GB for a 0.83 B target); priority order casts each near its use (0.75 GB).
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    return WeightsFed(Path(graph), so)


FED_TYPES = {1: np.float32, 10: np.float16}     # TensorProto.FLOAT, FLOAT16: the weights fed as memory maps
# types numpy has no dtype for (BFLOAT16, FLOAT8E4M3FN, FLOAT8E5M2): their bytes mapped, fed as OrtValues of the type
RAW_FED_TYPES = {16: np.uint16, 17: np.uint8, 19: np.uint8}


def probe_session(graph: str | Path, threads: int | None = 1) -> "WeightsFed":
    """An FP8 graph run once, unoptimized with FP8_SESSION's settings (each weight dequantized
    when its MatMul runs, then freed), its external weights fed as memory maps (WeightsFed):
    ONNX Runtime reads a data file whose tensors are not page-aligned into its heap, all of a
    70B-wide target's FP8 layers at once (the layer parity check)."""
    import onnxruntime as ort

    from .runtime.sessions import FP8_SESSION
    so = _one_off_options()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for key, value in FP8_SESSION["config"].items():
        so.add_session_config_entry(key, value)
    if threads:
        so.intra_op_num_threads = threads
    return WeightsFed(Path(graph), so)


def _one_off_options():
    """Options of a session run a few times for a check: quiet, each call's memory given back after it."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.enable_cpu_mem_arena = False
    return so


class WeightsFed:
    """A session over a graph whose external float weights are graph inputs, fed on every call
    as read-only memory maps of its data file (page cache, never a copy, nor a float32 one of a
    float16 weight), whose pages are dropped from the process as the call goes (pages_dropped).
    Presents the graph's own inputs (get_inputs / get_outputs / run), as Polygraphy's runner
    expects. A graph without external weights is an ordinary session."""

    def __init__(self, graph: Path, options):
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        from .export.graph_files import read_array   # also from a weights file with several hard links
        model = onnx.load(str(graph), load_external_data=False)
        self.weights: dict[str, np.ndarray | ort.OrtValue] = {}
        self.maps: list[mmap.mmap] = []
        kept = []
        for init in model.graph.initializer:
            if init.data_location != TensorProto.EXTERNAL:
                kept.append(init)
                continue
            info = {e.key: e.value for e in init.external_data}
            dtype = FED_TYPES.get(init.data_type, RAW_FED_TYPES.get(init.data_type))
            if dtype is None:    # small non-float tensors: into the graph
                kept.append(numpy_helper.from_array(read_array(init, graph.parent), init.name))
                continue
            mapped = np.memmap(graph.parent / info["location"], dtype=dtype, mode="r",
                               offset=int(info.get("offset", 0)), shape=tuple(init.dims))
            self.maps.append(mapped._mmap)
            self.weights[init.name] = (mapped if init.data_type in FED_TYPES     # OrtValue: a view, no copy
                                       else ort.OrtValue.ortvalue_from_numpy_with_onnx_type(mapped, init.data_type))
            model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        if not self.weights:
            self.session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
            return
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def get_inputs(self):
        return [i for i in self.session.get_inputs() if i.name not in self.weights]

    def get_outputs(self):
        return self.session.get_outputs()

    def run(self, output_names, feeds):
        if not self.weights:
            return self.session.run(output_names, feeds)
        with pages_dropped(self.maps):
            return self.session.run(output_names, {**feeds, **self.weights})


@contextmanager
def pages_dropped(maps: list[mmap.mmap], every: float = 0.2):
    """While the block runs (an ONNX Runtime call, which releases the GIL), drop the pages of the
    read-only file mappings `maps` from the process every `every` seconds, and once more at the
    end. A call reads each weight once, and the pages it read would otherwise stay mapped until
    the maps are closed: a real-size target's weights file, once more in the process's memory
    (its RSS), for the length of the parity stage. Dropped, they stay in the kernel's page
    cache, from which a page still being read is mapped again on its next access."""
    stop = threading.Event()

    def drop():
        for m in maps:
            m.madvise(mmap.MADV_DONTNEED)

    def keep_dropping():
        while not stop.wait(every):
            drop()
    thread = threading.Thread(target=keep_dropping, name="drop-weight-pages", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        drop()


__all__ = ["FED_TYPES", "RAW_FED_TYPES", "WeightsFed", "pages_dropped", "parity_session", "probe_session"]
