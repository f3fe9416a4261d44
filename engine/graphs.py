"""Decode and vision as static-shape steps, captured once per bucket as CUDA graphs.

A decode step of B rows runs in the smallest bucket >= B (1, 2, 4, 8, 16, 32, ..., max batch):
the step's inputs are copied into that bucket's fixed buffers, padding rows point at a scratch
KV page, a dummy token slot and a length of 1, and the forward writes its logits into a fixed
buffer whose first B rows are the step's. Attention reads each row's page table up to its own
length (`engine.kernels.paged_attention`), so the shapes never depend on the context length.

On CUDA each bucket's forward is captured once (after a warm-up on a side stream) and replayed;
`capture=False` runs the same static step eagerly, which is how CPU tests check the padding
and bucketing that the graphs replay. Graph replay must equal the eager static step.

The vision encoder is graphed the same way by crop-count bucket (`VisionGraphs`): crops attend
only within themselves, so padding crops never change the real ones.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch


def buckets(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class DecodeGraphs:
    """Static decode buffers per bucket; `run` fills them and replays (or runs) the forward.

    forward(slots_B, pos_B, write_B, pages_BP, lens_B) -> logits (B, V) must only read its
    inputs and the model's fixed tensors (weights, KV cache, last-token table).
    """

    def __init__(self, forward: Callable[..., torch.Tensor], max_batch: int, max_pages: int,
                 pad_slot: int, scratch_page: int, page_size: int, device: torch.device, capture: bool):
        self.forward, self.device, self.capture = forward, device, capture
        self.pad_slot, self.scratch_page, self.page_size = pad_slot, scratch_page, page_size
        self.max_pages = max_pages
        self.sizes = buckets(max_batch)
        self._static: dict[int, tuple] = {}
        self._graphs: dict[int, tuple] = {}
        self._pool = None

    def bucket(self, b: int) -> int:
        for size in self.sizes:
            if size >= b:
                return size
        raise ValueError(f"{b} decode rows exceed the largest bucket ({self.sizes[-1]})")

    def host_inputs(self, slots: list[int], positions: np.ndarray, write: np.ndarray,
                    page_tables: list[list[int]]) -> tuple[int, np.ndarray]:
        """The bucket and one int64 array [slots | pos | write | lens | pages] padded to it."""
        b = len(slots)
        n = self.bucket(b)
        packed = np.empty(n * (4 + self.max_pages), dtype=np.int64)
        s, p, w, ln = (packed[i * n:(i + 1) * n] for i in range(4))
        pages = packed[4 * n:].reshape(n, self.max_pages)
        s[:b], s[b:] = slots, self.pad_slot
        p[:b], p[b:] = positions, 0
        w[:b], w[b:] = write, self.scratch_page * self.page_size
        ln[:b], ln[b:] = positions + 1, 1
        pages.fill(self.scratch_page)
        for i, table in enumerate(page_tables):
            used = min(len(table), self.max_pages)
            pages[i, :used] = table[:used]
        return n, packed

    def _buffers(self, n: int) -> tuple:
        if n not in self._static:
            flat = torch.zeros(n * (4 + self.max_pages), dtype=torch.int64, device=self.device)
            views = tuple(flat[i * n:(i + 1) * n] for i in range(4)) + (flat[4 * n:].view(n, self.max_pages),)
            self._static[n] = (flat, views)
        return self._static[n]

    def run(self, n: int, packed: torch.Tensor) -> torch.Tensor:
        """Logits (n, V) of the step whose padded inputs are `packed` (on the device)."""
        flat, (slots, pos, write, lens, pages) = self._buffers(n)
        flat.copy_(packed, non_blocking=True)
        if not self.capture:
            return self.forward(slots, pos, write, pages, lens)
        if n not in self._graphs:
            self._graphs[n] = self._capture(slots, pos, write, pages, lens)
        graph, out = self._graphs[n]
        graph.replay()
        return out

    def _capture(self, *inputs) -> tuple:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture(self.forward, inputs, self.device, self._pool)


class VisionGraphs:
    """The vision encoder per crop-count bucket: crops (N, 3, C, C) -> features (N, patches, dim)."""

    def __init__(self, encode: Callable[[torch.Tensor], torch.Tensor], max_crops: int, crop_shape: tuple,
                 dtype: torch.dtype, device: torch.device, capture: bool):
        self.encode, self.device, self.capture = encode, device, capture
        self.sizes = buckets(max_crops)
        self.crop_shape, self.dtype = crop_shape, dtype
        self._static: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, tuple] = {}
        self._pool = None

    def run(self, crops: torch.Tensor) -> torch.Tensor:
        n = crops.shape[0]
        if n > self.sizes[-1]:  # more crops than the largest bucket: eager, not an error
            return self.encode(crops)
        size = next(b for b in self.sizes if b >= n)
        if size not in self._static:
            self._static[size] = torch.zeros((size, *self.crop_shape), dtype=self.dtype, device=self.device)
        static = self._static[size]
        static[:n].copy_(crops, non_blocking=True)  # rows past n keep older crops: never read back
        if not self.capture:
            return self.encode(static)[:n]
        if size not in self._graphs:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            self._graphs[size] = capture(self.encode, (static,), self.device, self._pool)
        graph, out = self._graphs[size]
        graph.replay()
        return out[:n]


def capture(fn: Callable[..., torch.Tensor], inputs: tuple, device: torch.device, pool) -> tuple:
    """(graph, output) of fn(*inputs) captured after a warm-up on a side stream."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks, the allocator settles
        for _ in range(2):
            fn(*inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a producer thread touching CUDA (a user's own code) must not break the capture.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn(*inputs)
    return graph, out
