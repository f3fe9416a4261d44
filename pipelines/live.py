"""A live session: one stream's frames in, one caption per frame out, latest frame wins.

Policies: at most `max_inflight` frames in the engine (a frame offered beyond that is dropped
at intake), only one while answers take over SLOW_ANSWER_S (`adapt`, until one alone takes under
FAST_ANSWER_S); when a frame's result completes, every older frame still in flight is stale and
is cancelled (the engine releases it through its reference counts); a request older than
`deadline_ms` is cancelled, and one that finishes past it is not reported. Results reach
`on_result` in completion order, which is frame order for the frames that complete (older ones
are cancelled when a newer one wins). What a result is lives in live_result.py (`LiveResult`),
its latency and rate windows in window.py.
"""

from __future__ import annotations

import logging
import math
import numbers
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from engine.errors import RequestError
from engine.timeouts import seconds
from engine.types import SamplingParams

if TYPE_CHECKING:  # not at run time: the command line answers --help without importing torch
    from engine import Engine

from .cuts import CutDetector
from .prompts import INTERACTIVE, ask, prompt_of, tasks_of
from .frame import Frame
from .live_result import LiveResult  # also imported from here (tests)
from .window import LatencyWindow, rolling_rate

# Frames in flight for a live stream (CLI, web UI): with drafts, 4 sustain the frame rate 6 did
# on two AVX2 cores with half the latency (p50 ~60 against ~120 ms, BENCHMARKS.md); more in
# flight only queue longer, fewer lose frames.
DEFAULT_MAX_INFLIGHT = 4
# An answer slower than this makes an adapting session take one frame at a time. Frames in flight
# together are nearly the same instant (4 frames: 67 ms of a 60 fps stream), so answering them
# together gains a viewer nothing where an answer takes seconds, and on a CPU they share the
# machine: Moondream 2's layout on two cores gave its first live answer after 55.9 s with 4 in
# flight against 15.6 s alone, and later ones as late (p50 48.8 against 15.8 s, BENCHMARKS.md).
SLOW_ANSWER_S = 1.0
# ... and one alone faster than this takes it back to max_inflight (a warm-up slowed by one-time
# costs, a machine no longer busy). A quarter: frames sharing a CPU take up to ~4x as long as one
# alone, so a model between the two stays one at a time rather than switching at every answer.
FAST_ANSWER_S = SLOW_ANSWER_S / DEFAULT_MAX_INFLIGHT
# Logit margin by which a live frame's answer keeps the previous one (SamplingParams.sticky). On
# the 60 fps sample at 2, captions changed 25 times in 720 frames instead of 173 and named 93 %
# of the objects instead of 81 % (EVAL.md, sticky captions): a reading the model gave once is
# kept through the frames where it wavers, and a new scene still wins by far more than 2.
LIVE_STICKY = 2.0
STAGES = ("queue", "preprocess", "vision", "prefill", "first_token", "decode", "total", "end_to_end")


class LiveSession:
    """task: one prompt ({"caption": "short"} or {"question": "..."}, plus any `Engine.submit`
    keyword such as a constraint) or several, all asked about every frame on one image prefix
    (a frame completes when all its answers are in).

    adapt: take one frame at a time from an answer that took over SLOW_ANSWER_S until one takes
    under FAST_ANSWER_S (`one_at_a_time`); answer_s: how long an answer took before the session,
    where known (`live`'s warm-up, the web UI's open feeds): over SLOW_ANSWER_S, an adapting
    session starts one at a time. Infinity: not known yet (a server's first feed): it starts one
    at a time and its first answer, taken alone, decides as a warm-up's would."""

    def __init__(self, engine: Engine, task: dict | list[dict], params: SamplingParams = SamplingParams(max_tokens=32),
                 max_inflight: int = 2, deadline_ms: float | None = None,
                 on_result: Callable[[LiveResult], None] | None = None, adapt: bool = True,
                 answer_s: float | None = None):
        _check_inflight(max_inflight)
        if deadline_ms is not None and (not isinstance(deadline_ms, numbers.Real) or isinstance(deadline_ms, bool)
                                        or not 0 < deadline_ms < float("inf")):  # NaN too
            raise RequestError(f"deadline_ms must be a finite number > 0 or None, got {deadline_ms!r}")
        if not isinstance(params, SamplingParams):  # a dict had been an AttributeError here, "sticky"
            raise RequestError("params must be a SamplingParams")
        self.tasks = tasks_of(task)  # its shape: not a TypeError from inside Engine.submit at the first offer
        self.engine, self.params = engine, params
        self.max_inflight, self.deadline_ms, self.on_result = max_inflight, deadline_ms, on_result
        self.adapt = adapt
        self.one_at_a_time = adapt and answer_s is not None and answer_s > SLOW_ANSWER_S
        # No answer time known: the first answer, alone, says it. Between FAST_ANSWER_S and
        # SLOW_ANSWER_S it had kept the session one at a time for good (the band keeps a state,
        # it does not choose one), where `live` after a warm-up that fast takes all its frames.
        self._first_decides = self.one_at_a_time and answer_s == math.inf
        self.last_answer_s: float | None = None  # the engine's time for the latest frame answered
        self._last_answers: list[list[int] | None] = [None] * len(self.tasks)  # per prompt, the latest frame's
        self._answers_of = -1  # the index of the frame those answers are for
        self._draft_from = 0  # answers of frames before this one (a scene cut) are not drafts
        self._cuts = CutDetector() if params.sticky else None
        self._prompts = [prompt_of(t) for t in self.tasks]
        self._lock = threading.Lock()
        self._inflight: deque[tuple[Frame, list, float]] = deque()  # frame order; each frame's handles
        self._finished: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.frames_in = self.submitted = self.completed = 0
        self.cancelled_stale = self.cancelled_deadline = self.cancelled_closed = self.dropped = 0
        # Percentiles cover the last LATENCY_WINDOW results (window.py): a session that runs for days must not grow.
        self._latency: dict[str, LatencyWindow] = {s: LatencyWindow() for s in STAGES}
        self._completions: deque[float] = deque(maxlen=120)
        self._t0 = time.perf_counter()
        self._closed_at: float | None = None
        self.error: str | None = None  # the engine failed under the session's frames
        self._thread = threading.Thread(target=self._run, name="vlmstream-live", daemon=True)
        self._thread.start()

    def offer(self, frame: Frame) -> bool:
        """Hand a frame to the session; False if it was dropped because the engine is saturated,
        or because the session is closed (an offer then had been taken, its result never came)."""
        # The deadline counts from now: the frame's conversion, cut check and preprocessing (done
        # inside submit) are part of its wait. Taken after them, a frame whose own `total` was past
        # --deadline-ms 40 (40.7 ms, a 720p frame) had been logged as answered in time.
        offered = time.perf_counter()
        with self._lock:
            if self._stop.is_set():
                return False
            if len(self._inflight) >= (1 if self.one_at_a_time else self.max_inflight):
                self.frames_in += 1
                self.dropped += 1
                return False
            frame = frame.load()  # a live source's frame comes unconverted: only a frame taken is converted
            # Consecutive frames mostly get the same caption: the latest one is the draft the
            # engine verifies several tokens a step against (the answer stays the greedy one, or
            # with sticky answers keeps it where the frame reads nearly the same). After a scene
            # cut, frames are asked afresh until an answer about the new scene is in.
            if self._cuts is not None and self._cuts.is_cut(frame.rgb):
                self._draft_from = frame.index
            drafts = self._last_answers if self._answers_of >= self._draft_from else None
            handles = ask(self.engine, frame.rgb, self.tasks, self.params, drafts, INTERACTIVE)
            self._inflight.append((frame, handles, offered))
            self.frames_in += 1  # after ask: a frame it refused (raised) is the caller's, not counted
            self.submitted += 1
        left, count_lock = [len(handles)], threading.Lock()

        def one_done(_h) -> None:
            with count_lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._finished.put((frame, handles))

        for h in handles:
            h.add_done_callback(one_done)
        return True

    def set_params(self, params: SamplingParams) -> None:
        """Sampling for the frames offered from now on (the web UI's Settings while a feed runs)."""
        with self._lock:
            self.params = params
            if params.sticky and self._cuts is None:
                self._cuts = CutDetector()

    def set_max_inflight(self, n: int) -> None:
        """Change the intake limit of a running session (frames already in flight stay)."""
        _check_inflight(n)
        with self._lock:
            self.max_inflight = n

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def _run(self) -> None:
        while not (self._stop.is_set() and self._finished.empty() and not self.in_flight):
            self._expire()  # each time, not only when no result waits: 9 of 73 came past their deadline
            try:
                frame, handles = self._finished.get(timeout=0.005)
            except queue.Empty:
                continue
            outs = [h.result() for h in handles]
            with self._lock:
                for i, (f, hs, offered) in enumerate(self._inflight):
                    if hs is handles:
                        del self._inflight[i]
                        break
                else:
                    # Already taken out: a newer frame won (or its deadline passed, or the session
                    # was closed) while this one's completion waited in the queue. It was counted
                    # as cancelled then; reporting it now would step back in time.
                    continue
                stale = []
                answered = all(o.finish_reason in ("stop", "length") for o in outs)
                if answered:  # late or not: how long answers take now
                    self.last_answer_s = took_s = max(o.timings_ms.get("total", 0.0) for o in outs) / 1000.0
                    if self.adapt and (took_s > SLOW_ANSWER_S or took_s < FAST_ANSWER_S or self._first_decides):
                        self.one_at_a_time = took_s > SLOW_ANSWER_S
                    self._first_decides = False
                if answered and self._late(offered, time.perf_counter()):
                    # finished in time for the engine but handled too late here (this thread was
                    # held, or results queued up), or the frame _expire let run on: past the
                    # deadline is past it, not reported. Its answers are still the next frames' drafts.
                    # (A failure is still said below, late or not.)
                    self.cancelled_deadline += 1
                    if frame.index > self._answers_of:
                        self._last_answers, self._answers_of = [o.token_ids for o in outs], frame.index
                    continue
                if not answered:  # the engine closed under it, or failed: counted, and a failure said
                    self.cancelled_closed += 1
                    failed = next((o for o in outs if o.finish_reason == "error"), None)
                    if failed is not None and self.error is None:
                        self.error = "the engine failed: a frame's request ended in error"
                if answered:
                    while self._inflight and self._inflight[0][0].index < frame.index:
                        stale += self._inflight.popleft()[1]
                        self.cancelled_stale += 1
                    # Under the lock that took the frame out of flight: the next frame offered
                    # (the moment a slot frees) already drafts from these answers.
                    self._last_answers, self._answers_of = [o.token_ids for o in outs], frame.index
            for h in stale:
                h.cancel()
            if answered:
                now = time.perf_counter()
                result = LiveResult(frame, outs, (now - frame.captured_at) * 1000.0, self._prompts)
                if self.on_result:
                    try:
                        self.on_result(result)
                    except Exception:  # logged, as the engine's done callbacks are: it had ended this
                        # thread, and every frame after was dropped with nothing said
                        logging.getLogger("vlmstream").exception("on_result raised for frame %d", frame.index)
                # Counted once delivered: whoever sees `completed` grow (a page, a test, the CLI's
                # count) finds that many results where on_result put them.
                self.completed += 1
                self._completions.append(now)
                for k, v in result.timings_ms.items():
                    if k in self._latency:
                        self._latency[k].append(v)
                self._latency["end_to_end"].append(result.end_to_end_ms)
        self.engine = None  # done with it: a closed session kept for its results (the UI's Export) must not pin it

    def _late(self, offered: float, now: float) -> bool:
        return self.deadline_ms is not None and (now - offered) * 1000.0 > self.deadline_ms

    def _expire(self) -> None:
        if self.deadline_ms is None:
            return
        now = time.perf_counter()
        with self._lock:
            late = [hs for _, hs, t in self._inflight if self._late(t, now)]
            if late and self._answers_of < self._draft_from:
                # No answer to draft from yet (the run's start, a scene cut): the oldest frame of
                # the scene (not one from before its cut, whose answer could not be a draft) runs
                # on past its deadline, unreported, so that the frames after it have a draft. A
                # frame with none can take several times as long (`--deadline-ms 30` with 13 ms
                # answers drafted and 78 ms without: not one frame of 182 was answered).
                scout = next((hs for f, hs, _ in self._inflight if f.index >= self._draft_from), None)
                late = [hs for hs in late if hs is not scout]
            self._inflight = deque(x for x in self._inflight if all(x[1] is not hs for hs in late))
            self.cancelled_deadline += len(late)
        for hs in late:
            for h in hs:
                h.cancel()

    def cancel_all(self) -> None:
        """Cancel every frame in flight (a viewer left: nobody will read these captions)."""
        with self._lock:
            handles = [h for _, hs, _ in self._inflight for h in hs]
            self.cancelled_closed += len(self._inflight)
            self._inflight.clear()
        for h in handles:
            h.cancel()

    def close(self, timeout: float | None = 30.0) -> None:
        """Let in-flight frames finish (or be cancelled), then stop the session's thread; a
        TimeoutError if it is still running after `timeout` (an on_result that hangs). From
        on_result, which runs on that thread, it starts the closing and returns."""
        # math.inf: no limit (it had been an OverflowError from join). Checked before anything
        # stops, as Engine.close does: a bad timeout had left the session closed, offers refused.
        limit = seconds(timeout)
        with self._lock:  # an offer either comes before (and is waited for) or is refused
            self._stop.set()
            self._closed_at = self._closed_at or time.perf_counter()
        if threading.current_thread() is self._thread:
            return
        self._thread.join(limit)
        if self._thread.is_alive():
            raise TimeoutError(f"the live session's thread still runs after {timeout:g} s")

    def source_ended(self) -> None:
        """No frame will be offered any more (the feed's source ended or failed): the frame rate's
        time stops here (or at the last frame in flight), not when the run closes the session.
        `live short.mp4 long.mp4` had said 18 fps for the short clip's 54 frames in its 2 s: its
        rate counted on while the other clip played."""
        with self._lock:
            self._closed_at = self._closed_at or time.perf_counter()

    def stats(self) -> dict:
        # Copies first (one step under the GIL): iterated, the deques could grow from the session's
        # thread mid-way ("deque mutated during iteration": the web UI's snapshot stopped the feed).
        completions = list(self._completions)
        end = self._closed_at or time.perf_counter()
        if completions:  # frames in flight at the close finish after it and count: the rate's time
            end = max(end, completions[-1])  # runs to the last (`live --duration 0.01`: "169.5 fps")
        wall = max(end - self._t0, 1e-9)  # frozen once closed and the last frame is in
        rolling = rolling_rate(completions, end)
        return {
            "frames_in": self.frames_in, "submitted": self.submitted, "completed": self.completed,
            "cancelled_stale": self.cancelled_stale, "cancelled_deadline": self.cancelled_deadline,
            "cancelled_closed": self.cancelled_closed,
            "dropped": self.dropped, "max_inflight": self.max_inflight, "one_at_a_time": self.one_at_a_time,
            "achieved_fps": self.completed / wall, "rolling_fps": rolling,
            "latency_ms": {k: v.percentiles() for k, v in self._latency.items() if v},
        }


def _check_inflight(n: object) -> None:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:  # "2" had been a TypeError, 1.5 taken
        raise RequestError(f"max_inflight must be an integer >= 1, got {n!r}")
