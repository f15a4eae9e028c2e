"""Checkpoint files written around the page cache and hashed as written (checkpoint/direct_io.py): the bytes are
``torch.save``'s, the manifest entry is the file's, on a file system with and without ``O_DIRECT``, at every
length around the buffer and block boundaries; a failed write raises the OS's error and leaves nothing open."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import resource
import signal

import pytest
import torch

from llama_megatron.checkpoint import direct_io
from llama_megatron.checkpoint.direct_io import BUFFER_BYTES, save_direct


def _state(nbytes: int) -> dict:
    generator = torch.Generator().manual_seed(nbytes)
    return {"weight": torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=generator),
            "step": 7, "groups": [{"lr": 1e-4, "params": [0, 1]}]}


def _reference(obj) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


# around 4 KiB blocks and the 8 MiB buffer (two buffers: the second and the switch back to the first)
@pytest.mark.parametrize("nbytes", [0, 1, 4096 - 700, 4096, BUFFER_BYTES - 1500, BUFFER_BYTES,
                                    2 * BUFFER_BYTES + 4097, 3 * BUFFER_BYTES + 13])
def test_the_file_is_torch_saves_bytes_and_its_entry_is_the_files(tmp_path, nbytes) -> None:
    obj = _state(nbytes)
    path = tmp_path / "mp_rank_00_model_states.pt"
    entry = save_direct(obj, str(path))
    data = path.read_bytes()
    assert data == _reference(obj)
    assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert torch.equal(torch.load(path, weights_only=True)["weight"], obj["weight"])


def test_a_file_system_without_o_direct_gets_the_page_cache(tmp_path, monkeypatch) -> None:
    real_open = os.open
    opened = []

    def refusing(path, flags, *args):  # tmpfs: EINVAL for O_DIRECT at open
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        opened.append(flags)
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", refusing)
    obj = _state(BUFFER_BYTES + 123)
    out = direct_io.DirectFile(str(tmp_path / "f.pt"))
    torch.save(obj, out)
    entry = out.close()
    assert not out.direct and len(opened) == 1
    data = (tmp_path / "f.pt").read_bytes()
    assert data == _reference(obj) and entry["size"] == len(data)


def test_a_file_system_refusing_o_direct_writes_gets_the_page_cache(tmp_path, monkeypatch) -> None:
    """O_DIRECT taken at open, the first write refused (EINVAL): the flag is dropped and the file written whole."""
    real_write = os.write
    refused = []

    def refusing_once(fd, data):
        if not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct_io.os, "write", refusing_once)
    obj = _state(2 * BUFFER_BYTES + 777)
    out = direct_io.DirectFile(str(tmp_path / "f.pt"))
    torch.save(obj, out)
    entry = out.close()
    data = (tmp_path / "f.pt").read_bytes()
    assert refused and not out.direct
    assert data == _reference(obj) and entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_failed_write_raises_the_os_error_and_closes(tmp_path) -> None:
    """A file size limit (as a full disk: the write fails) raises EFBIG from ``torch.save``; no descriptor stays
    open and the next save in the process works."""
    fds = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (BUFFER_BYTES, hard))
    try:
        with pytest.raises(OSError) as failed:
            save_direct(_state(3 * BUFFER_BYTES), str(tmp_path / "big.pt"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert failed.value.errno == errno.EFBIG
    assert len(os.listdir("/proc/self/fd")) == fds
    assert save_direct(_state(100), str(tmp_path / "small.pt"))["size"] == len(_reference(_state(100)))
