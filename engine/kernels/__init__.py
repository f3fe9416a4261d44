"""Triton kernels for the CUDA decode step, each beside the plain PyTorch function it must equal.

- `paged_attention`: one query per row against that row's keys in the paged KV cache.
- `kv_write`: the new token's keys and values into their cache slots.
- `sampling`: constraint mask, answer-marker suppression, temperature, top-p and the draw (or
  argmax) over the vocabulary in one kernel, with no host synchronisation.

Each module exposes `<name>_reference(...)` (PyTorch, any device) and `<name>_triton(...)` (the
kernel). The engine picks the kernels with `EngineConfig(triton_kernels=...)` (on by default on
CUDA, off on CPU). Modules here import triton, so they are imported only when kernels are used:
tests run them on CPU with `TRITON_INTERPRET=1` set before the import.
"""
