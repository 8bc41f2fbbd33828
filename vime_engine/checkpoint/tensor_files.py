"""Safetensors files written and read in one pass that also yields (or checks) their checksums.

A checkpoint's manifest needs every file's sha256 and xxh3-128, and a resume must check them. Hashing a file
after writing it, or before reading it, costs a second pass over gigabytes; here the sha256 (the slow one,
about 1.8 GB/s) runs on a second thread over the same buffers as the write, so it overlaps the I/O instead of
following it. A load checks the xxh3-128 (about 30 GB/s) where the manifest records it, the sha256 otherwise.

The files are standard safetensors (any safetensors reader loads them). Tensors are laid out by descending
element size so that every tensor starts aligned to its dtype, which lets `read_tensors` hand out views of
one read buffer instead of copies. Only finite values are written and read back (vime_engine/checkpoint/finite.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import xxhash

from vime_engine.checkpoint.finite import check_finite_load, nonfinite_tensors, refuse_nonfinite_save
from vime_engine.checkpoint.manifest import ChecksumMismatch, FileEntry, LoadCheck

_SLICE = 32 << 20  # write/read granularity: small enough for the hash thread to keep pace, large for syscalls

_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def _byte_view(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _slices(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, len(view), _SLICE):
        yield view[start:start + _SLICE]


def write_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
                  ) -> FileEntry:
    """Write `tensors` as a safetensors file, fsync it, and return its size and checksums (computed while writing).

    A NaN or inf in a floating-point tensor is refused (DivergenceError) before the file is opened."""
    refuse_nonfinite_save(path, nonfinite_tensors(tensors), len(tensors))
    ordered = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in ordered:
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # tensor data starts 8-aligned

    sha, fast, written = hashlib.sha256(), xxhash.xxh3_128(), 0
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as hasher:
        # The executor runs updates in submission order; the views stay alive in `pending` until it is done.
        # The slow sha256 runs there beside the writes; the fast xxh3 (a few percent of it) runs here.
        pending = []
        for buf in [memoryview(struct.pack("<Q", len(head)) + head)] + [_byte_view(t) for _, t in ordered]:
            for piece in _slices(buf):
                f.write(piece)
                pending.append(hasher.submit(sha.update, piece))
                fast.update(piece)
                written += len(piece)
        f.flush()
        os.fsync(f.fileno())
        for done in pending:
            done.result()
    return FileEntry(written, sha.hexdigest(), fast.hexdigest())


def read_tensors(path: str | Path, expected: FileEntry | None = None) -> dict[str, torch.Tensor]:
    """Read a safetensors file written by `write_tensors` into memory, checking `expected` in the same pass.

    Raises ChecksumMismatch (naming the file) before returning anything when the bytes differ, and
    NonFiniteCheckpoint when a floating-point tensor holds NaN or inf. The tensors are views of one buffer that
    lives as long as any of them.
    """
    path = Path(path)
    size = path.stat().st_size
    if expected is not None and size != expected.size:
        raise ChecksumMismatch(f"{path}: {size} bytes, the manifest says {expected.size}")
    buffer = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    check = LoadCheck.for_entry(expected) if expected is not None else None
    # Two readers copy slices out of the page cache in parallel (one kernel copy is slower than memory allows);
    # the checksum follows them here, slice by slice in file order.
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(max_workers=2) as readers:
        reads = [(piece, readers.submit(os.preadv, f.fileno(), [piece], start))
                 for start, piece in zip(range(0, size, _SLICE), _slices(view))]
        for piece, read in reads:
            if read.result() != len(piece):
                raise ChecksumMismatch(f"{path}: shorter than its own size while reading (changed underneath?)")
            if check is not None:
                check.hash.update(piece)
    if check is not None and not check.matches():
        raise ChecksumMismatch(f"{path}: {check.name} differs from the manifest (the file is corrupt)")

    (head_len,) = struct.unpack("<Q", bytes(view[:8]))
    header = json.loads(bytes(view[8:8 + head_len]))
    header.pop("__metadata__", None)
    data = buffer[8 + head_len:]
    out = {}
    for name, spec in header.items():
        begin, end = spec["data_offsets"]
        dtype = _DTYPES[spec["dtype"]]
        out[name] = data[begin:end].view(dtype).view(spec["shape"])
    check_finite_load(path, nonfinite_tensors(out))
    return out


class _TensorSlot(str):
    """Marks where a tensor stood in a nested state that was split by `split_tensors`."""


def split_tensors(state: object, prefix: str = "") -> tuple[object, dict[str, torch.Tensor]]:
    """A nested state (dicts, lists, tuples) → (the same structure with tensors replaced by slots, the tensors).

    Lets an optimizer's state go to a safetensors file while its small skeleton (param groups, step counts,
    RNG states) is pickled beside it.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: object, path: str) -> object:
        if isinstance(node, torch.Tensor):
            tensors[path] = node
            return _TensorSlot(path)
        if isinstance(node, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(node))
        return node

    return walk(state, prefix), tensors


def join_tensors(skeleton: object, tensors: Mapping[str, torch.Tensor]) -> object:
    """The inverse of `split_tensors`."""
    if isinstance(skeleton, _TensorSlot):
        return tensors[str(skeleton)]
    if isinstance(skeleton, dict):
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(join_tensors(v, tensors) for v in skeleton)
    return skeleton
