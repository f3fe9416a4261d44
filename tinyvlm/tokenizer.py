"""The tiny model's BPE tokenizer, trained on the world's captions and questions.

Byte-level BPE, so any text still encodes; Moondream 2's special ids 0..9 come first
(bos = eos = 0, answer marker 3, ...). Task words (" caption", " short", ...) are single tokens
so that the prompt templates have Moondream 2's shape: [1, task, 2, length, 3].
"""

from __future__ import annotations

import functools

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .language import caption, questions
from .world import sample_scene

SPECIALS = ["<|endoftext|>", "<|prompt|>", "<|sep|>", "<|answer|>", "<|thinking|>",
            "<|coord|>", "<|size|>", "<|start_ground_points|>", "<|reserved_8|>", "<|end_ground|>"]
TASK_WORDS = ["caption", "short", "normal", "long", "query", "detect", "point"]


def corpus(n_scenes: int = 3000, seed: int = 12345) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = [" " + " ".join(TASK_WORDS)] * 500
    for _ in range(n_scenes):
        scene = sample_scene(rng, 640, 360)
        for length in ("short", "normal", "long"):
            lines.append(caption(scene, length, rng))
        lines += [f"{q} {a}" for q, a in questions(scene, rng, k=8)]
        lines += [a for _, a in questions(scene, rng, k=8)]
    return lines


def build_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """A fresh Tokenizer object each call (callers may change theirs), trained once a process."""
    return Tokenizer.from_str(_trained(vocab_size))


@functools.lru_cache(maxsize=None)
def _trained(vocab_size: int) -> str:
    # Sampling the corpus's 3000 scenes takes ~5 s: once a process, not once a run (a test suite
    # trains a dozen short runs).
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok.to_str()


def task_token(tok: Tokenizer, word: str) -> int:
    ids = tok.encode(" " + word).ids
    if len(ids) != 1:
        raise AssertionError(f"{word!r} is not a single token: {ids}")
    return ids[0]


def templates(tok: Tokenizer) -> dict:
    w = {word: task_token(tok, word) for word in TASK_WORDS}
    return {
        "caption": {n: [1, w["caption"], 2, w[n], 3] for n in ("short", "normal", "long")},
        "query": {"prefix": [1, w["query"], 2], "suffix": [3]},
        "detect": {"prefix": [1, w["detect"], 2], "suffix": [3]},
        "point": {"prefix": [1, w["point"], 2], "suffix": [3]},
    }
