"""Code the tests share (and the benchmarks reuse): model builders, a fake hub, checkpoint makers."""
