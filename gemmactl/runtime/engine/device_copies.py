"""Asynchronous copies queued straight to the CUDA driver: the MoE step's many small row copies.

Between two pieces of a captured MoE step (runtime/engine/graph_moe.py) the host queues a copy for
each missed expert, and with prefetch one for each guessed one: about 460 a token on a 26B-A4B
shape with a uniform router, while the GPU waits for the host. torch's `copy_` costs 16.5 µs of
host time a call there under the profiler on an H100 machine (argument parsing, dispatch, a stream
switch around it, and an event its pinned-memory allocator records so the memory is not reused
while the copy runs); the driver's own `cuMemcpyAsync`, reached through ctypes, 7.5, which made
the step 1.31–1.41× faster (docs/benchmarks.md). It copies between addresses, so it is used only
for memory whose owner outlives every copy queued on it: the expert arena's pinned host rows and device rows, which live
as long as the model (runtime/engine/expert_arena.py). The driver is the one torch itself runs on
(libcuda, loaded by the CUDA runtime before any of this), and the stream handles are torch's.

No kernel here: a copy is the copy engine's work either way; only the host's cost differs.
`GEMMACTL_ENGINE_COPIES=torch` keeps torch's `copy_` (to measure), as does a machine where the
driver library cannot be opened.
"""

from __future__ import annotations

import ctypes
import os

COPIES_ENV = "GEMMACTL_ENGINE_COPIES"  # driver (default) | torch


class CopyError(RuntimeError):
    pass


class DriverCopies:
    """cuMemcpyAsync(dst, src, nbytes, stream) on addresses; unified addressing tells host from device."""

    def __init__(self, library: ctypes.CDLL):
        copy = library.cuMemcpyAsync
        copy.argtypes = (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
        copy.restype = ctypes.c_int
        self._copy = copy

    def __call__(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of nbytes from src to dst on stream (a cudaStream_t handle, as torch's
        Stream.cuda_stream). Raises CopyError with the driver's code where it refuses."""
        code = self._copy(dst, src, nbytes, stream)
        if code:
            raise CopyError(f"cuMemcpyAsync failed with CUDA driver error {code}")


def driver_copies() -> DriverCopies | None:
    """The driver's copies unless COPIES_ENV says torch (a measurement knob, like the engine's
    others: any other value is the default) or the driver library does not open; None means
    torch's copy_."""
    if os.environ.get(COPIES_ENV, "driver").strip().lower() == "torch":
        return None
    try:
        return DriverCopies(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None
