"""save_model's scheduling of streamed tensors (compiler/streamed.py): the tensors of one computation (a group:
an INT4 weight's packed codes, scales and zero points) are computed once, on one thread, and the write threads
compute different groups at the same time; the bytes written are the arrays, in the graph's order."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx_model import make_model

from compiler import streamed


def test_write_threads_compute_different_groups_at_once(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    values = {g: [rng.standard_normal((32, 16 + i)).astype(np.float32) for i in range(3)] for g in "ABCD"}
    runs: Counter[str] = Counter()
    # the first two groups' computations meet here: they can only pass it if they run at the same time
    together = threading.Barrier(2, timeout=20)

    def computation(g: str) -> tuple[np.ndarray, ...]:
        runs[g] += 1
        if g in "AB":
            together.wait()
        return tuple(values[g])

    inits = []
    for g in "ABCD":
        for i in range(3):
            d = streamed.Deferred(values[g][i].shape, np.float32,
                                  lambda g=g, i=i: streamed.cached(("test", g), lambda: computation(g))[i],
                                  group=("test", g))
            inits.append(streamed.tensor(d, f"{g}{i}"))
    graph = helper.make_graph([], "g", [], [], initializer=inits)
    model = make_model(graph)
    try:
        written = streamed.save_model(model, tmp_path / "m.onnx", "m.onnx.data")
    finally:
        streamed.reset()
    assert written == 12
    assert runs == {"A": 1, "B": 1, "C": 1, "D": 1}  # a group's later tensors came from its one computation
    loaded = onnx.load(str(tmp_path / "m.onnx"))
    assert [t.name for t in loaded.graph.initializer] == [f"{g}{i}" for g in "ABCD" for i in range(3)]
    for t in loaded.graph.initializer:
        got = numpy_helper.to_array(t, base_dir=str(tmp_path))
        assert np.array_equal(got, values[t.name[0]][int(t.name[1])])


def test_concatenation_and_derived_arrays_keep_the_group() -> None:
    a = streamed.Deferred((2, 3), np.float32, lambda: np.zeros((2, 3), np.float32), group="qa")
    b = streamed.Deferred((4, 3), np.float32, lambda: np.zeros((4, 3), np.float32), group="qb")
    loose = streamed.Deferred((1, 3), np.float32, lambda: np.zeros((1, 3), np.float32))
    assert streamed.concatenate([a, b], 0).group == ("qa", "qb")
    assert streamed.concatenate([a, np.zeros((1, 3), np.float32)], 0).group == ("qa",)
    assert streamed.concatenate([a, loose], 0).group is None  # a part of no group: the join is its own
    assert a.astype(np.float16).group == "qa" and a.map(np.negative, (2, 3), np.float32).group == "qa"
