"""Write the embedded `tiny` preset's tokenizer.json and config.json (engine/models/tiny/).

The tokenizer is a byte-level BPE with Moondream 2's special ids 0..9, trained on a small
corpus of scene descriptions and questions, so any text still encodes (bytes are the fallback).
The config is the Moondream 2 architecture scaled down for real time on two CPU cores; its
templates have the shape of Moondream 2's ([prompt, task, sep, length, answer]).

Run: python scripts/make_tiny_preset.py   (deterministic; rewrites both files)
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import ModelConfig  # noqa: E402

OUT = ROOT / "engine" / "models" / "tiny"
SPECIALS = ["<|endoftext|>", "<|prompt|>", "<|sep|>", "<|answer|>", "<|thinking|>",
            "<|coord|>", "<|size|>", "<|start_ground_points|>", "<|reserved_8|>", "<|end_ground|>"]
TASK_WORDS = ["caption", "short", "normal", "long", "query", "detect", "point"]
VOCAB_SIZE = 1024


def corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    shapes = ["circle", "square", "triangle", "star"]
    colors = ["red", "green", "blue", "yellow", "orange", "purple", "white", "black"]
    sizes = ["small", "large"]
    places = ["top left", "top", "top right", "left", "center", "right", "bottom left", "bottom",
              "bottom right"]
    counts = ["one", "two", "three", "four"]
    lines = [" " + " ".join(TASK_WORDS)] * 200
    for _ in range(6000):
        c, s, z, p = rng.choice(colors), rng.choice(shapes), rng.choice(sizes), rng.choice(places)
        lines.append(f"A {z} {c} {s} in the {p} of the frame.")
        lines.append(f"What color is the {s}? {c}. Where is the {c} {s}? {p}.")
        lines.append(f"How many shapes are there? {rng.choice(counts)}. Is there a {c} {s}? "
                     f"{rng.choice(['yes', 'no'])}.")
    lines += [" ".join(w) for w in itertools.permutations(["the", "a", "and", "on", "background"], 3)]
    return lines


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def single(tok: Tokenizer, word: str) -> int:
    ids = tok.encode(" " + word).ids
    assert len(ids) == 1, f"{word!r} is not a single token: {ids}"
    return ids[0]


def main() -> None:
    tok = build_tokenizer()
    w = {word: single(tok, word) for word in TASK_WORDS}
    config = {
        "text": {"dim": 256, "ff_dim": 1024, "n_layers": 4, "vocab_size": tok.get_vocab_size(),
                 "max_context": 512, "n_heads": 4, "n_kv_heads": 4},
        "vision": {"enc_dim": 192, "enc_patch_size": 14, "enc_n_layers": 3, "enc_ff_dim": 768,
                   "enc_n_heads": 3, "proj_inner_dim": 512, "proj_out_dim": 256, "crop_size": 112,
                   "in_channels": 3, "max_crops": 4, "overlap_margin": 1},
        "region": {"dim": 256, "coord_feat_dim": 64, "coord_out_dim": 256, "size_feat_dim": 128,
                   "size_out_dim": 512, "inner_dim": 512},
        "tokenizer": {
            "templates": {
                "caption": {n: [1, w["caption"], 2, w[n], 3] for n in ("short", "normal", "long")},
                "query": {"prefix": [1, w["query"], 2], "suffix": [3]},
                "detect": {"prefix": [1, w["detect"], 2], "suffix": [3]},
                "point": {"prefix": [1, w["point"], 2], "suffix": [3]},
            }
        },
    }
    full = ModelConfig.from_dict(config).to_dict()  # validates, and writes every field explicitly
    OUT.mkdir(parents=True, exist_ok=True)
    tok.save(str(OUT / "tokenizer.json"))
    (OUT / "config.json").write_text(json.dumps(full, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT / 'tokenizer.json'} ({tok.get_vocab_size()} tokens) and {OUT / 'config.json'}")


if __name__ == "__main__":
    main()
