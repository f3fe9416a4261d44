"""The progress of a `vlmstream video` run on the terminal: each file's bar (`FileProgress`) and
the redraw of bars that stand still (`tick`).

A run of up to CONCURRENT_FILES files draws a bar a file; more files share the run's one bar
(`VideoRun.overall`), each adding its frames to it. A file's bar and answer lines, and the
redraws, are drawn under the run's print lock, so lines from files side by side never interleave.
A file's `FileProgress` also keeps the last frame index written, which says whether its rebuilt
outputs may replace the old ones (`Rebuilds.finish`).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING

from pipelines.prompts import constrained, prompt_key, prompt_label

if TYPE_CHECKING:
    from app.video_run import VideoRun

# tqdm redraws a bar only when it moves: with a slow model (Moondream 2 on a CPU: 33 s to the
# first answer, 15-30 s each after) it sat at "0/480 [00:00<?" as if hung. On a terminal, a bar
# left still this long is redrawn, its clock running (not in a log file: a line a second).
TICK_S = 1.0


class FileProgress:
    """One file's bar (or its share of the run's bar) and its terminal lines, drawn under the run's
    print lock; the last frame index written."""

    def __init__(self, run: VideoRun, i: int, path: str, frame_count: int | None, summary) -> None:
        from tqdm import tqdm

        from pipelines.changes import AnswerChanges
        c = run.checked
        self.run, self.path, self.summary = run, path, summary
        self.name = run.names[path]
        self.bar = None if run.overall is not None else tqdm(total=frame_count, desc=self.name, unit="frame",
                                                             position=i, leave=True, file=sys.stderr)
        if self.bar is not None:
            with run.print_lock:
                run.bars.append(self.bar)
        self.shown = 0
        self.on_terminal = c.out is None and not c.out_dir and not c.to_stdout
        self.changed = AnswerChanges(run.args.hold or 1) if run.args.changes and self.on_terminal else None
        self.in_order = constrained(run.checked.tasks)  # the prompts --changes follows in their answers' order
        if self.changed:
            run.trackers.append(self.changed)
        self.written_last = -1

    def advance(self) -> None:  # with print_lock held
        overall = self.run.overall
        step = max(0, self.summary.frames_decoded - self.shown)
        if self.bar is None and not self.run.counts[self.path] and overall.total is not None:
            overall.total += step
        # `is None`, not truth: a bar without a total (the container gives no frame count)
        # has no truth value in tqdm, and asking raised TypeError
        (overall if self.bar is None else self.bar).update(step)
        self.shown = max(self.shown, self.summary.frames_decoded)

    def show(self, r) -> None:
        """caption_file's on_frame: the bars moved on, and the answer on the terminal if it goes there."""
        self.written_last = max(self.written_last, r.index)  # every answer, replayed or new, once written
        with self.run.print_lock:
            self.advance()
            if self.on_terminal:
                c = self.run.checked
                prefix = f"{self.name}  " if len(c.paths) > 1 else ""
                asked = "" if c.one_prompt else f"{prompt_label(r.prompt)}: "
                pts, text, was = r.pts, r.text.strip(), ""
                if self.changed is not None:
                    key = prompt_key(r.prompt)
                    ch = self.changed.observe(key, r.text, r.pts, in_order=key in self.in_order)
                    if ch is None:
                        return
                    pts, was = ch.since_pts, "" if ch.previous is None else f"  (was: {ch.previous})"
                print(f"{prefix}{pts:9.3f}  {asked}{text}{was}", flush=True)

    def finish(self) -> None:
        """The file is done: its bar closed, or the run's bar told."""
        run = self.run
        with run.print_lock:
            self.advance()  # frames after the last one picked
            if self.bar is not None:
                run.bars.remove(self.bar)
                self.bar.close()
            else:
                run.files_done += 1
                if run.counts[self.path] and run.overall.total is not None:  # what it held, not what it announced
                    run.overall.total += self.summary.frames_decoded - run.counts[self.path]
                run.overall.set_postfix(files_done=run.files_done)


def tick(bars: list, print_lock: threading.Lock, done: threading.Event) -> None:
    """Until `done`: every bar of `bars` that has stood still for TICK_S redrawn (under
    `print_lock`), its clock running."""
    while not done.wait(TICK_S):
        with print_lock:
            for bar in bars:
                if bar.last_print_t <= time.time() - TICK_S:  # tqdm's clock
                    try:
                        bar.refresh()
                    except (OSError, ValueError):  # a closed stderr: given up, as elsewhere
                        return


def on_terminal() -> bool:
    """Whether the bars are drawn on a terminal (and redrawn while they stand still)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
