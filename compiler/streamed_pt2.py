"""The torch target's model.pt2 written with its weights streamed: the program and its weights, one tensor at a time.

A streamed build (compiler/streamed.py) exports a program whose large parameters and buffers have storage that
was never written (capture's deferred parameters, lower_quant_torch's INT4 / FP8 buffers): torch.export.save
would read every one of them into one `bytes`, touching the whole model. `save_program` writes the same pt2
archive (torch's PT2ArchiveWriter: the program JSON, the weights and constants configs, the sample inputs) but
each weight record of a deferred tensor is computed from its `Deferred` (read from the checkpoint, converted,
quantized, packed), written and freed before the next. Records, names, order and metadata are the ones
torch.export.save writes (its grouping of tensors that share storage included), so a streamed and a loaded build
of the same recipe give the same model.pt2, byte for byte (tests/test_build_memory.py).

The weights stay outside the program: models/model.json holds the graph, data/weights/ the raw tensor bytes
named by data/weights/model_weights_config.json, which is what runtime/pt2_check.py accepts (no pickles).
This uses torch's pt2 archive helpers (torch.export.pt2_archive, torch 2.8+); the byte-identity test fails if
torch.export.save's layout moves away from them.
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from compiler.streamed import Deferred

log = logging.getLogger(__name__)

MODEL_NAME = "model"  # torch.export.save's name for a single program


def deferred_by_storage(deferred: dict[str, tuple[int, Deferred]]) -> dict[int, Deferred]:
    """Storage address -> Deferred, from capture's / lower_quant_torch's `deferred_params`."""
    return {addr: d for addr, d in deferred.values()}


def save_program(exported: Any, path: Path, deferred: dict[int, Deferred]) -> int:
    """torch.export.save(exported, path), except that a weight whose storage address is in `deferred` is written
    from its Deferred's bytes, one at a time. The number of weights so written."""
    import torch
    from torch._export.serde.serialize import serialize, serialize_tensor_meta
    from torch.export.pt2_archive import _package as pkg
    from torch.export.pt2_archive._package import schema
    from torch.export.pt2_archive._package_weights import (
        TensorProperties,
        Weights,
        get_complete_tensor,
        group_weights,
    )
    from torch.export.pt2_archive.constants import (
        CONSTANTS_CONFIG_FILENAME_FORMAT,
        MODELS_FILENAME_FORMAT,
        SAMPLE_INPUTS_FILENAME_FORMAT,
        WEIGHT_FILENAME_PREFIX,
        WEIGHTS_CONFIG_FILENAME_FORMAT,
        WEIGHTS_DIR,
    )

    raw: dict[str, tuple[torch.Tensor, Any]] = {}
    for fqn, tensor in exported.state_dict.items():
        if not isinstance(tensor, torch.Tensor) or pkg._should_use_pickle(tensor):
            raise TypeError(f"model.pt2: weight {fqn} is not a plain tensor ({type(tensor).__name__}); the artifact "
                            "holds raw tensor bytes only")
        raw[fqn] = (tensor, TensorProperties(tensor))
    written = 0
    with pkg.PT2ArchiveWriter(os.fspath(path)) as archive:
        config: dict[str, Any] = {}
        weights = {MODEL_NAME: Weights(raw)}
        for idx, group in enumerate(group_weights(weights)):  # tensors that share storage: one record
            complete = get_complete_tensor(group, weights)
            path_name = f"{WEIGHT_FILENAME_PREFIX}{idx}"
            source = deferred.get(complete.untyped_storage().data_ptr())
            if source is None:
                archive.write_bytes(os.path.join(WEIGHTS_DIR, path_name), pkg._get_raw_tensor_bytes(complete))
            else:
                _write_deferred(archive, os.path.join(WEIGHTS_DIR, path_name), complete, source)
                written += 1
            for _, fqn in group:
                tensor, _ = weights[MODEL_NAME].get_weight(fqn)
                config[fqn] = schema.PayloadMeta(path_name=path_name, is_param=isinstance(tensor, torch.nn.Parameter),
                                                 use_pickle=False, tensor_meta=serialize_tensor_meta(tensor))
        pkg._package_payload_config(archive, schema.PayloadConfig(config=config),
                                    WEIGHTS_CONFIG_FILENAME_FORMAT.format(MODEL_NAME))
        constants = pkg._package_constants(MODEL_NAME, exported, archive)
        pkg._package_payload_config(archive, constants, CONSTANTS_CONFIG_FILENAME_FORMAT.format(MODEL_NAME))
        artifact = _program_only(serialize, exported)
        archive.write_bytes(MODELS_FILENAME_FORMAT.format(MODEL_NAME), artifact.exported_program)
        archive.write_bytes(SAMPLE_INPUTS_FILENAME_FORMAT.format(MODEL_NAME), artifact.example_inputs)
    return written


def _program_only(serialize: Any, exported: Any) -> Any:
    """serialize()'s program JSON and sample inputs without pickling the weights and constants into bytes (the
    archive holds neither: they are its raw records). Where serialize() has no switch for that (torch 2.11 has
    none, 2.13 has), it pickles both, which would read every deferred tensor and hold a second copy of the
    model; there the pickler it calls is stood in for, for dicts (the state dict and the constants; the sample
    inputs are a tuple), by one that writes nothing."""
    if "serialize_state_dict" in inspect.signature(serialize).parameters:
        return serialize(exported, None, serialize_state_dict=False, serialize_constants=False)
    from torch._export.serde import serialize as serde

    pickle = serde.serialize_torch_artifact
    serde.serialize_torch_artifact = lambda obj, *a, **k: b"" if isinstance(obj, dict) else pickle(obj, *a, **k)
    try:
        return serialize(exported, None)
    finally:
        serde.serialize_torch_artifact = pickle


def _write_deferred(archive: Any, name: str, tensor: Any, source: Deferred) -> None:
    """The record of a tensor whose storage was never written: its Deferred computed, checked against the tensor's
    shape and element size, written from the array's own memory (no copy into bytes), freed."""
    if not tensor.is_contiguous() or tensor.storage_offset() != 0 or \
            tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        raise ValueError(f"model.pt2 record {name}: a streamed weight must fill its storage (shape "
                         f"{list(tensor.shape)}, storage {tensor.untyped_storage().nbytes()} bytes)")
    value = np.ascontiguousarray(source.compute())
    if tuple(value.shape) != tuple(tensor.shape) or value.dtype.itemsize != tensor.element_size():
        raise ValueError(f"model.pt2 record {name}: computed {value.dtype}{list(value.shape)} for a "
                         f"{tensor.dtype}{list(tensor.shape)} weight")
    import torch

    storage = torch.from_numpy(value.reshape(-1).view(np.uint8)).untyped_storage()  # the array's memory, shared
    archive.archive_file.write_record(name, storage, value.nbytes)


__all__ = ["MODEL_NAME", "deferred_by_storage", "save_program"]
