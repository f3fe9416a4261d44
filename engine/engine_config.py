"""How an `Engine` runs: plain frozen data, checked once when it is built (a bad value is a
`ConfigError` that names it). The model's own configuration is `engine.config.ModelConfig`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class EngineConfig:
    """How an `Engine` runs. `pipeline_depth` 2 overlaps host bookkeeping of step t with the
    device running step t+1; 1 is the blocking baseline (same code, commit after every step).
    `kv_pages` None sizes the pool for `max_batch_size` full-context sequences plus their images,
    on a CPU at most a quarter of the memory available at start (at least one such sequence).
    `cuda_graphs`: decode replayed as CUDA graphs by batch-size bucket (None: on CUDA; False is
    the eager fallback; CUDA only).
    `triton_kernels`: decode attention, KV write and sampling through the Triton kernels of
    `engine.kernels` (None: on CUDA only; on CPU they run only under TRITON_INTERPRET=1, for tests).
    `cpu_script`: the text decoder and vision encoder on CPU through TorchScript, without the GIL
    (a decode step is one call; None: on CPU unless Triton kernels are on; False is the eager
    path; see engine/scripted.py).
    `max_draft`: draft tokens a request submitted with `draft=` has verified per step (0: drafts
    are ignored; see engine/scheduler.py).
    `vision_thread`: encode images (vision encoder and projection) on a CPU thread of their own,
    beside the device thread, so that the two take two cores (None: on CPU; see
    engine/vision_stage.py).
    `lower_turn`: while requests of a higher priority keep waiting, one admission in `lower_turn`
    goes to the oldest waiting request of a lower priority (its image encoded first), so that batch
    work beside a live view is slowed, not stopped (0: strict priority; see engine/scheduler.py)."""

    model: str = "tiny"
    device: str = "cpu"
    dtype: str | None = None
    pipeline_depth: int = 2
    max_batch_size: int = 32
    kv_pages: int | None = None
    page_size: int = 16
    # Prompt tokens a step may prefill beside its decodes (prompts are chunked to fit). An image
    # prefix is never cut: Moondream's prefix attends both ways within itself, so a first chunk
    # would need the keys of the next. A step takes prefixes while they fit, and at least one
    # (730 tokens for Moondream 2, over the default budget; 82 for the tiny model).
    prefill_token_budget: int = 512
    max_queue: int = 4096
    debug_checks: bool = False
    triton_kernels: bool | None = None
    cuda_graphs: bool | None = None
    cpu_script: bool | None = None
    max_draft: int = 16
    vision_thread: bool | None = None
    lower_turn: int = 4

    def __post_init__(self) -> None:
        depth = self.pipeline_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth not in (1, 2):  # not True, not 2.0
            raise ConfigError(f"pipeline_depth must be 1 (blocking) or 2 (pipelined), got {self.pipeline_depth!r}")
        for name in ("max_batch_size", "page_size", "prefill_token_budget", "max_queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.max_draft, bool) or not isinstance(self.max_draft, int) or self.max_draft < 0:
            raise ConfigError(f"max_draft must be an integer >= 0, got {self.max_draft!r}")
        if isinstance(self.lower_turn, bool) or not isinstance(self.lower_turn, int) or self.lower_turn in (1,) \
                or self.lower_turn < 0:  # 1 would put the lower priority always first
            raise ConfigError(f"lower_turn must be 0 (strict priority) or an integer >= 2, got {self.lower_turn!r}")
        for name in ("triton_kernels", "cuda_graphs", "cpu_script", "vision_thread", "debug_checks"):
            value = getattr(self, name)  # "false" from a settings file or an environment variable had meant yes
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"{name} must be True, False or None, got {value!r}")
        if not isinstance(self.model, (str, os.PathLike)):  # None had been a TypeError from inside the loader
            raise ConfigError(f"model must be 'tiny', a model folder or random:NAME, got {self.model!r}")
        if self.kv_pages is not None and (isinstance(self.kv_pages, bool) or not isinstance(self.kv_pages, int)
                                          or self.kv_pages < 1):
            raise ConfigError(f"kv_pages must be a positive integer or None, got {self.kv_pages!r}")
