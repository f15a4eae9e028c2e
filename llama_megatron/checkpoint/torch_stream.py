"""``torch.save`` archives written one tensor at a time, so a whole state dict never has to sit in memory.

``torch.save`` under ``torch.serialization.skip_data()`` writes the complete archive (pickle, record layout,
alignment) but leaves every storage's bytes as empty space. We save placeholders that way (``torch.empty``:
allocated address space that is never touched, so it costs no resident memory), then write each tensor's bytes
at its record's offset and patch the records' CRC-32s in the data descriptor and central directory. The result is
an ordinary torch zip archive: ``torch.load(weights_only=True, mmap=True)`` and ``zipfile.testzip()`` accept it.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

TensorSpec = tuple[tuple[int, ...], torch.dtype]

_LOCAL_HEADER = b"PK\x03\x04"
_CENTRAL_HEADER = b"PK\x01\x02"
_DATA_DESCRIPTOR = b"PK\x07\x08"
BLOCK_BYTES = 16 * 2**20


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's raw bytes without a copy (a copy only if it is not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


_staging: list[torch.Tensor] = []


def _staging_buffer() -> torch.Tensor:
    # One buffer for every copy: fresh ~MB-sized temporaries per tensor fragment the malloc heap, whose freed
    # pages stay resident, and resident memory would creep up by tens of MB over a conversion.
    if not _staging:
        _staging.append(torch.empty(BLOCK_BYTES, dtype=torch.uint8))
    return _staging[0]


def tensor_chunks(tensor: torch.Tensor, dtype: torch.dtype) -> Iterator[memoryview]:
    """Yield the bytes of ``tensor`` cast to ``dtype``: no copy when it is contiguous and of that dtype,
    otherwise (a cast, a column slice of a row-parallel weight) copied in row blocks through one reused 16 MB
    buffer, so no full-size temporary ever exists. Each chunk is valid until the next one is requested."""
    tensor = tensor.detach()
    if (tensor.dtype == dtype and tensor.is_contiguous()) or tensor.dim() == 0 or tensor.numel() == 0:
        yield tensor_bytes(tensor.to(dtype))
        return
    row_bytes = (tensor.numel() // tensor.shape[0]) * dtype.itemsize
    if row_bytes > BLOCK_BYTES:
        for row in tensor:
            yield tensor_bytes(row.to(dtype))
        return
    for block in tensor.split(BLOCK_BYTES // row_bytes):
        staged = _staging_buffer()[: block.numel() * dtype.itemsize].view(dtype).view(block.shape)
        staged.copy_(block)
        yield tensor_bytes(staged)


class StreamingTorchFile:
    """Write ``wrap({name: tensor})`` with ``torch.save`` layout, filling tensors one ``write`` at a time.

    ``spec`` fixes names, shapes and dtypes (and the order of the records) up front; ``wrap`` builds the saved
    object around the name -> tensor dict (it must add no tensors of its own).
    """

    def __init__(self, path: str, spec: dict[str, TensorSpec],
                 wrap: Callable[[dict[str, torch.Tensor]], Any] | None = None) -> None:
        self.path = path
        self.spec = dict(spec)
        placeholders = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in self.spec.items()}
        with torch.serialization.skip_data():
            torch.save(wrap(placeholders) if wrap else placeholders, path)
        del placeholders
        self._records = self._locate_records(path)
        self._crc: dict[str, int] = {}
        self._fh = open(path, "r+b")  # noqa: SIM115 - closed in close()

    def _locate_records(self, path: str) -> dict[str, tuple[int, int, int, int]]:
        """name -> (data offset, byte size, offset of its CRC in the local entry, in the central directory)."""
        with zipfile.ZipFile(path) as archive, open(path, "rb") as fh:
            infos = {info.filename: info for info in archive.infolist()}
            central = {}
            pos = archive.start_dir
            fh.seek(pos)
            while fh.read(4) == _CENTRAL_HEADER:
                fh.seek(pos + 28)
                name_len, extra_len, comment_len = struct.unpack("<HHH", fh.read(6))
                fh.seek(pos + 46)
                central[fh.read(name_len).decode()] = pos
                pos += 46 + name_len + extra_len + comment_len
                fh.seek(pos)
            data_infos = sorted((info for info in infos.values() if "/data/" in info.filename
                                 and info.filename.rsplit("/", 1)[1].isdigit()),
                                key=lambda info: int(info.filename.rsplit("/", 1)[1]))
            if len(data_infos) != len(self.spec):
                raise RuntimeError(f"{path}: {len(data_infos)} storage records for {len(self.spec)} tensors")
            records = {}
            for info, (name, (shape, dtype)) in zip(data_infos, self.spec.items()):
                nbytes = torch.Size(shape).numel() * dtype.itemsize
                if info.file_size != nbytes:  # storage keys follow pickling order, i.e. the spec's order
                    raise RuntimeError(f"{path}: record {info.filename} holds {info.file_size} bytes, "
                                       f"{name} needs {nbytes}")
                fh.seek(info.header_offset)
                header = fh.read(30)
                if header[:4] != _LOCAL_HEADER:
                    raise RuntimeError(f"{path}: bad local header for {info.filename}")
                flags = struct.unpack("<H", header[6:8])[0]
                name_len, extra_len = struct.unpack("<HH", header[26:30])
                data_offset = info.header_offset + 30 + name_len + extra_len
                local_crc = info.header_offset + 14
                if flags & 0x8:  # CRC lives in a data descriptor after the data (signature optional)
                    fh.seek(data_offset + nbytes)
                    local_crc = data_offset + nbytes + (4 if fh.read(4) == _DATA_DESCRIPTOR else 0)
                records[name] = (data_offset, nbytes, local_crc, central[info.filename] + 16)
        return records

    def write(self, name: str, *parts: torch.Tensor) -> None:
        """Fill ``name`` with the concatenation (along dim 0) of ``parts``, cast to the spec's dtype."""
        shape, dtype = self.spec[name]
        if name in self._crc:
            raise RuntimeError(f"{self.path}: {name} written twice")
        offset, nbytes, _, _ = self._records[name]
        self._fh.seek(offset)
        crc, written = 0, 0
        for part in parts:
            for data in tensor_chunks(part, dtype):
                crc = zlib.crc32(data, crc)
                self._fh.write(data)
                written += data.nbytes
        if written != nbytes:
            raise RuntimeError(f"{self.path}: {name} got {written} bytes for shape {tuple(shape)} {dtype}")
        self._crc[name] = crc

    def close(self) -> None:
        missing = [name for name in self.spec if name not in self._crc]
        if missing:
            self._fh.close()
            raise RuntimeError(f"{self.path}: tensors never written: {', '.join(missing[:5])}")
        for name, crc in self._crc.items():
            _, _, local_crc, central_crc = self._records[name]
            packed = struct.pack("<I", crc & 0xFFFFFFFF)
            for position in (local_crc, central_crc):
                self._fh.seek(position)
                self._fh.write(packed)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
