"""How the web UI's open live feeds share the engine's frames in flight (app/live_sessions.py).

`feeds` maps (session, "pull" | "push") to a LiveFeed, read under its owner's lock. Each open feed
gets an equal share (`share_inflight`); a browser's camera that sent nothing for CAMERA_SILENT_S
(`silent`) holds none; a new feed starts from how long the engine's latest answer took
(`latest_answer_s`). A server plays at most its `max_feeds` at once, a silent camera not counted
(`over_limit`).
"""

from __future__ import annotations

import time

CAMERA_SILENT_S = 1.5  # a browser's camera sends a frame every 0.1 s: this long without one, it has stopped
# Each feed plays its source on threads of its own (a 640x360 file's decode is ~15 % of a core at
# 60 fps) and takes at least one frame in flight: without a bound, every page or API client that
# pressed Start slowed every viewer, until none was live. `vlmstream ui --max-feeds N` sets it.
MAX_FEEDS = 16


def share_inflight(feeds: dict) -> None:
    """Every open feed gets an equal share of DEFAULT_MAX_INFLIGHT frames in flight (at least
    one): the engine's total in flight sets latency, not throughput (BENCHMARKS.md, several live
    sources), so a second viewer halves each one's share rather than doubling everyone's wait.
    A silent camera counts for none. Called with the lock held."""
    from pipelines.live import DEFAULT_MAX_INFLIGHT

    # a located feed is not in the engine
    captioning = [f for (_, kind), f in feeds.items()
                  if f.session is not None and not (kind == "push" and silent(f))]
    share = max(1, DEFAULT_MAX_INFLIGHT // max(1, len(captioning)))
    for feed in captioning:
        feed.session.set_max_inflight(share)


def over_limit(feeds: dict, key: tuple[str, str], max_feeds: int) -> str | None:
    """Why a new feed at `key` may not start (None: it may): the server plays `max_feeds` already.
    The feed it replaces (a new Start of the same page) and silent cameras do not count. Called
    with the lock held."""
    playing = [k for k, f in feeds.items() if k != key and not (k[1] == "push" and silent(f))]
    if len(playing) < max_feeds:
        return None
    return (f"this server plays {len(playing)} live feed{'' if len(playing) == 1 else 's'}, its limit "
            f"(vlmstream ui --max-feeds {max_feeds}): try again when one stops")


def latest_answer_s(feeds: dict, engine) -> float:
    """How long the latest answer of the open feeds on this engine took (the longest of
    theirs): a new feed of a slow model starts one frame at a time (LiveSession's answer_s)
    instead of waiting ~4x as long for its first answer. Before any answer, infinity: the first
    feed of a server asks one frame until its first answer says how long they take (the tiny
    model's ~10 ms on a CPU cost its feed a frame or two; Moondream 2's first answer there came
    after ~16 s instead of ~56). Called with their lock held."""
    times = [f.session.last_answer_s for f in feeds.values()
             if f.session is not None and f.session.engine is engine and f.session.last_answer_s is not None]
    return max(times, default=float("inf"))


def silent(feed) -> bool:
    """A pushed feed's camera has sent nothing for CAMERA_SILENT_S."""
    return time.monotonic() - feed.pushed_at >= CAMERA_SILENT_S
