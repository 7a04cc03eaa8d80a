"""Streaming safetensors IO: lazy reads of one tensor at a time, shards written as tensors arrive.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the
header), then the raw little-endian bytes. Headers are parsed here and checked against the file
size (truncation is found before any merging). A float tensor is read through ``mx.load``, whose
arrays are lazy: only the tensor asked for is read, straight into its array; other dtypes with one
``os.pread`` into a reused buffer (a same-width integer view for the bytes). No memory map (its
pages would count against the resident set), no other framework (``safetensors.numpy`` cannot
represent bfloat16).

Writing plans every output tensor (name, dtype, shape) up front, so every shard's header and every
tensor's byte offset are known before the first byte: the headers are written first and each
tensor's bytes are ``pwrite``-n at their place as soon as the tensor is merged, in any order (so
several threads can merge at once). Nothing holds a whole shard in memory.

Every structural problem (short file, header length past the end, bad JSON, offsets outside the
data area or overlapping, a byte count that does not match dtype x shape, an index that names a
missing shard) is a :class:`UserError` naming the file and, where it applies, the tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from mlx_ssp.errors import UserError
from mlx_ssp.io import parse_json, read_json

#: safetensors dtype code -> (itemsize, numpy dtype used to carry the raw bytes, mlx dtype name)
DTYPES: dict[str, tuple[int, str, str]] = {
    "F32": (4, "<f4", "float32"),
    "F16": (2, "<f2", "float16"),
    "BF16": (2, "<u2", "bfloat16"),  # carried as uint16, reinterpreted with mx.view
    "F64": (8, "<f8", "float64"),
    "I64": (8, "<i8", "int64"),
    "U32": (4, "<u4", "uint32"),  # mlx's packed quantized weights (:mod:`.quant`)
    "I32": (4, "<i4", "int32"),
    "I16": (2, "<i2", "int16"),
    "I8": (1, "<i1", "int8"),
    "U8": (1, "<u1", "uint8"),
    "BOOL": (1, "<u1", "bool"),
}
FLOAT_CODES = {"F32", "F16", "BF16", "F64"}
#: mlx/numpy dtype name -> safetensors code
CODE_OF = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset in file
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, absolute offset of the data area). Errors name the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise UserError(f"{path}: corrupt safetensors file (shorter than the 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or 8 + n > size:
                raise UserError(f"{path}: corrupt or truncated safetensors file (header length {n} exceeds file size {size})")
            text = f.read(n)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    header = parse_json(text, f"{path}: corrupt safetensors header")
    if not isinstance(header, dict):
        raise UserError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, 8 + n


def _is_count(x) -> bool:
    """A JSON non-negative integer (``true`` is not one, though Python's bool is an int)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_entry(path: Path, name: str, meta) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype code, shape, begin, end) of one header entry, each checked: a known dtype, every dim
    a non-negative integer, two integer offsets in order, and dtype x shape bytes between them."""
    if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= meta.keys():
        raise UserError(f"{path}: corrupt safetensors header entry for tensor '{name}' "
                        "(expected an object with dtype, shape and data_offsets)")
    code, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(code, str) or code not in DTYPES:
        raise UserError(f"{path}: tensor '{name}' has unsupported dtype {code!r}")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise UserError(f"{path}: corrupt safetensors header: tensor '{name}' has shape {shape!r} "
                        "(each dimension must be a non-negative integer)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(x) for x in offsets) \
            or offsets[0] > offsets[1]:
        raise UserError(f"{path}: corrupt safetensors header: tensor '{name}' has data_offsets {offsets!r} "
                        "(expected [begin, end], integers with 0 <= begin <= end)")
    begin, end = offsets
    want = math.prod(shape) * DTYPES[code][0]  # exact: a numpy product could overflow to a match
    if end - begin != want:
        raise UserError(f"{path}: corrupt safetensors file: tensor '{name}' has {end - begin} bytes, "
                        f"expected {want} for {code}{shape}")
    return code, tuple(shape), begin, end


def scan_file(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file, each header entry checked (:func:`check_entry`), and
    against the file: within its size (truncation), no two tensors overlapping."""
    header, data_start = read_header(path)
    size = path.stat().st_size
    out: dict[str, TensorInfo] = {}
    spans = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        code, shape, begin, end = check_entry(path, name, meta)
        if data_start + end > size:
            raise UserError(
                f"{path}: truncated safetensors file: tensor '{name}' ends at byte {data_start + end}, "
                f"file has {size}"
            )
        spans.append((begin, end, name))
        out[name] = TensorInfo(name, code, shape, path, data_start + begin, end - begin)
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise UserError(f"{path}: corrupt safetensors file: tensors '{n0}' and '{n1}' overlap")
    return out


def scan_model(model_dir: Path) -> dict[str, TensorInfo]:
    """All tensors of a model directory (single file or sharded with an index)."""
    index = model_dir / "model.safetensors.index.json"
    tensors: dict[str, TensorInfo] = {}
    if index.is_file():
        data = read_json(index, f"{index}: corrupt index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f == Path(f).name for f in weight_map.values()):
            raise UserError(f"{index}: corrupt index (expected JSON with a 'weight_map' object of shard file names)")
        files = sorted(set(weight_map.values()))
        for fname in files:
            p = model_dir / fname
            if not p.is_file():
                raise UserError(f"{index}: names shard '{fname}' which does not exist")
            found = scan_file(p)
            for name, info in found.items():
                if name in tensors:
                    raise UserError(f"{model_dir}: tensor '{name}' appears in two shards")
                tensors[name] = info
        for name, fname in weight_map.items():
            info = tensors.get(name)
            if info is None or info.file.name != fname:
                raise UserError(f"{index}: tensor '{name}' is listed in '{fname}' but not stored there")
        return tensors
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir}: no *.safetensors weights")
    for p in files:
        for name, info in scan_file(p).items():
            if name in tensors:
                raise UserError(f"{model_dir}: tensor '{name}' appears in two files")
            tensors[name] = info
    return tensors


_TLS = threading.local()  # one read buffer per merging thread


def _read_buffer(n: int) -> memoryview:
    buf = getattr(_TLS, "buf", None)
    if buf is None or buf.size < n:
        buf = _TLS.buf = np.empty(n, dtype=np.uint8)
    return memoryview(buf)[:n]


_LAZY_CODES = ("F32", "F16", "BF16")


def read_tensor(info: TensorInfo):
    """Read one tensor as an ``mx.array`` of its stored dtype.

    Float tensors (the bulk) go through ``mx.load``, whose arrays are lazy: only the one asked for
    is read, straight into the array's memory (half the time of a pread into a buffer and a copy).
    Other dtypes: one pread into a reused buffer, then a copy. The file was checked against its
    header when it was scanned (:func:`scan_file`)."""
    import mlx.core as mx

    if info.dtype in _LAZY_CODES:
        try:
            a = mx.load(str(info.file))[info.name]
        except (RuntimeError, ValueError, KeyError) as e:
            raise UserError(f"{info.file}: cannot read tensor '{info.name}': {e}") from None
        if tuple(a.shape) != info.shape or a.dtype != getattr(mx, DTYPES[info.dtype][2]):
            raise UserError(f"{info.file}: tensor '{info.name}' changed since the merge was planned")
        return a
    itemsize, np_code, mx_name = DTYPES[info.dtype]
    # one reused read buffer: mx.array copies it, and a fresh large buffer per tensor would cost
    # zeroing plus a page fault per 4 KiB page
    buf = _read_buffer(info.nbytes)
    with open(info.file, "rb", buffering=0) as f:
        view = memoryview(buf)
        got = 0
        while got < info.nbytes:
            n = os.preadv(f.fileno(), [view[got:]], info.start + got)
            if n <= 0:
                raise UserError(f"{info.file}: truncated while reading tensor '{info.name}'")
            got += n
    arr = np.frombuffer(buf, dtype=np_code, count=info.nbytes // itemsize).reshape(info.shape)
    a = mx.array(arr)
    del arr
    if info.dtype == "BF16":
        a = a.view(mx.bfloat16)
    elif info.dtype == "BOOL":
        a = a.astype(mx.bool_)
    return a


def to_bytes(a):
    """Raw little-endian bytes of an ``mx.array`` (a zero-copy memoryview when possible)."""
    import mlx.core as mx

    if a.dtype == mx.bool_:
        a = a.astype(mx.uint8)
    mx.eval(a)
    try:
        return memoryview(a).cast("B")  # zero copy (row-contiguous arrays)
    except (TypeError, ValueError, BufferError):
        if a.dtype == mx.bfloat16:
            a = a.view(mx.uint16)
        return np.ascontiguousarray(np.asarray(a)).tobytes()


def mx_code(a) -> str:
    name = str(a.dtype).split(".")[-1]
    code = CODE_OF.get(name)
    if code is None:
        code = {"int64": "I64", "uint32": "U32", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}[name]
    return code


@dataclass
class PlannedTensor:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape) if self.shape else 1) * DTYPES[self.dtype][0]


class ShardedWriter:
    """Write planned tensors into shards of at most ``max_shard_bytes``, in any order.

    The plan fixes every offset, so all shard headers are written when the writer is created and
    :meth:`write` puts each tensor's bytes at its place with ``pwrite``: several threads may write
    at once (``pwrite`` needs no shared file position). ``close`` checks that every planned tensor
    was written once and writes the index."""

    def __init__(self, out_dir: Path, plan: list[PlannedTensor], max_shard_bytes: int, metadata: dict | None = None):
        self.out_dir = Path(out_dir)
        self.metadata = {"format": "pt", **(metadata or {})}
        shards: list[list[PlannedTensor]] = [[]]
        size = 0
        for t in plan:
            if shards[-1] and size + t.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(t)
            size += t.nbytes
        n = len(shards)
        self.names = [
            "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)
        ]
        self.shards = shards
        self.total_bytes = sum(t.nbytes for t in plan)
        self._where: dict[str, tuple[int, int, int]] = {}  # name -> (shard, file offset, nbytes)
        self._written: set[str] = set()
        self._lock = threading.Lock()
        self._fds: list[int] = []
        try:
            for si, shard in enumerate(shards):
                header: dict = {"__metadata__": self.metadata}
                off, offs = 0, []
                for t in shard:
                    header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
                    offs.append(off)
                    off += t.nbytes
                text = json.dumps(header, separators=(",", ":")).encode()
                text += b" " * (-len(text) % 8)  # align the data area to 8 bytes
                start = 8 + len(text)
                for t, a in zip(shard, offs):
                    self._where[t.name] = (si, start + a, t.nbytes)
                fd = os.open(self.out_dir / self.names[si], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                self._fds.append(fd)
                _pwrite_all(fd, struct.pack("<Q", len(text)) + text, 0)
                os.ftruncate(fd, start + off)  # full size now: a missing tensor reads as zeros, never short
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, data) -> None:
        """Write one tensor's bytes at its planned place (thread-safe). ``data`` is one buffer, or a
        list of buffers that are the tensor's bytes in order (written one after the other)."""
        where = self._where.get(name)
        if where is None:
            raise RuntimeError(f"writer: tensor {name} is not in the plan")
        si, off, nbytes = where
        pieces = data if isinstance(data, list) else [data]
        got = sum(memoryview(b).nbytes for b in pieces)
        if got != nbytes:
            raise RuntimeError(f"writer expected tensor {name} to be {nbytes} bytes, got {got}")
        with self._lock:
            if name in self._written:
                raise RuntimeError(f"writer: tensor {name} written twice")
            self._written.add(name)
        for b in pieces:
            _pwrite_all(self._fds[si], b, off)
            off += memoryview(b).nbytes

    def close(self) -> None:
        missing = [n for n in self._where if n not in self._written]
        if missing:
            raise RuntimeError(f"writer closed with {len(missing)} of {len(self._where)} tensors unwritten "
                               f"(first: {missing[0]})")
        self.abort()
        self.write_index()

    def write_index(self) -> None:
        """``model.safetensors.index.json`` (also for a skeleton: shards whose headers are written
        and whose tensors are left as zeros, as a dry run plans a later merge on them)."""
        weight_map = {t.name: self.names[si] for si, s in enumerate(self.shards) for t in s}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        """Close the shard files (what was written stays; the caller discards the directory)."""
        while self._fds:
            os.close(self._fds.pop())


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def parse_size(text: str | int) -> int:
    """'5GB', '500M', '2GiB', 1000000 -> bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().replace("IB", "B")
    units = {"K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9, "T": 1e12, "TB": 1e12, "B": 1}
    for u in sorted(units, key=len, reverse=True):
        if s.endswith(u):
            num = s[: -len(u)]
            break
    else:
        u, num = "B", s
    try:
        val = float(num) * units[u]
    except ValueError:
        raise UserError(f"bad size '{text}' (expected e.g. 5GB, 500MB or a byte count)") from None
    if val <= 0:
        raise UserError(f"size must be positive, got '{text}'")
    return int(val)


def iter_names(tensors: dict[str, TensorInfo]) -> Iterable[str]:
    """Tensor names in file order (shard, then offset): the order that reads sequentially."""
    return sorted(tensors, key=lambda n: (str(tensors[n].file), tensors[n].start))
