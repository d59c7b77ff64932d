"""llama.cpp toolchain: source, build, the shared library for the bindings, and the doctor."""
