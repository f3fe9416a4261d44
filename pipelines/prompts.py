"""Prompts: what a frame is asked ({"caption": kind} or {"question": text}, plus any other
`Engine.submit` keyword such as a constraint), how an answer names its prompt, and asking
several prompts about one frame on a single image encoding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.request import ImageRef
from engine.types import SamplingParams

if TYPE_CHECKING:  # not at run time: the command line answers --help without importing torch
    from engine import Engine

PROMPT_KEYS = ("caption", "question")


def prompt_of(task: dict) -> dict[str, str]:
    """What a result records of the task it answers: its caption or question (not its constraint)."""
    return {k: str(task[k]) for k in PROMPT_KEYS if k in task}


def prompt_key(prompt: dict[str, str]) -> tuple:
    return tuple(prompt.get(k) for k in PROMPT_KEYS)


def constrained(tasks: list[dict]) -> frozenset[tuple]:
    """The prompt keys of the prompts whose answers are constrained: `--changes` compares their
    answers in their order (the format is the user's), not as a caption's list of things."""
    return frozenset(prompt_key(prompt_of(t)) for t in tasks if "constraint" in t)


def prompt_label(prompt: dict[str, str]) -> str:
    return prompt.get("question") or f"{prompt.get('caption', 'short')} caption"


def answers_text(prompts: list[dict[str, str]], texts: list[str]) -> str:
    """What a frame's answers show as (subtitle, drawn band, web page): the answer, or one line
    per prompt ("label: answer")."""
    if len(texts) == 1:
        return texts[0].strip()
    return "\n".join(f"{prompt_label(p)}: {t.strip()}" for p, t in zip(prompts, texts))


# Someone is watching these answers come (a live view, an interactive question): they go before
# waiting batch work (Engine.submit's priority), which only ever waits for a free slot.
INTERACTIVE = 1


def ask(engine: Engine, rgb: np.ndarray | ImageRef, tasks: list[dict], params: SamplingParams,
        drafts: list[list[int] | None] | None = None, priority: int = 0) -> list:
    """Submit every prompt about one frame; several share its image prefix (encoded once, the
    pages refcounted). Returns the handles in prompt order; on a failure, those already
    submitted are cancelled."""
    drafts = drafts or [None] * len(tasks)
    if len(tasks) == 1:
        return [engine.submit(rgb, params=params, draft=drafts[0], priority=priority, **tasks[0])]
    own = not isinstance(rgb, ImageRef)  # an ImageRef stays the caller's to release
    ref = engine.encode_image(rgb, priority) if own else rgb
    handles: list = []
    try:
        for t, draft in zip(tasks, drafts):
            handles.append(engine.submit(ref, params=params, draft=draft, priority=priority, **t))
    except BaseException:
        for h in handles:
            h.cancel()
        raise
    finally:
        if own:
            ref.release()
    return handles
