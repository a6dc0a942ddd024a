"""How the ONNX Runtime backends bind a graph call's memory: by address, once per call shape.

The KV caches' pasts and new-row staging, and every other input and output as preallocated
tensors (`Bound.buffers`), are bound by address and kept from call to call (`Bindings`), so a
call copies its few small inputs into place and makes no bindings. The memory is the host's, or
the KV caches' on a GPU (`kv_device` of the backends): ONNX Runtime reads device memory where it
is when the graph runs, and copies host memory to the device when it is bound, so a session on
a device provider binds its host inputs again before each call (`Binding.refresh`)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

from ..tree import DraftTree
from .backend import tree_from_outputs

NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.bool: np.bool_}
# ONNX TensorProto element types of the dtypes bound
ONNX_ELEMENT_TYPES = {torch.float32: 1, torch.float16: 10, torch.int64: 7, torch.bool: 9}


class Binding:
    """An ONNX Runtime IOBinding of memory by address: the host's, or a device's (the KV caches
    where a backend keeps them on a GPU: `kv_device`). Binds go straight to the binding's pybind
    object with the element type as an ONNX type number: about 1 us a bind, against 4 (numpy
    input) to 9 (output by address) through IOBinding's Python methods, which build an OrtDevice
    on every call; a prefill binds 4L + 8 names and a re-layout 2L again. Where the installed
    onnxruntime lacks that object (`_iobinding`), the public methods are used. Each bound tensor
    is held (`held`), so memory a binding points into outlives it."""
    raw_attribute = "_iobinding"
    always_rebind = False      # tests: take the device providers' path on the CPU provider too

    def __init__(self, session: ort.InferenceSession):
        self.io = session.io_binding()
        self.raw = getattr(self.io, self.raw_attribute, None)
        self.devices: dict[tuple[str, int], object] = {}     # (type, index): the pybind OrtDevice
        self.held: dict[str, torch.Tensor] = {}
        # ONNX Runtime copies a bound input to the device its consumers run on when it is bound
        # (IOBinding::BindInput calls CopyOneInputAcrossDevices), not when the graph runs: with
        # a device provider (CUDA) the graph reads a host buffer as it was at the bind, not
        # what was written there since (stale lengths and pasts; an input filled after its bind
        # read as leftover floats). Such sessions bind their host inputs again before each call;
        # memory on the device (the KV pasts with kv_device cuda) is read where it is, at the call.
        self.rebind = self.always_rebind or any(p != "CPUExecutionProvider" for p in session.get_providers())
        self.inputs: dict[str, tuple[torch.dtype, list[int], int]] = {}    # the inputs in host memory

    def bind(self, name: str, tensor: torch.Tensor, shape: list[int] | None = None, address: int | None = None,
             output: bool = False) -> None:
        """Bind `name` to `tensor`'s memory (contiguous), or to `shape` at `address` inside it."""
        self.held[name] = tensor
        shape = list(tensor.shape) if shape is None else shape
        address = tensor.data_ptr() if address is None else address
        where = (tensor.device.type, tensor.device.index or 0)
        if not output and where[0] == "cpu":
            self.inputs[name] = (tensor.dtype, shape, address)
        elif not output:
            self.inputs.pop(name, None)
        self._bind(name, tensor.dtype, shape, address, output, where)

    def _bind(self, name: str, dtype: torch.dtype, shape: list[int], address: int, output: bool,
              where: tuple[str, int] = ("cpu", 0)) -> None:
        if self.raw is not None:
            device = self.devices.get(where)
            if device is None:
                device = self.devices[where] = ort.OrtDevice.make(*where)._get_c_device()
            bind = self.raw.bind_output if output else self.raw.bind_input
            bind(name, device, ONNX_ELEMENT_TYPES[dtype], shape, address)
        elif output:
            self.io.bind_output(name, where[0], where[1], NUMPY_DTYPES[dtype], shape, address)
        else:
            self.io.bind_input(name, where[0], where[1], NUMPY_DTYPES[dtype], shape, address)

    def refresh(self) -> None:
        """Before a call: where the session copies inputs at the bind (`rebind`), bind every
        host input again, so the copy is of what the host wrote since."""
        if self.rebind:
            for name, (dtype, shape, address) in self.inputs.items():
                self._bind(name, dtype, shape, address, output=False)


class TwinBinding:
    """Two IOBindings of one session that bind every name alike but for pairs bound crossed over
    (`bind_crossed`): side 0 reads the first buffer and writes the second, side 1 the other way
    round. A call runs one side (`io`) and `turn` picks the other, so what a call writes is the
    next call's input without a bind made (a bind right after a graph call costs 10-15 us on
    this CPU: rebinding the pair each call cost more than the host copy it saved). Bindings of
    other call shapes that cross the same buffers share the side (`turns`, a one-item list), so
    the next call reads what the last one wrote whichever shape it has."""

    def __init__(self, session: ort.InferenceSession):
        self.sides = [Binding(session), Binding(session)]
        self.turns = [0]       # replaced by a shared list where other bindings cross the same buffers

    @property
    def side(self) -> int:
        return self.turns[0]

    @property
    def io(self) -> ort.IOBinding:
        return self.sides[self.side].io

    def bind(self, *args, **kwargs) -> None:
        for side in self.sides:
            side.bind(*args, **kwargs)

    def bind_crossed(self, given: str, handed: str, first: torch.Tensor, second: torch.Tensor) -> None:
        """Input `given` and output `handed`: side 0 reads `first`, writes `second`; side 1 the reverse."""
        for side, (read, written) in zip(self.sides, ((first, second), (second, first))):
            side.bind(given, read)
            side.bind(handed, written, output=True)

    def turn(self) -> None:
        self.turns[0] = 1 - self.turns[0]

    def refresh(self) -> None:
        self.sides[self.side].refresh()


def bind_past(binding: Binding | TwinBinding, cache, slots: range, width: int, layer: int, names: tuple[str, ...]) -> None:
    """Bind the past rows of `layer` in place: [b, Hkv, width, D] of the cache's own memory, by
    address (a block of slots is contiguous when width is every row of the cache, as a
    contiguous-past backend binds it, or empty, as a prefill does). names: (past key, past
    value), and for a graph that writes its new rows into the past (in place) its present key
    and value outputs, bound to the same memory."""
    _, L, B, H, S, D = cache.shape
    if width not in (0, S):
        raise ValueError(f"a past of {width} of the cache's {S} rows is not contiguous: bind all or none")
    size = cache.kv.element_size()
    for kv, name in enumerate(names):
        at = cache.kv.data_ptr() + (((kv % 2 * L + layer) * B + slots.start) * H * S * D) * size
        binding.bind(name, cache.kv, [len(slots), H, width, D], at, output=kv >= 2)


class Bound:
    """One call shape's binding: the KV past / new-row bindings, and every other input and output
    as a preallocated tensor bound by address (`buffers`): a call copies its small inputs into
    place and the graph writes its outputs into the same tensors each time, so a call makes no
    bindings and allocates nothing. Outputs are therefore valid until the backend's next call
    of the same shape (the decoder copies what it keeps, the accepted rows' states, except an
    iteration graph's hand-off, which has buffers of its own: OrtIteration)."""

    def __init__(self, binding: Binding | TwinBinding, staged: list):
        self.binding = binding
        # per KV cache the call writes, [2, L, b, Hkv, T, D] (new K, new V) where the cache
        # commits from: numpy views where the cache commits through numpy (KVCache.kv_np), else
        # tensors on the cache's device
        self.staged_all = staged
        self.staged = self.staged_all[0]
        self.buffers: dict[str, torch.Tensor] = {}
        self.arrays: dict[str, np.ndarray] = {}      # the same memory as numpy arrays
        self.layout: tuple | None = None             # the cache layout its past inputs are bound to
        self.tree = None                             # a drafter's DraftTree over its output buffers (draft_tree)
        self.mask_lengths: list[int] | None = None   # the committed lengths the target's mask shows (verify)
        self.handoff: list[tuple[np.ndarray, ...]] = []   # OrtIteration: per side, the drafter inputs it reads

    @property
    def io(self) -> ort.IOBinding:
        return self.binding.io

    def draft_tree(self, prefix: str = "") -> DraftTree:
        """The drafter graph's trees over this binding's output buffers (names `prefix` + name),
        made once where float32 scores let the tree be views valid for every call."""
        if self.tree is None:
            tree = tree_from_outputs(self.buffers, self.arrays, prefix)
            if tree.scores is not self.buffers[prefix + "tree_scores"]:   # converted scores: made per call
                return tree
            self.tree = tree
        return self.tree

    def buffer(self, name: str, dtype: torch.dtype, shape: list[int], output: bool,
               device: torch.device | None = None) -> torch.Tensor:
        """device: a GPU for an output the host does not read as it is (the logits, where the
        graph accepts greedily), so it never crosses; else host memory, with a numpy view."""
        # inputs zeroed: a value the caller never writes reads as 0, not as leftover memory
        buf = self.buffers[name] = (torch.empty if output else torch.zeros)(shape, dtype=dtype, device=device)
        if buf.device.type == "cpu":
            self.arrays[name] = buf.numpy()
        self.binding.bind(name, buf, output=output)
        return buf

    def feed(self, **inputs) -> None:
        """Copy inputs (tensors, or lists of ids and lengths) into place. Lists go through numpy:
        a small write costs about a microsecond there, against 5-30 for making a tensor of them
        on a CPU whose caches a graph call has just flushed."""
        for name, value in inputs.items():
            if isinstance(value, torch.Tensor):
                self.buffers[name].copy_(value)
            else:
                self.arrays[name][...] = value


class Bindings:
    """Bindings kept from call to call, one per call shape (slots, new rows, and `extra`, e.g.
    the rows that get logits): the new-KV outputs of every cache layer and the call's other
    inputs and outputs (`Bound.buffers`) are bound once per shape instead of once per call
    (rebinding through Python was most of an iteration's host work). The past inputs (2L for
    the target, 2 for the drafter) and the buffers sized by the past's width are bound again
    only when the cache is re-laid out (`width_buffers(bound, b, T, width)`), not the whole
    entry: continuous batching re-lays the cache out at every chunk of rows. The least
    recently used entry goes when `keep` are held. Calls of more than `keep_rows` new rows
    (prefills, drafter catch-ups: shapes that rarely come back) are bound for the call and not
    kept, so they do not push out the decoding shapes (8 continuously batched streams meet
    ~40: batch 1-8 x 1-5 rows as the cost model varies the nodes). kv_names: per cache layer, the
    graph's (past key, past value, new key, new value) names. buffers(bound, b, T, *extra)
    makes the other buffers. in_place: the first cache's graph writes its new rows into its past
    (the fused-attention target graph): its new key / value outputs are bound to the past's
    memory, and it has no staging block (Bound.staged None)."""

    def __init__(self, session: ort.InferenceSession, kv_names: list[list[tuple[str, str, str, str]]], buffers,
                 width_buffers=None, keep: int = 16, keep_rows: int = 16, twin: bool = False, in_place: bool = False):
        self.session, self.kv_names, self.keep, self.keep_rows = session, kv_names, keep, keep_rows
        self.in_place = in_place
        self.twin = twin                      # TwinBinding entries (OrtIteration's hand-off)
        self.make_buffers, self.make_width_buffers = buffers, width_buffers
        self.entries: dict[tuple, Bound] = {}
        self.made = self.rebound = 0          # entries made, entries whose past was bound again (profiling)

    def empty_copy(self) -> "Bindings":
        return Bindings(self.session, self.kv_names, self.make_buffers, self.make_width_buffers, self.keep,
                        self.keep_rows, self.twin, self.in_place)

    def get(self, slots: range, caches: list[tuple], *extra: int) -> Bound:
        """The binding of a call over `slots` with, per KV cache the graph reads (kv_names' order),
        (cache, new rows T, past width)."""
        key = (slots.start, slots.stop, *(T for _, T, _ in caches), *extra)
        layout = tuple((width, cache.layout_id) for cache, _, width in caches)
        entry = self.entries.pop(key, None)
        if entry is None:
            if len(self.entries) >= self.keep:
                self.entries.pop(next(iter(self.entries)))
            binding, stagings = (TwinBinding if self.twin else Binding)(self.session), []
            for c, ((cache, T, _), names) in enumerate(zip(caches, self.kv_names)):
                if self.in_place and c == 0:     # written into the past, bound with it below
                    stagings.append(None)
                    continue
                _, _, _, H, _, D = cache.shape
                staging = torch.empty((2, len(names), len(slots), H, T, D), dtype=cache.dtype, device=cache.kv.device)
                shape, at, step = [len(slots), H, T, D], staging.data_ptr(), staging[0, 0].nbytes
                for i, (_, _, new_k, new_v) in enumerate(names):    # [2, L] blocks of `step` bytes
                    binding.bind(new_k, staging, shape, at + i * step, output=True)
                    binding.bind(new_v, staging, shape, at + (len(names) + i) * step, output=True)
                stagings.append(staging.numpy() if cache.kv_np is not None else staging)
            entry = Bound(binding, stagings)
            self.make_buffers(entry, len(slots), *(T for _, T, _ in caches), *extra)
            self.made += 1
        if entry.layout != layout:      # a new entry, or a cache re-laid out since its last call
            self.rebound += 1
            old = entry.layout or (None,) * len(caches)
            for c, ((cache, _, width), names, now, was) in enumerate(zip(caches, self.kv_names, layout, old)):
                if now != was:          # only the caches that moved: the target's 2L pasts stay bound
                    for i, kv in enumerate(names):   # when the drafter's grows
                        bind_past(entry.binding, cache, slots, width, i, kv if self.in_place and c == 0 else kv[:2])
            if self.make_width_buffers is not None and layout[0] != old[0]:
                _, T, width = caches[0]
                self.make_width_buffers(entry, len(slots), T, width)
            entry.layout = layout
        if max(T for _, T, _ in caches) <= self.keep_rows:
            self.entries[key] = entry   # most recently used last
        return entry


