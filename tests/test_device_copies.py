"""The driver's copies (runtime/engine/device_copies.py): chosen by GEMMACTL_ENGINE_COPIES, and on a
GPU machine a copy between the arena's kinds of memory lands as torch's would."""

from __future__ import annotations

import pytest
import torch

from gemmactl.runtime.engine import device_copies
from gemmactl.runtime.engine.device_copies import COPIES_ENV, CopyError, DriverCopies, driver_copies


class _Library:
    """A driver library's stand-in: records each call, answers with code."""

    def __init__(self, code: int = 0):
        self.calls, self.code = [], code
        library = self

        class Function:
            argtypes = restype = None

            def __call__(self, *args):
                library.calls.append(args)
                return library.code

        self.cuMemcpyAsync = Function()


def test_torch_asked_for_gives_no_driver_copies(monkeypatch):
    monkeypatch.setenv(COPIES_ENV, "torch")
    assert driver_copies() is None


def test_a_driver_that_does_not_open_gives_torch_copies(monkeypatch):
    monkeypatch.delenv(COPIES_ENV, raising=False)

    def refuse(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(device_copies.ctypes, "CDLL", refuse)
    assert driver_copies() is None


def test_a_copy_passes_addresses_size_and_stream_and_a_refusal_names_the_code():
    library = _Library()
    copy = DriverCopies(library)
    copy(4096, 8192, 3345408, 77)
    assert library.calls == [(4096, 8192, 3345408, 77)]
    library.code = 201
    with pytest.raises(CopyError, match="error 201"):
        copy(1, 2, 3, 0)


@pytest.mark.gpu
def test_gpu_driver_copies_land_as_torch_copies_do(monkeypatch):
    """Pinned host → device, device → device and a few int64s, queued on a side stream in order:
    the bytes torch would have copied, once the stream's event is waited for."""
    monkeypatch.delenv(COPIES_ENV, raising=False)
    copy = driver_copies()
    assert copy is not None, "libcuda.so.1 did not open on a GPU machine"
    host = torch.randint(0, 255, (3, 1 << 20), dtype=torch.uint8).pin_memory()
    device = torch.zeros((3, 1 << 20), dtype=torch.uint8, device="cuda")
    numbers = torch.tensor([5, 7, 11], dtype=torch.int64).pin_memory()
    target = torch.zeros(3, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    size = host.shape[1]
    copy(device[0].data_ptr(), host[2].data_ptr(), size, stream.cuda_stream)
    copy(device[1].data_ptr(), device[0].data_ptr(), size, stream.cuda_stream)  # after the one before
    copy(target.data_ptr(), numbers.data_ptr(), 3 * 8, stream.cuda_stream)
    done = torch.cuda.Event()
    done.record(stream)
    torch.cuda.current_stream().wait_event(done)
    assert torch.equal(device[0].cpu(), host[2]) and torch.equal(device[1].cpu(), host[2])
    assert not device[2].any()
    assert target.tolist() == [5, 7, 11]


def test_a_refused_driver_copy_and_those_after_it_go_through_torch(monkeypatch):
    """ExpertArena._copies: a driver call that fails queues nothing, so that copy and the rest are
    made by torch's copy_, and the arena keeps to torch's from then on (here the host's tensors
    stand in for the device's, and the driver is a stand-in that refuses its second call)."""
    import types

    from gemmactl.runtime.engine.expert_arena import ExpertArena

    calls = []

    def driver(dst, src, nbytes, stream):
        calls.append((dst, src, nbytes))
        if len(calls) == 2:
            raise CopyError("cuMemcpyAsync failed with CUDA driver error 201")

    device = [torch.zeros(4, dtype=torch.uint8) for _ in range(4)]
    host = [torch.full((4,), key + 1, dtype=torch.uint8) for key in range(3)]
    arena = types.SimpleNamespace(driver=driver, base=1 << 20, row_bytes=4, stream_handle=0,
                                  host_ptrs=[1 << 30, 2 << 30, 3 << 30], rows={(0, key): key for key in range(3)},
                                  device_rows=device, host_rows=host, stream=None, _compute_stream=lambda: None,
                                  cuda=True)
    arena._torch_copies = lambda *args, **kwargs: ExpertArena._torch_copies(arena, *args, **kwargs)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    ExpertArena._copies(arena, [((0, 0), 0), ((0, 1), 1), ((0, 2), 2), (2, 3)])
    assert calls == [((1 << 20) + 0, 1 << 30, 4), ((1 << 20) + 4, 2 << 30, 4)] and arena.driver is None
    assert not device[0].any()  # "queued" by the stand-in, which copies nothing
    assert torch.equal(device[1], host[1]) and torch.equal(device[2], host[2]) and torch.equal(device[3], host[2])
