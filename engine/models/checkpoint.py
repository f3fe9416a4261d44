"""A memory-mapped, read-only view of a `.safetensors` file that loads one tensor at a time.

Format: an 8-byte little-endian header length N, N bytes of JSON
`{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the data.
The header is validated against the file before any tensor is read (a truncated or corrupt file is
a `ModelLoadError` naming what is wrong). After a tensor is copied out, its pages are released
from the mapping (MADV_DONTNEED), so loading bf16 weights as fp32 peaks at the fp32 model plus
one tensor, not the model plus the whole file.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
import warnings
from pathlib import Path

import torch

from ..errors import ModelLoadError

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
FLOAT_DTYPES = {"F32", "BF16", "F16"}
MAX_HEADER_BYTES = 100_000_000
LFS_POINTER = b"version https://git-lfs"  # how a Git LFS pointer file begins


def lfs_pointer(path: Path) -> bool:
    """A Git LFS pointer (a few lines of text) where a file's data should be: a model repository
    cloned without git-lfs."""
    try:
        with open(path, "rb") as f:
            return f.read(len(LFS_POINTER)) == LFS_POINTER
    except OSError:
        return False


class Checkpoint:
    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
        except OSError as e:
            raise ModelLoadError(f"cannot open {self.path}: {e.strerror}") from None
        try:
            self._entries = self._parse_header()
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except BaseException:
            self._file.close()
            raise

    def _fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path} is not a readable safetensors file: {what}")

    def _parse_header(self) -> dict[str, dict]:
        size = self.path.stat().st_size
        head = self._file.read(8)
        if len(head) < 8:
            raise self._fail(f"only {size} bytes, too short for a header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            if lfs_pointer(self.path):  # had been "header length 2336927755350992246 runs past the end"
                raise self._fail("it is a Git LFS pointer, not the weights (cloned without git-lfs? "
                                 "run git lfs pull there)")
            raise self._fail(f"header length {n} runs past the end of the file ({size} bytes)")
        # A corrupt length within the file read the whole file to say so (7-8 GB for Moondream 2's);
        # the safetensors library refuses headers over this too.
        if n > MAX_HEADER_BYTES:
            raise self._fail(f"header length {n} is over {MAX_HEADER_BYTES} bytes (corrupt)")
        try:
            header = json.loads(self._file.read(n))
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an int of over 4300 digits
            raise self._fail(f"corrupt header ({e})") from None
        except RecursionError:  # JSON nested thousands deep
            raise self._fail("corrupt header (nested too deep)") from None
        if not isinstance(header, dict):
            raise self._fail("corrupt header (not a JSON object)")
        header.pop("__metadata__", None)
        self._data_start = 8 + n
        data_size = size - self._data_start
        spans = []
        for key, e in header.items():
            # Every field of the type the format says: offsets of "10" or 10.0, or a dtype given as
            # a list, had been tracebacks (str - str, unhashable list, frombuffer's count).
            if not (isinstance(e, dict) and isinstance(e.get("dtype"), str) and _ints(e.get("shape"))
                    and _ints(e.get("data_offsets")) and len(e["data_offsets"]) == 2):
                raise self._fail(f"corrupt header entry for {key}")
            dtype, shape, (begin, end) = e["dtype"], e["shape"], e["data_offsets"]
            if dtype not in DTYPES:
                raise self._fail(f"weight {key} has unknown dtype {dtype}")
            if end - begin != math.prod(shape) * DTYPES[dtype].itemsize or begin < 0 or min(shape, default=0) < 0:
                raise self._fail(f"header entry for {key} does not match its shape and dtype")
            if end > data_size:
                raise self._fail(f"file is truncated: weight {key} ends at byte {self._data_start + end}, "
                                 f"the file has {size}")
            if end > begin:
                spans.append((begin, end, key))
        spans.sort()
        for (_, end, key), (begin, _, other) in zip(spans, spans[1:]):
            if begin < end:  # two weights reading the same bytes: not a file any writer makes
                raise self._fail(f"weights {key} and {other} overlap")
        return header

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entries[key]["shape"])

    def dtype_name(self, key: str) -> str:
        return self._entries[key]["dtype"]

    def read(self, key: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The tensor converted to dtype on device; its file pages are released afterwards."""
        e = self._entries[key]
        begin, end = (self._data_start + o for o in e["data_offsets"])
        src = DTYPES[e["dtype"]]
        if end == begin:
            return torch.empty(self.shape(key), dtype=dtype, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: we copy out before anyone writes
            raw = torch.frombuffer(self._map, dtype=src, count=(end - begin) // src.itemsize, offset=begin)
        out = raw.view(self.shape(key)).to(device=device, dtype=dtype, copy=True)
        del raw
        self._release(begin, end)
        return out

    def _release(self, begin: int, end: int) -> None:
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start = begin - begin % page
        try:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass  # an optimisation only

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the GC closes it later
            pass
        self._file.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ints(value) -> bool:
    """A JSON list of integers (true and false are not)."""
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
