"""HTML for the web UI's live views, built from a feed snapshot (pure functions, no Gradio).

The frame goes to the page as an inline JPEG with its caption drawn on the pixels, so a caption
can never be shown over a frame it does not describe. The latency chart is an inline SVG of
stacked bars (one per captioned frame, stages queue / vision / prefill / decode) with the
end-to-end latency as a line; a few kilobytes a second, redrawn by the browser without a plotting
library.
"""

from __future__ import annotations

import base64
import html
import time

import numpy as np

from pipelines.caption_log import LogLine
from pipelines.feed import MIN_CHART_BARS
from pipelines.feed_snapshot import CHART_STAGES, FeedSnapshot, LatencyPoint
from pipelines.shot import Shot, jpeg_bytes
from pipelines.annotated import annotate

STAGE_COLORS = {"queue": "#9aa5b1", "vision": "#4c78a8", "prefill": "#f58518", "decode": "#54a24b"}
MAX_BARS = 120


MAX_PAGE_WIDTH = 960  # larger frames are scaled down for the page: 15 updates/s stay light on the wire


def jpeg_data_uri(rgb: np.ndarray, quality: int = 80) -> str:
    return _data_uri(jpeg_bytes(rgb, MAX_PAGE_WIDTH, quality))


def _data_uri(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode("ascii")


def frame_html(snap: FeedSnapshot | None, message: str = "") -> str:
    if snap is None or snap.frame_rgb is None:
        text = html.escape(message or (snap.error if snap and snap.error else "") or waiting(snap))
        return f'<div id="vs-frame" class="vs-empty">{text}</div>'
    info = f"#{snap.index}  {snap.pts:.2f}s  {snap.end_to_end_ms:.0f} ms"
    uri = jpeg_data_uri(annotate(snap.frame_rgb, snap.text, info))
    return (f'<div id="vs-frame" data-version="{snap.version}" data-index="{snap.index}">'
            # At most the window's height: a portrait source's frame (1080x1920) put its caption
            # band below the fold
            f'<img src="{uri}" style="max-width:100%;max-height:80vh;object-fit:contain" alt="current frame"/>'
            f'<div id="vs-caption" data-index="{snap.index}">{html.escape(snap.text)}</div>'
            f'<div class="vs-info">{html.escape(info)}</div></div>')


def waiting(snap: FeedSnapshot | None) -> str:
    """What the frame's place says before the first frame: a stream or camera still being reached
    says for how long and why the last try failed (an unreachable address had shown "no frame
    yet" and a running state for the 30 s before it was given up)."""
    health = snap.counters.get("stream", {}) if snap is not None else {}
    if health.get("state") not in ("connecting", "reconnecting"):
        # Frames read and with the model: Moondream 2 on a CPU takes a minute to its first answers
        # (4 frames in one batch), and "no frame yet" all that while blamed the source.
        asked = snap.counters.get("in_flight", 0) if snap is not None else 0
        if asked:  # and for how long: Moondream 2 on a CPU, ~30 s with nothing moving but this
            waited = snap.running_s
            return (f"the source plays; waiting for the first answer ({asked} frame{'s' * (asked != 1)} in flight)"
                    + (f": {waited:.0f} s so far" if waited is not None else ""))
        return "no frame yet"
    text = f"{health['state']} ({health.get('for_s', 0):.0f} s)"
    return text + (f"; the last try: {health['reason']}" if health.get("reason") else "")


def log_text(log: list[LogLine], n: int = 40) -> str:
    lines = []
    for line in reversed(log[-n:]):  # newest first; a line per run of frames with the same answers
        clock = (time.strftime("%H:%M:%S", time.localtime(line.first_wall))
                 + f".{int(line.first_wall * 1000) % 1000:03d}")
        text = line.text.replace("\n", "  |  ")  # several answers of a frame on its one line
        run = f"  ({line.frames} frames to t={line.pts:.2f}s)" if line.frames > 1 else ""
        lines.append(f"{clock}  t={line.first_pts:7.2f}s  {line.end_to_end_ms:5.0f} ms  {text}{run}")
    return "\n".join(lines)


def shots_html(shots: list[Shot]) -> str:
    """The frames where the answers changed, newest first, each with its answers and when; a
    click saves the picture (named by the frame's index). The picture is in the HTML once: the
    link gets its address from the picture when clicked (HEAD_JS), so an update of the gallery
    carries each JPEG once, not twice."""
    if not shots:
        return '<div id="vs-shots" data-count="0" class="vs-empty">no changes yet</div>'
    figures = []
    for shot in reversed(shots):
        uri = _data_uri(shot.jpeg)
        clock = time.strftime("%H:%M:%S", time.localtime(shot.wall))
        text = html.escape(shot.text)
        figures.append(f'<figure class="vs-shot" data-number="{shot.number}" data-index="{shot.index}">'
                       # href: a link without one is no stop of the Tab key, and keyboard users had no
                       # way to save a picture (HEAD_JS replaces it with the picture's own when clicked)
                       f'<a class="vs-save" href="#" download="frame_{shot.index}.jpg" title="save this frame" '
                       f'aria-label="save frame #{shot.index}: {text}">'
                       f'<img src="{uri}" alt="{text}"/></a>'
                       f'<figcaption>{text}<br/><span class="vs-info">{clock}  t={shot.pts:.2f}s  '
                       f'#{shot.index}</span></figcaption></figure>')
    return (f'<div id="vs-shots" data-count="{len(shots)}" data-newest="{shots[-1].number}">'
            + "".join(figures) + "</div>")


def chart_svg(points: list[LatencyPoint], window_s: float, width: int = 720, height: int = 220) -> str:
    """Stacked stage latency per frame over the last window_s seconds, end to end as a line. Its
    text and grid in the page's text colour (currentColor): fixed greys (#333 to #888) were ~1.5:1
    on Gradio's dark theme, which a browser set to dark gets, and #888 3.5:1 on the light one."""
    m_left, m_bottom, m_top = 44, 22, 18
    if not points:
        return (f'<svg id="vs-chart" data-bars="0" {_fit(width, height)} role="img" '
                f'aria-label="latency per frame: no latency data yet">'
                f'<text x="{m_left}" y="{height // 2}" fill="currentColor">no latency data yet</text></svg>')
    summary = _chart_summary(points, window_s)
    if len(points) > MAX_BARS:  # keep every k-th point: the chart stays light at 60 fps
        k = -(-len(points) // MAX_BARS)
        points = points[::-1][::k][::-1]
    top = max(max(p.end_to_end_ms for p in points), max(sum(p.stages_ms.values()) for p in points), 1.0)
    top = _nice(top)
    plot_w, plot_h = width - m_left - 8, height - m_bottom - m_top
    bar_w = plot_w / len(points)
    parts = [f'<svg id="vs-chart" data-bars="{len(points)}" {_fit(width, height)} role="img" '
             f'aria-label="{html.escape(summary)}" '
             f'xmlns="http://www.w3.org/2000/svg" font-size="11" font-family="sans-serif">']
    for frac in (0.0, 0.5, 1.0):
        y = m_top + plot_h * (1 - frac)
        parts.append(f'<line x1="{m_left}" x2="{width - 8}" y1="{y:.1f}" y2="{y:.1f}" stroke="currentColor" '
                     f'stroke-opacity="0.2"/><text x="{m_left - 4}" y="{y + 4:.1f}" text-anchor="end" '
                     f'fill="currentColor">{top * frac:.0f}</text>')
    for i, p in enumerate(points):
        x, base = m_left + i * bar_w, 0.0
        for stage in CHART_STAGES:
            v = p.stages_ms.get(stage, 0.0)
            if v <= 0:
                continue
            y0 = m_top + plot_h * (1 - (base + v) / top)
            parts.append(f'<rect class="vs-bar" x="{x:.1f}" y="{y0:.1f}" width="{max(bar_w - 0.5, 0.5):.1f}" '
                         f'height="{plot_h * v / top:.1f}" fill="{STAGE_COLORS[stage]}"/>')
            base += v
    line = " ".join(f"{m_left + (i + 0.5) * bar_w:.1f},{m_top + plot_h * (1 - p.end_to_end_ms / top):.1f}"
                    for i, p in enumerate(points))
    parts.append(f'<polyline points="{line}" fill="none" stroke="#e45756" stroke-width="1.5"/>')
    parts.append(f'<text x="{m_left}" y="{height - 6}" fill="currentColor">ms per frame, '
                 f'last {_span(points, window_s):.0f} s ({_frames(len(points))} shown)</text>')
    x = width - 8
    for name, color in [("end to end", "#e45756")] + [(s, STAGE_COLORS[s]) for s in reversed(CHART_STAGES)]:
        x -= 22 + 6 * len(name)
        parts.append(f'<rect x="{x}" y="4" width="9" height="9" fill="{color}"/>'
                     f'<text x="{x + 12}" y="12" fill="currentColor">{name}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _chart_summary(points: list[LatencyPoint], window_s: float) -> str:
    """The chart in words, its accessible name (role="img"): a screen reader read the SVG as its
    loose labels, "250 125 0 queue vision prefill decode end to end", with no latency in them."""
    e2e = sorted(p.end_to_end_ms for p in points)
    span = _span(points, window_s)
    stages = ", ".join(f"{s} {points[-1].stages_ms.get(s, 0.0):.0f}" for s in CHART_STAGES)
    return (f"latency per frame, the last {span:.0f} s ({_frames(len(points))}): end to end "
            f"{points[-1].end_to_end_ms:.0f} ms for the newest ({stages}), median {e2e[len(e2e) // 2]:.0f} ms, "
            f"highest {e2e[-1]:.0f} ms")


def _span(points: list[LatencyPoint], window_s: float) -> float:
    """The time the chart's points cover: at most its window, except where a slow model's feed
    keeps its last few answers from longer ago (pipelines.feed.MIN_CHART_BARS), which it says."""
    span = points[-1].wall - points[0].wall
    return span if len(points) <= MIN_CHART_BARS else min(span, window_s)


def _frames(n: int) -> str:
    return f"{n} frame{'s' * (n != 1)}"


def _fit(width: int, height: int) -> str:
    """The chart's size: its own where its box is wide enough, scaled down to the box otherwise
    (at a fixed 720 px, the right half, the newest frames and the legend, was cut off with no way to
    scroll to it); CSS keeps it 600 px wide at least on a narrow window, its box scrolling."""
    return (f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'style="max-width:100%;height:auto"')


def _nice(v: float) -> float:
    for step in (10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10000):
        if v <= step:
            return float(step)
    return float(np.ceil(v / 10000) * 10000)


def stream_state(health: dict) -> str:
    """One cell's worth of StreamSource.health: what a viewer of a frozen picture wants to know."""
    state = health.get("state", "")
    if state == "reconnecting":
        text = f"reconnecting ({health.get('for_s', 0):.0f} s)"
    elif state == "live" and health.get("late_s", 0) >= 0.5:
        text = f"{health['late_s']:.1f} s behind"
    else:
        text = state
    n = health.get("outages", 0)
    return text + (f", {n} outage{'s' if n != 1 else ''}" if n and state != "reconnecting" else "")


def _fps_cell(fps: float) -> tuple[str, str, str]:
    """The fps counter: a slow model's rate in two figures, its label the time between answers
    (Moondream 2 on a CPU answers every ~15 s: "0.0" read as nothing coming)."""
    if fps <= 0 or fps >= 0.1:
        return "fps", f"{fps:.1f}", "fps"
    return "fps", f"{fps:.2g}", f"fps: an answer every {1 / fps:.0f} s"


def counters_html(counters: dict, engine: dict, running: bool, error: str | None = None) -> str:
    lat = counters.get("latency_ms", {}).get("end_to_end", {})
    cells = [
        ("state", "running" if running else "stopped"),
        _fps_cell(counters.get("rolling_fps", 0.0)),
        ("captioned", counters.get("completed", 0)),
        ("in flight", counters.get("in_flight", 0)),
        ("cancelled as stale", counters.get("cancelled_stale", 0)),
        ("dropped", counters.get("dropped", 0)),
        ("p50 / p99 ms", f"{lat.get('p50', 0):.0f} / {lat.get('p99', 0):.0f}"),
        ("batch", engine.get("batch", 0)),
        ("tokens/s", engine.get("tokens_per_s", 0)),
        ("device busy", f"{engine.get('device_busy_pct', 0)} %"),
        *([("vision thread busy", f"{engine['vision_busy_pct']} %")] if "vision_busy_pct" in engine else []),
        ("KV pages", f"{engine.get('kv_pages_in_use', 0)} / {engine.get('kv_pages_total', 0)}"),
        ("mode", engine.get("mode", "")),
    ]
    if "stream" in counters:  # a network source or a camera: an outage or a backlog shows here while it lasts
        cells.insert(1, ("connection", stream_state(counters["stream"])))
    body = "".join(f'<div class="vs-counter" data-name="{html.escape(c[0])}"><b>{html.escape(str(c[1]))}</b>'
                   f'<span>{html.escape(c[2] if len(c) > 2 else c[0])}</span></div>' for c in cells)
    err = f'<div class="vs-error">{html.escape(error)}</div>' if error else ""
    return f'<div id="vs-counters">{body}</div>{err}'
