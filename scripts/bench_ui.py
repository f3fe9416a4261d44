"""Benchmark the web UI as a viewer sees it; prints one JSON object.

    .venv/bin/python scripts/bench_ui.py [--seconds 20] [--model tiny]

Starts `vlmstream ui` on a free port, opens it in Debian's headless Chromium (Playwright,
no browser download), lets the 60 fps sample play and counts, in the page, how often a new
captioned frame and a new latency chart arrive. The engine side's fps is read off the page's
counters; `vlmstream live` on the same sample for the same time runs after it, for the ratio.
"""

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_videos" / "shapes_640x360_60fps.mp4"

# Installed in the page: records every new captioned frame and every chart redraw with its time.
WATCH_JS = """() => {
  window.__vs = {frames: [], charts: []};
  const box = document.querySelector('#vs-frame-box'), chart = document.querySelector('#vs-chart-box');
  new MutationObserver(() => {
    const f = document.querySelector('#vs-frame-box #vs-frame'), c = document.querySelector('#vs-frame-box #vs-caption');
    if (f && f.dataset.index !== undefined) window.__vs.frames.push([performance.now(), f.dataset.index, c ? c.textContent : '']);
  }).observe(box, {subtree: true, childList: true, attributes: true, characterData: true});
  new MutationObserver(() => {
    const svg = document.querySelector('#vs-chart');
    window.__vs.charts.push([performance.now(), svg ? Number(svg.dataset.bars) : 0]);
  }).observe(chart, {subtree: true, childList: true});
}"""


def page_rates(watched: dict, seconds: float) -> dict:
    frames = {f[1] for f in watched["frames"]}
    return {"caption_updates_per_s": round(len(frames) / seconds, 2),
            "chart_refreshes_per_s": round(len(watched["charts"]) / seconds, 2),
            "distinct_captions": len({f[2] for f in watched["frames"]}), "seconds": round(seconds, 1)}


def server_only_fps(url: str, seconds: float) -> float | None:
    """The same live view followed through the API (gradio_client) instead of a browser: what the
    server side sustains when the viewer's rendering is not on this machine."""
    from gradio_client import Client

    job = Client(url, verbose=False).submit("shapes_640x360_60fps.mp4", None, "short", "", "none", "",
                                            api_name="/live")
    t0, counters = time.time(), ""
    for out in job:
        if isinstance(out[1], str) and "fps" in out[1]:
            counters = out[1]
        if time.time() - t0 > seconds:
            break
    job.cancel()
    m = re.search(r"<b>([\d.]+)</b><span>fps</span>", counters)
    return float(m.group(1)) if m else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--model", default="tiny")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    exe = Path(sys.executable).with_name("vlmstream")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    port = free_port()
    server = subprocess.Popen([str(exe), "ui", "--port", str(port), "--model", args.model],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(360):
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            page.goto(url)
            page.wait_for_selector("#vs-caption", timeout=120_000)
            time.sleep(3.0)  # past the start
            page.evaluate(WATCH_JS)
            t0 = time.time()
            time.sleep(args.seconds)
            ui = page_rates(page.evaluate("window.__vs"), time.time() - t0)
            counters = page.inner_text("#vs-counters")
            browser.close()
        fps = re.search(r"([\d.]+)\s*fps", counters)
        ui["engine_fps_in_ui"] = float(fps.group(1)) if fps else None
        ui["engine_fps_server_only"] = server_only_fps(url, args.seconds)
    finally:
        server.terminate()
        server.wait(30)
    live = subprocess.run([str(exe), "live", str(SAMPLE), "--fps", "60", "--duration", str(args.seconds), "--json",
                           "--model", args.model], capture_output=True, text=True, env=env, timeout=600)
    cli = json.loads(live.stdout.strip().splitlines()[-1])
    print(json.dumps({"ui": ui,
                      "ui_server_only_vs_cli_fps": round(ui["engine_fps_server_only"] / cli["rolling_fps"], 3)
                      if ui["engine_fps_server_only"] and cli["rolling_fps"] else None, "live_cli": {"achieved_fps": round(cli["achieved_fps"], 2),
                                             "rolling_fps": round(cli["rolling_fps"], 2),
                                             "end_to_end_p50_ms": cli["latency_ms"]["end_to_end"]["p50"]},
                      "ui_vs_cli_fps": round(ui["engine_fps_in_ui"] / cli["rolling_fps"], 3)
                      if ui["engine_fps_in_ui"] and cli["rolling_fps"] else None}))


if __name__ == "__main__":
    main()
