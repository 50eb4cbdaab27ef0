"""Streamed initializers: ONNX weight tensors that are computed when the artifact is written, not held.

A build whose weights stream (compiler/memory.py, `streaming_reason`) never holds the model's weights in
memory: capture traces a model whose large parameters have no values, lower_onnx puts a placeholder in the
graph for each of them (a TensorProto with dims and type whose external data location is
`STREAMED_LOCATION`), and the passes after it rewrite the graph around the placeholders. Where a pass
derives a tensor from weights (quantize_rtn's INT4 codes, quantize_fp8's E4M3 codes and scales,
lower_quant's MatMulNBits packing, fuse's QKV concatenation) it records the computation as a `Deferred`
array instead of running it. package then writes every initializer into model.onnx.data in the graph's
order, one at a time: a streamed one is computed
(read from the checkpoint, converted, quantized, packed), written and freed. The file layout is the one
onnx.save_model writes (same order, offsets and size threshold), so a streamed build and a loaded build
of the same recipe give the same bytes.

A `Deferred` keyed by `key` shares its result with the other tensors of the same computation (INT4 codes,
scales and zero points of one weight): the last few results are cached (`CACHE_ENTRIES`). Such tensors carry
the same `group`, so that save_model computes the group once, on one thread, and spends its other threads on
the next groups.

A result computed before package writes it (quantize_gptq's codes of one decoder layer, which need the
calibration activations of that layer) is `spill`ed: written to a .npy file in the build's spill folder
(`use_spill_folder`: beside the staging folder, removed by `reset` and, after a killed build, by the next
build; a temporary folder outside a build) and read back when its turn comes, so no pass holds them all.
"""

from __future__ import annotations

import itertools
import shutil
import sys
import tempfile
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - onnx is imported where a graph is handled (not by the dry run)
    import onnx
    from onnx import TensorProto

STREAMED_LOCATION = "optimize-streamed"
# dtypes whose TensorProto raw_data is the array's little-endian bytes (numpy_helper.from_array)
_PLAIN = tuple(np.dtype(t) for t in (np.float32, np.float16, np.float64, np.uint8, np.int8, np.int32, np.int64))
CACHE_ENTRIES = 8  # computations kept (a fused QKV reads three weights, each for three tensors)
# threads save_model computes streamed tensors on (numpy, torch and the C loops release the GIL), each one
# computation (group) ahead
WRITE_THREADS = 2

_ids = itertools.count(1)
_registry: dict[int, Deferred] = {}
_cache: OrderedDict[Any, Any] = OrderedDict()
_running: dict[Any, threading.Event] = {}  # keys being computed
_lock = threading.Lock()
_spill: Path | None = None  # the folder spilled arrays go to (created on first use)
_spill_created = False
_spilled = itertools.count(1)


def cached(key: Any, fn: Callable[[], Any]) -> Any:
    """fn() once per key while the key is among the last CACHE_ENTRIES computed. Thread-safe: save_model computes
    tensors on WRITE_THREADS threads, and a second caller of a key being computed waits for the first."""
    if key is None:
        return fn()
    while True:
        with _lock:
            if key in _cache:
                _cache.move_to_end(key)
                return _cache[key]
            running = _running.get(key)
            if running is None:
                running = _running[key] = threading.Event()
                break
        running.wait()  # computed by another thread: read from the cache (or computed again if evicted)
    try:
        value = fn()
        with _lock:
            _cache[key] = value
            while len(_cache) > CACHE_ENTRIES:
                _cache.popitem(last=False)
    finally:
        with _lock:
            del _running[key]
        running.set()
    return value


def as_torch(value: np.ndarray) -> Any:
    """torch.from_numpy of a computed array (no copy); bfloat16 (ml_dtypes, which torch does not read) through
    its bits."""
    import torch

    if value.dtype.name == "bfloat16":
        return torch.from_numpy(value.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(value)


class Deferred:
    """An array known by shape and dtype now and computed on demand by `fn` (cached under `key`). `rows(a, b)`,
    where given, computes rows a..b alone (a checkpoint tensor read a slice at a time): save_model writes a large
    such tensor in chunks of rows instead of whole. `group`: the cached computation this array is a part of
    (the INT4 codes, scales and zero points of one weight share one), or None: its own."""

    def __init__(self, shape: Iterable[int], dtype: Any, fn: Callable[[], np.ndarray], key: Any = None,
                 rows: Callable[[int, int], np.ndarray] | None = None, group: Any = None) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self._fn = fn
        self.key = key
        self.rows = rows
        self.group = group

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def compute(self) -> np.ndarray:
        value = np.asarray(cached(self.key, self._fn))
        if value.shape != self.shape or value.dtype != self.dtype:
            raise ValueError(f"streamed tensor computed as {value.dtype}{list(value.shape)}, "
                             f"declared {self.dtype}{list(self.shape)}")
        return value

    def astype(self, dtype: Any) -> Deferred:
        if np.dtype(dtype) == self.dtype:
            return self
        return Deferred(self.shape, dtype, lambda: self.compute().astype(dtype), group=self.group)

    def map(self, fn: Callable[[np.ndarray], np.ndarray], shape: Iterable[int], dtype: Any,
            key: Any = None) -> Deferred:
        return Deferred(shape, dtype, lambda: fn(self.compute()), key, group=self.group)


def concatenate(parts: list[Any], axis: int) -> Deferred:
    """np.concatenate of arrays and Deferreds, deferred."""
    shapes = [tuple(p.shape) for p in parts]
    ax = axis % len(shapes[0])
    shape = list(shapes[0])
    shape[ax] = sum(s[ax] for s in shapes)
    dtype = np.result_type(*[p.dtype for p in parts])

    def run() -> np.ndarray:
        return np.concatenate([p.compute() if isinstance(p, Deferred) else p for p in parts], axis=ax)

    groups = tuple(p.group for p in parts if isinstance(p, Deferred))  # a fused QKV's weights, scales: one group
    return Deferred(shape, dtype, run, group=groups if all(g is not None for g in groups) else None)


def reset() -> None:
    """Forget every streamed tensor and cached result and remove the spill folder (the end of a build)."""
    global _spill, _spill_created
    _registry.clear()
    _cache.clear()
    if _spill is not None and _spill_created:
        shutil.rmtree(_spill, ignore_errors=True)
    _spill, _spill_created = None, False


def use_spill_folder(path: Path) -> None:
    """Spill this build's arrays into `path` (created when the first is spilled, removed by `reset`)."""
    global _spill, _spill_created
    _spill, _spill_created = path, False


def spill_folder() -> Path:
    """The build's folder of spilled arrays (a new temporary folder where none was set)."""
    global _spill, _spill_created
    if _spill is None:
        _spill = Path(tempfile.mkdtemp(prefix="optimize-spill-"))
        _spill_created = True
    elif not _spill_created:
        _spill.mkdir(parents=True, exist_ok=True)
        _spill_created = True
    return _spill


def spill(array: np.ndarray, key: Any = None) -> Deferred:
    """`array` written to the spill folder; a Deferred that reads it back (not held in memory)."""
    path = spill_folder() / f"{next(_spilled)}.npy"
    array = np.ascontiguousarray(array)
    np.save(path, array, allow_pickle=False)
    return Deferred(array.shape, array.dtype, lambda: np.load(path, allow_pickle=False), key)


def register(value: Deferred) -> int:
    """The id a placeholder carries (its external data `offset`) for `value`."""
    sid = next(_ids)
    _registry[sid] = value
    return sid


def placeholder(value: Deferred, name: str) -> TensorProto:
    """The graph's stand-in for a streamed tensor: name, dims and element type, no data."""
    from onnx import TensorProto, helper

    t = TensorProto()
    t.name = name
    t.dims.extend(value.shape)
    t.data_type = helper.np_dtype_to_tensor_dtype(value.dtype)
    t.data_location = TensorProto.EXTERNAL
    for key, v in (("location", STREAMED_LOCATION), ("offset", str(register(value)))):
        entry = t.external_data.add()
        entry.key, entry.value = key, v
    return t


def is_streamed(t: TensorProto) -> bool:
    """Whether `t` is a placeholder (its data computed when the artifact is written)."""
    from onnx import TensorProto

    return (t.data_location == TensorProto.EXTERNAL and len(t.external_data) > 0
            and t.external_data[0].key == "location" and t.external_data[0].value == STREAMED_LOCATION)


def deferred_of(t: TensorProto) -> Deferred | None:
    """The Deferred behind a placeholder (None for a tensor that holds its data)."""
    if not is_streamed(t):
        return None
    sid = int({e.key: e.value for e in t.external_data}["offset"])
    if sid not in _registry:
        raise KeyError(f"streamed tensor {t.name!r}: its computation is gone (a finished build's graph)")
    return _registry[sid]


def array_of(t: TensorProto) -> np.ndarray:
    """The value of an initializer, computing a streamed one."""
    from onnx import numpy_helper

    d = deferred_of(t)
    return numpy_helper.to_array(t) if d is None else d.compute()


def value_of(t: TensorProto) -> Any:
    """A streamed initializer's Deferred (not computed), else the initializer's array."""
    from onnx import numpy_helper

    d = deferred_of(t)
    return numpy_helper.to_array(t) if d is None else d


def tensor(array: Any, name: str) -> TensorProto:
    """An initializer from an array (numpy_helper.from_array) or a placeholder from a Deferred. An array is
    stored as np.ascontiguousarray gives it, with at least one dimension (a scalar as [1]); a Deferred scalar
    (a per-tensor FP8 scale) is declared and written so too."""
    from onnx import numpy_helper

    if isinstance(array, Deferred):
        if array.ndim == 0:
            array = array.map(np.ascontiguousarray, (1,), array.dtype)
        return placeholder(array, name)
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


def stored_bytes(t: TensorProto) -> int:
    """Bytes the initializer's data takes in the artifact (int4 types packed two to a byte)."""
    from onnx import TensorProto, helper

    if is_streamed(t):
        count = int(np.prod(t.dims, dtype=np.int64))
        if t.data_type in (TensorProto.UINT4, TensorProto.INT4):
            return (count + 1) // 2
        return count * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return len(t.raw_data) if t.raw_data else int(np.prod(t.dims)) * 4


def streamed_count(model: onnx.ModelProto) -> int:
    return sum(1 for t in model.graph.initializer if is_streamed(t))


def checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy onnx.checker can read: each placeholder becomes a graph input of its type and shape (the
    checker wants external data in a file; the shapes are what it checks). `model` itself when it has none."""
    import onnx
    from onnx import helper

    if not any(is_streamed(t) for t in model.graph.initializer):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = [t for t in out.graph.initializer if not is_streamed(t)]
    inputs = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
              for t in out.graph.initializer if is_streamed(t)]
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep)
    out.graph.input.extend(inputs)
    return out


def _has_subgraph_initializers(graph: onnx.GraphProto) -> bool:
    for node in graph.node:
        for a in node.attribute:
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                if len(g.initializer) or _has_subgraph_initializers(g):
                    return True
    return False


# a streamed tensor of more bytes than this that can be read by rows (Deferred.rows: a float weight written as the
# checkpoint holds it, e.g. the embedding or a kept lm_head) is written in chunks of about this size
CHUNK_BYTES = 64 << 20


def written_in_chunks(d: Deferred) -> bool:
    """Whether save_model writes `d` a chunk of rows at a time (never holding it whole)."""
    return d.rows is not None and d.ndim >= 1 and d.dtype in _PLAIN and d.size * d.dtype.itemsize > CHUNK_BYTES


def save_model(model: onnx.ModelProto, path: Path, location: str, size_threshold: int = 1024) -> int:
    """Write `model` to `path` with its initializers in `location` beside it, computing each streamed one
    when its turn comes: the layout of onnx.save_model(save_as_external_data=True, all_tensors_to_one_file=True,
    convert_attribute=False). Returns the number of tensors computed. The streamed tensors are computed in the
    graph's order on WRITE_THREADS threads, at most WRITE_THREADS computations ahead of the one being written: a
    tensor whose group (`Deferred.group`) is already being computed is not given a thread of its own but read
    from the cache when its turn comes. A large tensor that can be read by rows (`written_in_chunks`) is written
    CHUNK_BYTES of rows at a time when its turn comes."""
    if _has_subgraph_initializers(model.graph):
        raise ValueError("save_model: initializers inside subgraphs are not written by the streaming writer")
    data_path = path.parent / location
    if data_path.exists():
        raise FileExistsError(f"External data file exists in {data_path}.")
    todo = deque(d for d in map(deferred_of, model.graph.initializer) if d is not None)
    # (tensor, its computation on a thread; None: a later part of a group computed for an earlier one)
    ahead: deque[tuple[Deferred, Future[Any] | None]] = deque()

    def value(d: Deferred) -> Any:  # an array, or the Deferred itself where it is written in chunks of rows
        return d if written_in_chunks(d) else np.ascontiguousarray(d.compute())

    with ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="streamed") as pool:
        def next_array() -> Any:
            while todo and sum(fut is not None for _, fut in ahead) <= WRITE_THREADS:
                d = todo.popleft()
                shared = d.group is not None and any(e.group == d.group for e, fut in ahead if fut is not None)
                ahead.append((d, None if shared else pool.submit(value, d)))
            d, fut = ahead.popleft()
            return value(d) if fut is None else fut.result()

        try:
            with data_path.open("wb") as f:
                computed = _write_initializers(model, f, location, size_threshold, next_array)
        finally:  # an error: nothing more is started
            todo.clear()
            for _, fut in ahead:
                if fut is not None:
                    fut.cancel()
    path.write_bytes(model.SerializeToString())
    return computed


def _write_rows(d: Deferred, name: str, f: Any) -> int:
    """`d`'s bytes appended to `f` a chunk of about CHUNK_BYTES of rows at a time; returns the bytes written."""
    row_bytes = max(1, d.size // max(d.shape[0], 1)) * d.dtype.itemsize
    step = max(1, CHUNK_BYTES // row_bytes)
    written = 0
    for a in range(0, d.shape[0], step):
        b = min(d.shape[0], a + step)
        chunk = np.ascontiguousarray(d.rows(a, b))  # type: ignore[misc]
        if chunk.shape != (b - a, *d.shape[1:]) or chunk.dtype != d.dtype:
            raise ValueError(f"streamed tensor {name!r}: rows {a}..{b} computed as {chunk.dtype}{list(chunk.shape)}, "
                             f"declared {d.dtype}{[b - a, *d.shape[1:]]}")
        f.write(memoryview(chunk).cast("B"))
        written += chunk.nbytes
        del chunk
    return written


def _write_initializers(model: onnx.ModelProto, f: Any, location: str, size_threshold: int,
                        next_array: Callable[[], Any]) -> int:
    """save_model's loop: each initializer's bytes appended to `f` in the graph's order, a streamed one's from
    `next_array()` (an array, or the Deferred itself where it is written in chunks of rows). Returns the number of
    streamed tensors."""
    from onnx import TensorProto, helper, numpy_helper

    computed = 0
    empty = sys.getsizeof(b"")
    for t in model.graph.initializer:
        d = deferred_of(t)
        if d is not None:
            arr = next_array()
            if isinstance(arr, Deferred):  # large and read by rows: never held whole
                if list(arr.shape) != list(t.dims) or helper.np_dtype_to_tensor_dtype(arr.dtype) != t.data_type:
                    raise ValueError(f"streamed tensor {t.name!r} is {arr.dtype}{list(arr.shape)}, declared "
                                     f"{list(t.dims)} type {t.data_type}")
                computed += 1
                offset = f.tell()
                length = _write_rows(arr, t.name, f)
                del t.external_data[:]
                t.data_location = TensorProto.EXTERNAL
                for key, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
                    entry = t.external_data.add()
                    entry.key, entry.value = key, v
                t.ClearField("raw_data")
                continue
            if arr.dtype in _PLAIN and arr.dtype.byteorder in "=|<":  # from_array's raw_data is these bytes
                dims, dtype = list(arr.shape), helper.np_dtype_to_tensor_dtype(arr.dtype)
                raw = memoryview(arr).cast("B")  # written from the array itself: no second copy
            else:  # types from_array converts (int4 packing, bfloat16, float8)
                full = numpy_helper.from_array(arr, t.name)
                dims, dtype, raw = list(full.dims), full.data_type, full.raw_data
                del full
            del arr
            if dims != list(t.dims) or dtype != t.data_type:
                raise ValueError(f"streamed tensor {t.name!r} computed as {dims} type {dtype}, declared "
                                 f"{list(t.dims)} type {t.data_type}")
            computed += 1
            del t.external_data[:]
            t.ClearField("data_location")
            if empty + len(raw) < size_threshold:
                t.raw_data = bytes(raw)
                continue
        elif t.HasField("raw_data") and sys.getsizeof(t.raw_data) >= size_threshold:
            raw = t.raw_data
        else:
            continue
        offset = f.tell()
        f.write(raw)
        del t.external_data[:]
        t.data_location = TensorProto.EXTERNAL
        for key, v in (("location", location), ("offset", str(offset)), ("length", str(len(raw)))):
            entry = t.external_data.add()
            entry.key, entry.value = key, v
        t.ClearField("raw_data")
        del raw
    return computed
