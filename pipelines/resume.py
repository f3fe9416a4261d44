"""Where a `video --resume` picks a file up without decoding what is done.

A previous run's JSONL holds the answers of a file's first frames; those up to the last frame
of its unbroken prefix are replayed from it, and decoding starts at the keyframe before that
frame (`FileSource.frames(resume=)`): a 2-hour file stopped near its end had been decoded from
its start again before its first new answer. The prefix must be what this run picks: the first
frame, then each next frame its sampling takes, every answer there. Answers written with another
`--fps` or `--every-n` break it early, and the run reads from wherever it breaks, as before.
"""

from __future__ import annotations

from typing import Iterator, Mapping

from .frame import Frame
from .prompts import prompt_key
from .sinks import FrameResult

MIN_SKIP = 2  # frames: a resume this near the start reads from it


def resume_point(recorded: Mapping[int, float], sampling, group: int | None = None) -> list[tuple[int, float]]:
    """(index, pts) of the recorded frames a resumed run replays before the frame it reads from,
    that frame last; empty to read from the start. `recorded`: the time of each frame whose every
    answer is recorded, by index. `group`: with sticky answers, frames are asked a group at a
    time, and a group that asks anything needs the pixels of its frames and of the frame before
    it (scene cuts): the reading starts at the end of the last group done."""
    indices = sorted(recorded)
    if not indices or indices[0] != 0:
        return []
    pick, step = sampling.picker(), sampling.every_n or 1
    prefix: list[tuple[int, float]] = []
    for index in indices:
        pts = recorded[index]
        if prefix:
            before_index, before_pts = prefix[-1]
            if not sampling.fps and index != before_index + step:
                break
            # --fps: the frame just before this one (its time from the frames' mean interval since
            # the one recorded before) must have come before the next slot, or it was to be taken
            # (a line missing, or the answers written with a lower --fps)
            if sampling.fps and index > before_index + 1 and \
                    pts - (pts - before_pts) / (index - before_index) >= pick.next_slot() - 1e-6:
                break
        if not pick(index, pts):  # written with a higher --fps
            break
        prefix.append((index, pts))
    if group:
        prefix = prefix[:len(prefix) // group * group]  # the groups done, the last one's last frame read
    return prefix if prefix and prefix[-1][0] >= MIN_SKIP else []


def resumed_frames(source, sampling, recorded: Mapping[int, float], group: int | None = None,
                   **read) -> Iterator[Frame]:
    """The frames of `source` (a FileSource) that `sampling` picks: those of the recorded prefix
    (`resume_point`) first, without pixels and undecoded, then the file's from the last of them
    on, read from the keyframe before it where it can seek. `read`: FileSource.frames' options."""
    pick = sampling.picker()
    done_part = resume_point(recorded, sampling, group)
    for index, pts in done_part[:-1]:
        pick(index, pts)  # where a full run's picker is when it gets there
        yield Frame(source.source_id, index, pts, None)
    resume = (*done_part[-1], done_part[0][1]) if done_part else None
    yield from source.frames(pick=pick, resume=resume, **read)


def answered(done: Mapping[tuple, FrameResult], key: str, tasks: list[dict]) -> dict[int, float]:
    """The time of each frame of source `key` that `done` holds an answer of every task for."""
    first, *rest = [prompt_key(t) for t in tasks]
    return {index: r.pts for (k, index, p), r in done.items()
            if k == key and p == first and all((key, index, q) in done for q in rest)}
