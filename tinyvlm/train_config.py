"""The tiny model's architecture (`tiny_config`) and a training run's settings (`TrainConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.config import TILINGS, ModelConfig
from engine.models.loader import TINY_DIR

from .language import CAPTION_REWRITES, QUESTION_REWRITES


def tiny_config(vocab_size: int, template_ids: dict) -> ModelConfig:
    """The architecture of Moondream 2 scaled down for 60 fps on two CPU cores (see EVAL.md)."""
    # A 2 x 96 encoder on up to 8 tiles (2x3 for 4:3 to 16:9 frames) costs what 3 x 128 on 4 did
    # and draws small objects ~1.8x taller: +7 to +19 points on their shape (ninth session).
    return ModelConfig.from_dict({
        "text": {"dim": 192, "ff_dim": 768, "n_layers": 3, "vocab_size": vocab_size, "max_context": 256,
                 "n_heads": 3, "n_kv_heads": 3},
        "vision": {"enc_dim": 96, "enc_patch_size": 14, "enc_n_layers": 2, "enc_ff_dim": 384, "enc_n_heads": 2,
                   "proj_inner_dim": 512, "proj_out_dim": 192, "crop_size": 126, "in_channels": 3,
                   "max_crops": 8, "overlap_margin": 1, "resample": "bicubic", "tiling": "fill",
                   "page_to_grey": True},
        "region": {"dim": 192, "coord_feat_dim": 64, "coord_out_dim": 256, "size_feat_dim": 64,
                   "size_out_dim": 512, "inner_dim": 256, "trained": False},  # no region task in training
        "tokenizer": {"templates": template_ids, "question_rewrites": [list(r) for r in QUESTION_REWRITES],
                      "caption_rewrites": [list(r) for r in CAPTION_REWRITES]},
    })


MAX_MINUTES = 525600  # a year
MAX_LR = 1e9
MAX_THREADS = 1024
MAX_PROCESSES = 64


@dataclass(frozen=True)
class TrainConfig:
    out: Path = TINY_DIR
    steps: int = 3000
    batch_size: int = 16
    lr: float = 2e-3
    warmup: int = 150
    weight_decay: float = 0.01
    seed: int = 0
    # One thread: the render worker takes ~2/3 of the other core, and torch's two threads, one of
    # them sharing its core, ran 0.46 s a step against 0.33 s for one thread alone.
    threads: int = 1
    max_minutes: float = 90.0
    # bf16 autocast (None: where the CPU has bf16 matrix instructions, AVX512-BF16 or AMX): there
    # bf16 matmuls ran ~4x fp32 ones and a training step ~1.7x faster; master weights and the
    # optimizer stay fp32. An AVX2-only CPU emulates bf16 ~50x slower than fp32 (twelfth session).
    bf16: bool | None = None
    # Training processes of `threads` threads each, every one with its own render worker, that
    # average their gradients every step (gloo over loopback); each takes batch_size / processes
    # images of a step, so a step is the same batch. One process leaves ~60 % of the render
    # worker's core idle: two concurrent runs of 8 images a step made 64 images/s against 47 for
    # one of 16 (EVAL.md, eighth session).
    processes: int = 2
    # The first share of the run (of its steps or its time, whichever is further along: vision-only
    # steps are fast, so with the CLI's default 30000 steps it ends after ~18 of 85 minutes) trains the
    # vision encoder and projection alone on the per-token and outline targets: no decoder pass,
    # so ~2x the images a minute through the stage where shape is learned slowest. The decoder
    # then starts, with its own warm-up. Every answer but position gained, up to 31 points (EVAL.md,
    # tenth session).
    vision_share: float = 0.25
    # A weights folder of the same architecture and tokenizer to continue from (its optimizer state
    # is not kept: a continued run warms up again), e.g. to adapt weights to another tiling.
    init: Path | None = None
    # The first training scene (item) of the run: a continued run takes scenes the first never saw.
    first_item: int = 0
    # The vision tiling trained on (None: the tiny config's, "fill"); "moondream" reproduces runs
    # made before the fill tiling existed.
    tiling: str | None = None
    # Detect and point blocks per training image (tinyvlm/regions.py); > 0 trains the region head
    # and marks it trained in config.json.
    regions: int = 0
    # Train the decoder and region head alone (the vision encoder and projection as in --init):
    # teaching a new task to trained weights leaves what the image tokens say unchanged, and a
    # step costs the decoder's pass alone.
    freeze_vision: bool = False

    def __post_init__(self):
        if self.processes < 1 or self.batch_size % self.processes:
            raise ValueError(f"batch size {self.batch_size} does not split over {self.processes} processes")
        # NaN and infinity too: a NaN budget never ran out (every step ran), a negative one neither;
        # --max-minutes 1e308 overflowed the progress bar's estimate (a traceback, then a hang)
        if not 0.0 < self.max_minutes <= MAX_MINUTES:
            raise ValueError(f"the time budget must be a number of minutes > 0 and at most {MAX_MINUTES} "
                             f"(a year), not {self.max_minutes}")
        # --lr 1e38 overflowed AdamW's float32 step (a traceback, then a hang); 1e9 diverges, said so
        if not 0.0 < self.lr <= MAX_LR:
            raise ValueError(f"the learning rate must be a number > 0 and at most {MAX_LR:g}, not {self.lr}")
        if not -(2 ** 63) <= self.seed < 2 ** 64:  # torch's range: beyond, "Overflow when unpacking long long"
            raise ValueError(f"the seed must be between {-(2 ** 63)} and {2 ** 64 - 1}, not {self.seed}")
        if not 1 <= self.threads <= MAX_THREADS:
            raise ValueError(f"torch threads must be between 1 and {MAX_THREADS}, not {self.threads}")
        if self.processes > MAX_PROCESSES:  # each one a torch process with a render worker of its own
            raise ValueError(f"training processes must be between 1 and {MAX_PROCESSES}, not {self.processes}")
        if not 0.0 <= self.vision_share < 1.0:
            raise ValueError(f"the vision-only share must be in [0, 1), not {self.vision_share}")
        if self.first_item < 0:
            raise ValueError(f"the first training item must be >= 0, not {self.first_item}")
        if self.tiling is not None and self.tiling not in TILINGS:
            raise ValueError(f"unknown tiling {self.tiling!r} (use one of {', '.join(TILINGS)})")
        if not 0 <= self.regions <= 8:
            raise ValueError(f"region blocks per image must be 0..8, not {self.regions}")
        if self.freeze_vision and self.init is None:
            raise ValueError("a frozen vision encoder needs trained weights to start from (--init)")
        if self.freeze_vision and self.vision_share > 0:
            raise ValueError("a frozen vision encoder has no vision-only stage: set the vision share to 0")
