"""GPU kernels (Triton). Imported only on CUDA; `TRITON_INTERPRET=1` runs them on CPU for tests."""
