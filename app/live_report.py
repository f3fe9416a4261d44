"""What both `live` runs (captions and answers: app/live_run.py; places: app/live_locate_run.py)
make of their sources: each outage's log line and recording mark (`mark_outage`), the sources that
failed while others go on (`newly_failed`) or never sent a frame (`never_came`), the error of a run
in which none was read (`closing_error`), and several sources' frames a second (`run_rate`).
"""

from __future__ import annotations

from pipelines.outage import Outage
from pipelines.sinks import json_text
from pipelines.sources import SourceSilent

from app.live_files import log_name


def mark_outage(run, lock, label: str, outage: Outage, state: str | None = None) -> None:
    """An outage of a source found, over (frames again, or given up), or (`state` "unfinished")
    going on as the run ends: marked in its recording and its log line written. `run`: a LiveRun
    or a LiveLocateRun (its recorders, -o log, args and write errors); `lock`: its output lock."""
    if label in run.recorders and state is None:
        run.recorders[label].outage(outage)
    state = state or ("ended" if outage.end is not None else "gave_up" if outage.gave_up is not None else "began")
    with lock:
        if run.log is not None and not any(what == run.args.output for what, _ in run.write_error):
            try:
                run.log.write(json_text(outage.record(state)) + "\n")
                run.log.flush()
            except OSError as e:
                run.write_error.append((log_name(run.args.output), e))


def closing_error(never_read: list[BaseException]) -> BaseException:
    """The error of a run in which no source was read: the first given up for silence
    (SourceSilent: exit 1, a camera still off), else the first (a 404, a refused password: exit 2)."""
    return next((e for e in never_read if isinstance(e, SourceSilent)), never_read[0])


def newly_failed(errors: dict[str, str], going: set[str], said: set[str]) -> list[tuple[str, str]]:
    """(label, line) of the sources that failed while another goes on (a camera given up after
    --max-outage, or after 30 s without a first frame), not yet in `said`, which they join: a run
    of hours had said them only at its end, the camera gone since long before. A source failing
    as the last one going is left to the run's end, which says it."""
    new = [(label, error) for label, error in errors.items() if label not in said and going - {label}]
    said.update(label for label, _ in new)
    # each line names its source once (not "cam1: gave up on cam1: ..."), as it names it: after a
    # space and before a colon (webcam 1's label is in "nothing for 10 s" too)
    return [(label, error if f" {label}:" in f" {error}" else f"{label}: {error}") for label, error in new]


def never_came(live, frames_in: int, some_came: bool) -> str | None:
    """A source that sent nothing beside others that did, said with why where it is known
    (Connection refused); None otherwise (when none came, the closing error says so, once)."""
    if frames_in or not some_came:
        return None
    why = live.connection.why_nothing() if live.connection else None
    return "no frames received" + (f" ({why})" if why else "")


def run_rate(per_source: list[dict]) -> float:
    """Several sources' frames a second: their frames over the longest one's time. Each source is
    rated over its own (one that ended early stops its clock), so the rates' sum said more than
    the run did; it is that sum when every source ran to the end."""
    spans = [s["completed"] / s["achieved_fps"] for s in per_source if s["achieved_fps"]]
    return sum(s["completed"] for s in per_source) / max(spans) if spans else 0.0
