"""Prompts: what a frame is asked ({"caption": kind} or {"question": text}, plus any other
`Engine.submit` keyword such as a constraint), how an answer names its prompt, and asking
several prompts about one frame on a single image encoding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.errors import RequestError
from engine.request import ImageRef
from engine.types import SamplingParams

if TYPE_CHECKING:  # not at run time: the command line answers --help without importing torch
    from engine import Engine

PROMPT_KEYS = ("caption", "question")


TASK_KEYS = PROMPT_KEYS + ("constraint",)  # Engine.submit's keywords that `ask` leaves to a task


def tasks_of(task: dict | list[dict]) -> list[dict]:
    """One task or several, as a list, each checked for its shape before any frame is asked: a
    string ("short"), an unknown key ({"caption": "short", "params": ...}) or two prompts in one
    had been a TypeError from inside Engine.submit at the first frame (a live session's offer)."""
    if isinstance(task, (str, bytes)) or not isinstance(task, (dict, list, tuple)):
        raise RequestError(f"a task is a dict such as {{'caption': 'short'}} or {{'question': '...'}} "
                           f"(or a list of them), got {type(task).__name__}")
    tasks = [task] if isinstance(task, dict) else list(task)
    if not tasks:
        raise RequestError("at least one prompt is needed")
    for t in tasks:
        if not isinstance(t, dict):
            raise RequestError(f"a task is a dict such as {{'caption': 'short'}}, got {type(t).__name__}")
        unknown = sorted(map(str, set(t) - set(TASK_KEYS)))
        if unknown:
            raise RequestError(f"unknown task key {unknown[0]!r}: a task takes caption or question, and constraint")
        if sum(k in t for k in PROMPT_KEYS) != 1:
            raise RequestError("a task takes exactly one of caption (short|normal|long) or question")
    return tasks


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
