"""Throughput and latency benchmark behind `vlmstream bench`.

For each concurrency N, one engine serves N simultaneous requests (one image each, a fixed
number of answer tokens, EOS ignored so that every run decodes the same amount). Decode
throughput is the tokens after each request's first over the time from the first request's first
token to the last request's last (`_decode_rate`); end-to-end throughput (prefill included) is
reported beside it. Runs alternate
between pipelined (depth 2) and blocking (depth 1), at least `repeats` times each and until each
mode has run `min_seconds`; medians are reported. Both modes run in the same process on the same
engine, and the ratio is the median of the ratios of back-to-back pairs of runs, so that a shared
machine's load drifting between runs cancels out of it even when absolute figures move. Greedy
outputs of the two modes are compared.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .engine_config import EngineConfig
from .engine import Engine
from .types import SamplingParams


@dataclass(frozen=True)
class BenchConfig:
    model: str = "tiny"
    device: str = "cpu"
    dtype: str | None = None
    streams: tuple[int, ...] = (1, 8, 32)
    tokens: int = 64
    repeats: int = 3
    image_size: tuple[int, int] = (360, 640)
    frames: int = 240  # frame-rate run (0 to skip)
    # Short runs (one stream decodes 64 tokens in ~60 ms on CPU) are at the mercy of a shared
    # machine's noise: runs repeat, alternating modes, until each mode has this much wall time
    # (with 1 s, the 32-stream ratio ranged 1.01-1.19 over three runs of the same build).
    min_seconds: float = 3.0
    max_repeats: int = 60
    cpu_script: bool | None = None  # EngineConfig.cpu_script (None: the engine's default)
    vision_thread: bool | None = None  # EngineConfig.vision_thread (None: the engine's default)

    def __post_init__(self):
        if self.tokens < 2:  # the decode rate counts the tokens after the first: one gave 0 / 0
            raise ValueError(f"tokens must be >= 2, got {self.tokens}")
        if not self.streams or min(self.streams) < 1 or self.repeats < 1 or self.frames < 0:
            raise ValueError("streams and repeats must be >= 1, frames >= 0")


def _images(n: int, size: tuple[int, int]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    h, w = size
    base = np.linspace(0, 255, w, dtype=np.float32)[None, :, None] * np.ones((h, 1, 3), np.float32)
    return [np.clip(base + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8) for _ in range(n)]


def _run(engine: Engine, depth: int, images: list[np.ndarray], tokens: int) -> dict:
    engine.set_pipeline_depth(depth)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    refs = [engine.encode_image(img) for img in images]  # host preprocessing: before the window
    deadline = time.perf_counter() + 600
    # And the CPU vision thread's encodings (engine/vision_stage.py). Not stats().vision_queue:
    # it counts an image once the engine thread has taken it from its inbox, and right after
    # encode_image it could still read 0, leaving ~10 ms of encoding inside a one-stream window.
    while any(ref._image.awaits_vision for ref in refs) and time.perf_counter() < deadline:
        time.sleep(0.002)
    engine.reset_stats()  # the busy fraction's window is the run's wall time, from here
    t0 = time.perf_counter()
    submitted, handles = [], []
    for ref in refs:
        submitted.append(time.perf_counter())
        handles.append(engine.submit(ref, caption="normal", params=params))
    outs = [h.result(timeout=3600) for h in handles]
    wall = time.perf_counter() - t0
    stats = engine.stats()
    for ref in refs:
        ref.release()
    return {**_decode_rate(submitted, outs),
            "end_to_end_tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
            "wall_s": wall,
            "device_busy_fraction": stats.device_busy_fraction,
            "ttft_ms_p50": statistics.median(o.timings.first_token for o in outs),
            "tokens": [o.token_ids for o in outs]}


def _decode_rate(submitted: list[float], outs: list) -> dict:
    """Decode throughput: the tokens after each request's first, over the time from the first
    request's first token to the last request's last. Not the sum of each request's own rate,
    which is the same only where all of them decode over the same span: requests admitted in turns
    (their first tokens 63 to 97 ms after submission, pipelined, 32 streams) had their rates added
    as if side by side, 15 % over the tokens the engine made a second, and more for the mode
    whose first tokens spread further (the ratio). The request's own times are from its
    submission (`submitted`, perf_counter), less its host preprocessing, counted in them."""
    spans = [(at + (o.timings.first_token - o.timings.preprocess) / 1000.0,
              at + (o.timings.total - o.timings.preprocess) / 1000.0)
             for at, o in zip(submitted, outs) if o.timings.first_token is not None]
    decoded = sum(len(o.token_ids) - 1 for o in outs if o.timings.first_token is not None)
    span = max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0
    return {"tokens_per_s": decoded / span if span > 0 else 0.0}


def frame_rate(engine: Engine, n_frames: int, size: tuple[int, int], inflight: int = 8) -> dict:
    """Frames per second for a stream of distinct frames, each captioned (short, greedy), with
    at most `inflight` frames in the engine at once, as a live stream keeps it."""
    engine.set_pipeline_depth(2)
    frames = _images(16, size)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    t0, pending, outs = time.perf_counter(), [], []
    for i in range(n_frames):
        pending.append(engine.submit(frames[i % len(frames)], caption="short", params=params))
        if len(pending) >= inflight:
            # As long as the engine makes progress (RequestHandle.wait): Moondream 2 in fp32 on a
            # CPU, 8 frames of 2 crops in one batch, comes near a fixed 600 s, and a TimeoutError
            # had ended `bench` with a traceback and no figures.
            outs.append(pending.pop(0).wait())
    outs += [h.wait() for h in pending]
    wall = time.perf_counter() - t0
    return {"frames": n_frames, "frames_per_s": n_frames / wall, "inflight": min(inflight, n_frames),
            "latency_ms_p50": statistics.median(o.timings.total for o in outs),
            "tokens_per_frame": statistics.mean(len(o.token_ids) for o in outs)}


def cpu_name() -> str:
    """The CPU's model name, with the vector and matrix instructions that tell apart the machine
    kinds BENCHMARKS.md compares."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux
        return platform.processor() or platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.machine())
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    kinds = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(kinds)})" if kinds else name


def _measure(engine: Engine, cfg: BenchConfig, n: int, progress: Callable[..., None] | None) -> dict:
    """One concurrency's figures: pipelined and blocking runs alternated (see the module's doc)."""
    images = _images(n, cfg.image_size)
    for depth in (2, 1):  # this batch size's first steps (shapes new to TorchScript, the allocator) untimed
        _run(engine, depth, images, 4)
    runs: dict[int, list[dict]] = {2: [], 1: []}
    r = 0
    while r < cfg.repeats or (r < cfg.max_repeats and min(sum(x["wall_s"] for x in runs[d])
                                                          for d in (1, 2)) < cfg.min_seconds):
        if progress and r == cfg.repeats:  # runs of unknown number follow: said once, not counted
            progress(f"streams={n} more runs, until each mode has run {cfg.min_seconds:g} s", counted=False)
        for depth in (2, 1) if r % 2 == 0 else (1, 2):
            if progress and r < cfg.repeats:
                progress(f"streams={n} repeat={r + 1}/{cfg.repeats} {'pipelined' if depth == 2 else 'blocking'}")
            runs[depth].append(_run(engine, depth, images, cfg.tokens))
        r += 1
    summary = {}
    for depth, name in ((2, "pipelined"), (1, "blocking")):
        summary[name] = {k: statistics.median(run[k] for run in runs[depth])
                         for k in ("tokens_per_s", "end_to_end_tokens_per_s", "wall_s",
                                   "device_busy_fraction", "ttft_ms_p50")}
    pairs = [p["tokens_per_s"] / b["tokens_per_s"] for p, b in zip(runs[2], runs[1])]
    first = runs[2][0]["tokens"]
    return {
        "streams": n,
        "tokens_made": round(statistics.mean(len(t) for t in first), 1),  # fewer where the context ends them
        "runs_per_mode": r,
        # short of min_seconds where max_repeats ended it first (runs of a few ms each)
        "seconds_per_mode": round(min(sum(x["wall_s"] for x in runs[d]) for d in (1, 2)), 3),
        **summary,
        "ratio": statistics.median(pairs),
        "pair_ratios": pairs,
        "identical_tokens": all(run["tokens"] == first for run in runs[1] + runs[2]),
    }


def run_bench(cfg: BenchConfig, progress: Callable[..., None] | None = None) -> dict:
    """The report `vlmstream bench` prints; `progress(what, counted=True)` is told of each timed run
    (counted) and of the runs past --repeats that fill --seconds (once a concurrency, not counted).
    Interrupted (Ctrl-C, SIGTERM) once something was measured, it holds what was, `interrupted`
    set; before that, the KeyboardInterrupt goes on."""
    engine_cfg = EngineConfig(model=cfg.model, device=cfg.device, dtype=cfg.dtype,
                              max_batch_size=max(cfg.streams), cpu_script=cfg.cpu_script,
                              vision_thread=cfg.vision_thread)
    results: list[dict] = []
    frames, interrupted = None, False
    with Engine(engine_cfg) as engine:
        try:
            _run(engine, 2, _images(1, cfg.image_size), 4)  # warm-up: allocator, kernels, caches
            if progress and cfg.frames:
                progress(f"frame rate, {cfg.frames} frames of {cfg.image_size[1]}x{cfg.image_size[0]}")
            frames = frame_rate(engine, cfg.frames, cfg.image_size) if cfg.frames else None
            for n in cfg.streams:
                results.append(_measure(engine, cfg, n, progress))
        except KeyboardInterrupt:
            if not results and frames is None:
                raise
            interrupted = True
            engine.close(cancel=True)  # the interrupted run's requests: not decoded to their end
    return {
        "model": cfg.model,
        "device": str(engine.loaded.device),  # as loaded: "cpu:0" typed is "cpu"
        "dtype": str(engine.loaded.dtype).removeprefix("torch."),
        "decode": "torchscript" if engine.runner.scripted is not None else "eager",
        "vision_thread": engine._vision is not None,
        "tokens_per_request": cfg.tokens,
        "repeats": cfg.repeats,
        "min_seconds": cfg.min_seconds,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu": cpu_name(),
        "gpu": torch.cuda.get_device_name(engine.loaded.device) if engine.loaded.device.type == "cuda" else None,
        "cpu_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
        "frame_rate": frames,
        # Stopped by Ctrl-C or SIGTERM after some were measured: the concurrencies left out
        "interrupted": interrupted,
        "not_measured": [n for n in cfg.streams if n not in {r["streams"] for r in results}] if interrupted else [],
    }


def format_table(report: dict) -> str:
    lines = [f"{report['gpu'] or report['cpu']}, torch {report['torch']}",
             f"model={report['model']} device={report['device']} dtype={report['dtype']} "
             f"decode={report['decode']} vision_thread={report.get('vision_thread', False)} "
             f"tokens/request={report['tokens_per_request']} runs per mode>={report['repeats']} "
             f"and >={report['min_seconds']:g} s (medians; ratio: median of paired runs; decode tok/s)",
             f"{'streams':>7} {'pipelined tok/s':>16} {'blocking tok/s':>15} {'ratio':>6} "
             f"{'busy pipe':>9} {'busy block':>10} {'TTFT ms':>8} {'identical':>9}"]
    made = min((r["tokens_made"] for r in report["results"] if "tokens_made" in r), default=None)
    if made is not None and made < report["tokens_per_request"]:
        lines.append(f"(answers stopped at {made:g} tokens: the model's context ends them before --tokens)")
    for r in report["results"]:  # the header's ">= N s" was not true of these
        if r.get("seconds_per_mode", report["min_seconds"]) < report["min_seconds"]:
            lines.append(f"(streams={r['streams']}: {r['runs_per_mode']} runs per mode, the most there are, took "
                         f"{r['seconds_per_mode']:g} s of the {report['min_seconds']:g} s asked)")
    if report.get("interrupted"):
        left = ",".join(str(n) for n in report["not_measured"])
        lines.append(f"(interrupted: streams={left} not measured)" if left else "(interrupted)")
    for r in report["results"]:
        p, b = r["pipelined"], r["blocking"]
        lines.append(f"{r['streams']:>7} {p['tokens_per_s']:>16.1f} {b['tokens_per_s']:>15.1f} {r['ratio']:>6.3f} "
                     f"{p['device_busy_fraction']:>9.3f} {b['device_busy_fraction']:>10.3f} "
                     f"{p['ttft_ms_p50']:>8.1f} {str(r['identical_tokens']):>9}")
    fr = report.get("frame_rate")
    if fr:
        lines.append(f"frame rate: {fr['frames_per_s']:.1f} frames/s captioned (short, {fr['tokens_per_frame']:.1f} "
                     f"tokens/frame), latency p50 {fr['latency_ms_p50']:.1f} ms, {fr['inflight']} frames in flight")
    return "\n".join(lines)
