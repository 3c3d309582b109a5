"""jaxcomp experiments: runners, benchmarks and demos (not part of the library API)."""
