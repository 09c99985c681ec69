"""Reading a safetensors file by rows, with plain reads instead of mapping the file.

`safetensors.safe_open` maps the whole file into memory; pages are only read when touched,
but the mapping takes the file's size of address space, and a published checkpoint's
file is several GB. A rank under an address-space limit (`ulimit -v`, what schedulers and
the tests set) cannot map it, however few of its rows the rank needs. The format is
simple enough to read directly: an 8-byte little-endian header length, a JSON header
giving each tensor's dtype, shape and byte range, then the tensors, C-contiguous. Rows
[a, b) of a tensor are one contiguous byte range, read here into a buffer of that size.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class TensorFile:
    """One open safetensors file: each tensor's shape, and any run of its dim-0 rows."""

    def __init__(self, path: Path):
        self.path = path
        self.file = open(path, "rb")
        try:
            (length,) = struct.unpack("<Q", self.file.read(8))
            header = json.loads(self.file.read(length))
            header.pop("__metadata__", None)
        except (struct.error, ValueError, AttributeError) as err:
            self.file.close()
            raise ValueError(f"{path.name} is not a safetensors file ({type(err).__name__}: {err})") from None
        self.entries = header
        self.data_start = 8 + length

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> list[int]:
        return list(self.entries[name]["shape"])

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name`, in its stored dtype (a new tensor)."""
        entry = self.entries[name]
        dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
        row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
        out = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
        self.file.seek(self.data_start + entry["data_offsets"][0] + start * row_bytes)
        if self.file.readinto(out.numpy()) != out.numel():
            raise ValueError(f"{self.path}: {name} ends before its rows {start}:{stop}")
        return out.view(dtype).view(stop - start, *shape[1:])

    def read(self, name: str) -> torch.Tensor:
        shape = self.shape(name)
        return self.read_rows(name, 0, shape[0]) if shape else self.read_rows(name, 0, 1).view(())

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
