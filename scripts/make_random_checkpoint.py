"""Write a model folder with deterministic random weights in the Hugging Face Moondream layout.

For benchmarks and checks that need a full-size checkpoint without downloading one:

    python scripts/make_random_checkpoint.py OUT_DIR [--config moondream2|tiny|CONFIG.json]
                                               [--dtype bfloat16] [--seed 0] [--tokenizer PATH]

The default config is full-size Moondream 2 (1.93 B parameters, 3.85 GB in bf16). The tokenizer
defaults to the tiny preset's (random weights make any token equally meaningless).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import ModelConfig  # noqa: E402
from engine.device import resolve_dtype, resolve_device  # noqa: E402
from engine.models.loader import TINY_DIR, read_config  # noqa: E402
from engine.models.weights import random_state_dict, save_model_folder  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--config", default="moondream2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", type=Path, default=TINY_DIR / "tokenizer.json")
    args = p.parse_args()
    if args.config == "moondream2":
        config = ModelConfig()
    elif args.config == "tiny":
        config = read_config(TINY_DIR)
    else:
        config = ModelConfig.from_file(Path(args.config))
    t0 = time.perf_counter()
    state = random_state_dict(config, seed=args.seed, dtype=resolve_dtype(args.dtype, resolve_device("cpu")))
    n = sum(v.numel() for v in state.values())
    save_model_folder(args.out, config, state, args.tokenizer)
    print(f"wrote {args.out}: {n / 1e9:.3f} B parameters in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
