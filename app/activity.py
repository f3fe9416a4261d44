"""The web UI server's activity log: a line for each thing its operator asks about later.

Who started which live feed or camera, what it played and asked; when and why it stopped (Stop,
tab closed, page gone, a failed source, a reload), after how long, with its frames captioned, fps
and median latency; each video job and image answered; Settings applied; what was refused for
the server's limits (--max-feeds, --settings-by). Standard `logging` under "vlmstream.ui":
silent until `vlmstream ui` attaches its handler (`to_stderr`), so the Python API and tests print
nothing. A page is named by its user (with --auth-file) and the start of its Gradio session id,
which ties its lines together; a URL's credentials never appear (pipelines.url.redact).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("vlmstream.ui")
USERS_KEPT = 10_000  # sessions whose user name is remembered, least recently seen dropped first
_users: OrderedDict[str, str] = OrderedDict()
# Gradio runs page events on many threads at once: a session seen again while another's `seen`
# dropped the least recent moved a key that was gone (KeyError in that page's event)
_users_lock = threading.Lock()


def to_stderr() -> logging.Handler:
    """Attach the server's handler: timestamped lines on standard error (remove it with
    `log.removeHandler`, and set `log.propagate` back, when the server stops)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s vlmstream: %(message)s", "%Y-%m-%d %H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # a root handler (an embedding app's basicConfig) would print each line twice
    return handler


def seen(session: str | None, user: str | None) -> None:
    """A page's event: its session belongs to this user (None without --auth-file)."""
    if session and user:
        with _users_lock:
            _users[session] = user
            _users.move_to_end(session)
            while len(_users) > USERS_KEPT:
                _users.popitem(last=False)


def who(session: str | None) -> str:
    page = (session or "api")[:8]
    with _users_lock:
        user = _users.get(session or "")
    return f"{user} (page {page})" if user else f"page {page}"


def source_text(source: str) -> str:
    from pipelines.url import redact

    try:
        return redact(source) if "://" in source else Path(source).name or source
    except Exception:  # an unparsable URL: its feed said why; the log must not fail on it
        return "(a URL that cannot be read)"


def task_text(task: dict | list[dict]) -> str:
    """What a feed or job asks, in a few words: `caption short`, `question "Is the door open?"`."""
    parts = []
    for t in task if isinstance(task, list) else [task]:
        kind = next((k for k in ("caption", "question", "detect", "point") if k in t), "?")
        value = str(t.get(kind, ""))
        parts.append(f"{kind} {value}" if kind == "caption" else f"{kind} {value[:60]!r}")
    return ", ".join(parts)


def feed_started(session: str, source: str, task: dict | list[dict], record: bool) -> None:
    log.info("%s started a live feed: %s, %s%s", who(session), source_text(source), task_text(task),
             ", recorded" if record else "")


def camera_started(session: str, task: dict | list[dict], first: bool) -> None:
    log.info("%s %s the browser camera: %s", who(session), "started" if first else "asks", task_text(task))


def feed_stopped(session: str, kind: str, feed, why: str) -> None:
    """A feed just closed (a LiveFeed): why it stopped, and its own error if its source failed."""
    snap = feed.snapshot()  # with its counters (full=False leaves them out)
    failed = snap.error if snap.error and not snap.error.startswith("stopped") else None
    log.info("%s %s stopped (%s%s) %s", who(session), "live feed" if kind == "pull" else "camera", why,
             f"; {failed}" if failed else "", feed_text(snap.counters, snap.running_s))


def refused(key: tuple[str, str], why: str) -> None:
    log.info("%s: %s refused: %s", who(key[0]), "Start" if key[1] == "pull" else "camera", why)


def video_started(session: str, name: str, task: dict | list[dict], every: int) -> None:
    log.info("%s video job: %s, %s, %s", who(session), name, task_text(task),
             "every frame" if every == 1 else f"one frame in {every}")


def video_ended(session: str, name: str, out: dict) -> None:
    log.info("%s video job %s: %s, %d frames in %s s (%sx real time)", who(session),
             "cancelled" if out["cancelled"] else "done", name, out["frames"], out["seconds"], out["x_real_time"])


def settings_applied(session: str, old, new, outcome: str) -> None:
    """What changed between two Settings (dataclasses), and whether the engine was reloaded."""
    changed = [f"{k} {getattr(old, k)!r} -> {getattr(new, k)!r}" for k in vars(old) if getattr(old, k) != getattr(new, k)]
    log.info("%s applied Settings: %s (%s)", who(session), ", ".join(changed) or "no change", outcome)


def image_answered(session: str | None, task: dict | list[dict], total_ms: float) -> None:
    log.info("%s image: %s, %.0f ms", who(session), task_text(task), total_ms)


def image_located(session: str | None, task: str, what: str, found: int) -> None:
    log.info("%s image: %s %r, %d found", who(session), task, what[:60], found)


def video_failed(session: str, error: BaseException) -> None:
    log.info("%s video job failed: %s", who(session), error)


def settings_refused(session: str | None) -> None:
    log.info("%s: Settings refused (--settings-by)", who(session))


def feed_text(counters: dict, running_s: float) -> str:
    """A stopped feed's figures: how long, frames captioned, fps, median latency."""
    p50 = counters.get("latency_ms", {}).get("end_to_end", {}).get("p50")
    n = counters.get("completed", 0)
    return (f"after {_duration(running_s)}: {n} frame{'' if n == 1 else 's'} captioned, "
            f"{counters.get('achieved_fps', 0.0):.3g} fps" + (f", p50 {p50:.0f} ms" if p50 is not None else ""))


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {s:02d} s"
