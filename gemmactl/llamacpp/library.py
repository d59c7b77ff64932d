"""One set of kernels everywhere: point llama-cpp-python at the active build's shared library.

llama-cpp-python loads `libllama.so` from `LLAMA_CPP_LIB_PATH` when that is set at import
time. A build made from the same llama-cpp-python version's bundled source has the same C API,
so one-shot runs get the kernels the servers use; any other build could differ in its API, so
it is skipped with a notice rather than risking a crash.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gemmactl.llamacpp.build import active_build
from gemmactl.llamacpp.source import bindings_version
from gemmactl.store import Store

ENV = "LLAMA_CPP_LIB_PATH"


@dataclass
class LibraryChoice:
    """Which libllama the in-process backend loads, and why."""

    lib_dir: str | None  # None: the library inside the llama-cpp-python package
    build_id: str | None = None
    notices: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.build_id:
            return f"build {self.build_id}"
        return f"{ENV}={self.lib_dir}" if self.lib_dir else "llama-cpp-python's own"


def select_library(store: Store) -> LibraryChoice:
    """Use the active build's library when it is safe to; say why when it is not."""
    build = active_build(store)
    if os.environ.get(ENV):
        if build is not None and os.environ[ENV] == build.lib_dir:  # chosen earlier in this process
            return LibraryChoice(build.lib_dir, build_id=build.build_id)
        return LibraryChoice(os.environ[ENV])
    if build is None:
        return LibraryChoice(None)
    installed = bindings_version()
    made_for = build.source.get("bindings_version")
    if made_for != installed:
        return LibraryChoice(None, notices=[
            f"the active llama.cpp build {build.build_id} is from {build.source.get('version')}, but the "
            f"installed llama-cpp-python is {installed}; using the bindings' own library. "
            "Run `gemmactl build` to make a matching build"
        ])
    if not (Path(build.lib_dir) / "libllama.so").exists():
        return LibraryChoice(None, notices=[f"the active build {build.build_id} has no libllama.so; using the bindings' own library"])
    if "llama_cpp" in sys.modules:
        # Already imported with whatever library it found; it cannot be swapped in this process.
        return LibraryChoice(None, notices=[f"llama_cpp was imported before the build {build.build_id} could be selected"])
    os.environ[ENV] = build.lib_dir
    return LibraryChoice(build.lib_dir, build_id=build.build_id)
