"""One-shot check and benchmark of the CUDA path: one run, one JSON file, a short table printed last.

    python scripts/gpu_check.py [--out gpu_check.json] [--device cuda] [--budget-s 450] [--quick]

Sections (each timed; one that fails records its error and the rest still run; a section is
skipped when the time budget could not hold it):
- env: torch / triton versions, the GPU;
- bandwidth: device-to-device copy bandwidth (read + write bytes / time);
- kernels: each Triton kernel of `engine.kernels` against its PyTorch reference on Moondream 2
  shapes in bf16 (32 rows, 32 heads of 64, pages of 16, contexts up to 1200, vocabulary 51200):
  attention relative error max|kernel - reference| / max|reference| <= 2e-2, KV write exact,
  sampling: greedy rows exact and sampled rows equal except at float-rounding boundaries
  (>= 97 % of rows); with timings of kernel and reference;
- engine_parity: the tiny model with kernels on vs off (tokens), pipelined vs blocking with kernels,
  every third image asked two prompts on one shared image prefix;
- cuda_graphs: decode and vision graphs vs the eager path (tokens of tiny and full size; replay
  vs eager outputs of every captured bucket, which must be equal);
- drafts: greedy answers with exact and altered drafts against none (same tokens, fewer steps),
  sticky answers that keep a draft whole, and a batch job's frames/s with and without drafts
  (whether `video` should draft on a GPU);
- bench_tiny / bench_full: `vlmstream bench` pipelined vs blocking at 1, 8, 32 streams for the tiny
  model and for the full-size layout with random bf16 weights drawn on the device (`random:moondream2`);
- single_query: a question with 3 answer tokens on a 378x378 image, full size: p50/p99 and TTFT;
- live: one 60 fps stream of distinct 640x360 frames for 10 s, full size: achieved fps, end to end;
- floor: decode step at batch 1 against weight bytes / measured bandwidth.

Needs torch, triton, numpy, pillow, tokenizers, safetensors (no gradio, av or outlines-core).
`--quick` shrinks every shape and uses `random:tiny` for the full-size layout: the CPU test of this
script runs it that way, kernels through Triton's interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget-s", type=float, default=450.0)
    p.add_argument("--quick", action="store_true")
    return p.parse_args(argv)


ARGS = _args()
if ARGS.device == "cpu":  # Triton decides at import whether kernels are interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.bench import BenchConfig, run_bench  # noqa: E402
from engine.kernels import kv_write, paged_attention, sampling  # noqa: E402

FULL = "random:tiny" if ARGS.quick else "random:moondream2"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _SyncWatch:
    """Counts the synchronising CUDA calls made while active (torch's sync debug mode), by the
    innermost line of this project that led to them. A step that waits for the device on the
    engine thread loses pipelining without any error (a blocking copy inside a step waits for
    the step before it); the engine itself only waits on a step's own event, which this mode
    does not count. A CUDA graph's first capture (a bucket's first use) synchronises by design:
    counted apart, as "capture ..."."""

    def __init__(self, device: torch.device):
        self.device, self.counts = device, {}

    def __enter__(self) -> "_SyncWatch":
        if self.device.type == "cuda":
            import warnings

            self._catch = warnings.catch_warnings()  # restores showwarning and the filters on exit
            self._catch.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._record
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        import traceback

        stack = traceback.extract_stack()[:-1]  # the thread that synchronised, this function aside
        ours = [f for f in stack if f.filename.startswith(str(ROOT))]
        frame = ours[-1] if ours else stack[-1]
        capture = any(Path(f.filename).match("torch/cuda/graphs.py") for f in stack)
        where = ("capture " if capture else "") + f"{Path(frame.filename).name}:{frame.lineno}"
        self.counts[where] = self.counts.get(where, 0) + 1

    def __exit__(self, *exc) -> None:
        if self.device.type != "cuda" or not hasattr(self, "_catch"):  # never entered
            return
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)

    @staticmethod
    def steps(counts: dict) -> int:
        """The synchronising calls of a section, graph captures apart."""
        return sum(n for where, n in counts.items() if not where.startswith("capture "))


def _time_ms(fn, device: torch.device, n: int = 10) -> float:
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1000.0 / n


def env(device: torch.device) -> dict:
    import triton

    out = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "device": str(device)}
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        out.update(gpu=prop.name, memory_gib=round(prop.total_memory / 2**30, 1))
    return out


def bandwidth(device: torch.device) -> dict:
    n = (64 if ARGS.quick else 2048) << 20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device, n=5 if ARGS.quick else 20)
    return {"bytes": n, "copy_ms": round(ms, 4), "gb_per_s": round(2 * n / ms / 1e6, 1)}


def kernels(device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16
    if ARGS.quick:
        B, H, HK, D, PS, max_len, R, V = 4, 4, 2, 16, 4, 40, 6, 203
    else:
        B, H, HK, D, PS, max_len, R, V = 32, 32, 32, 64, 16, 1200, 32, 51200
    pages_per_row = -(-max_len // PS)
    n_pages = B * pages_per_row + 1
    k = torch.randn(n_pages * PS, HK, D, generator=g, device=device).to(bf16)
    v = torch.randn(n_pages * PS, HK, D, generator=g, device=device).to(bf16)
    table = torch.randperm(n_pages - 1, generator=g, device=device)[: B * pages_per_row].view(B, pages_per_row)
    lens = torch.randint(max_len // 10, max_len + 1, (B,), generator=g, device=device)
    q = torch.randn(B, H, D, generator=g, device=device).to(bf16)
    args = (q, k, v, table, lens, PS, D ** -0.5)
    got = paged_attention.paged_attention_triton(*args).float()
    want = paged_attention.paged_attention_reference(*args).float()
    rel = float((got - want).abs().max() / want.abs().max())
    out = {"attention": {"rel_err": rel, "bound": 2e-2, "ok": rel <= 2e-2}}
    if not ARGS.quick:
        out["attention"].update(kernel_ms=round(_time_ms(lambda: paged_attention.paged_attention_triton(*args), device), 4),
                                reference_ms=round(_time_ms(lambda: paged_attention.paged_attention_reference(*args), device), 4))
    slots = torch.randperm(n_pages * PS, generator=g, device=device)[:B]
    k_new = torch.randn(B, HK, D, generator=g, device=device).to(bf16)
    v_new = torch.randn(B, HK, D, generator=g, device=device).to(bf16)
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    kv_write.kv_write_triton(k1, v1, k_new, v_new, slots)
    kv_write.kv_write_reference(k2, v2, k_new, v_new, slots)
    out["kv_write"] = {"exact": bool(torch.equal(k1, k2) and torch.equal(v1, v2))}
    out["kv_write"]["ok"] = out["kv_write"]["exact"]

    logits = (torch.randn(R, V, generator=g, device=device) * 4).to(bf16)
    allowed = (torch.rand(R, V, generator=g, device=device) > 0.2).to(torch.uint8)
    allowed[:, 0] = 1
    sup = torch.rand(R, generator=g, device=device) > 0.5
    temp = torch.rand(R, generator=g, device=device) + 0.3
    temp[: R // 4] = 0.0
    top_p = torch.rand(R, generator=g, device=device) * 0.5 + 0.5
    u = torch.rand(R, generator=g, device=device)
    sargs = (logits, allowed, sup, 3, temp, top_p, u)
    a = sampling.sample_triton(*sargs)
    b = sampling.sample_reference(*sargs)
    greedy_ok = bool(torch.equal(a[: R // 4], b[: R // 4]))
    match = float((a == b).float().mean())
    out["sampling"] = {"greedy_exact": greedy_ok, "match_fraction": match, "ok": greedy_ok and match >= 0.97,
                       "all_allowed": bool(allowed.gather(1, a[:, None]).all())}
    if not ARGS.quick:
        out["sampling"].update(kernel_ms=round(_time_ms(lambda: sampling.sample_triton(*sargs), device), 4),
                               reference_ms=round(_time_ms(lambda: sampling.sample_reference(*sargs), device), 4))
    return out


def _run_requests(cfg: EngineConfig, n: int, tokens: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 255, (240, 320, 3), dtype=np.uint8) for _ in range(n)]
    with Engine(cfg) as engine:
        handles = []
        for i, img in enumerate(images):
            params = SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, top_p=0.9, seed=i, max_tokens=tokens,
                                    ignore_eos=True)
            if i % 3:
                handles.append(engine.submit(img, caption="short", params=params))
                continue
            ref = engine.encode_image(img)  # several prompts on one image prefix: shared, refcounted pages
            handles += [engine.submit(ref, caption="short", params=params),
                        engine.submit(ref, question="How many shapes are there?", params=params)]
            ref.release()
        return [h.result(timeout=300).token_ids for h in handles]


def engine_parity(device: torch.device) -> dict:
    n, tokens = (2, 3) if ARGS.quick else (16, 32)
    base = dict(model="tiny", device=str(device))
    off = _run_requests(EngineConfig(**base, triton_kernels=False), n, tokens)
    on = _run_requests(EngineConfig(**base, triton_kernels=True), n, tokens)
    blocking = _run_requests(EngineConfig(**base, triton_kernels=True, pipeline_depth=1), n, tokens)
    same = sum(a == b for a, b in zip(on, off))
    return {"requests": len(on), "kernels_vs_torch_identical": same, "pipelined_vs_blocking_identical": on == blocking,
            "ok": on == blocking}


def cuda_graphs(device: torch.device) -> dict:
    """Decode graphs (per batch-size bucket) against the eager path: tokens, and replay vs eager logits."""
    if device.type != "cuda":
        return {"status": "CUDA only (the static decode step is tested on CPU in tests/test_graphs.py)", "ok": None}
    out = {}
    for model, n, tokens in (("tiny", 16, 32), (FULL, 6, 12)):
        base = dict(model=model, device=str(device))
        eager = _run_requests(EngineConfig(**base, cuda_graphs=False), n, tokens)
        graphs = _run_requests(EngineConfig(**base, cuda_graphs=True), n, tokens)
        out[model] = {"requests": n, "identical": sum(a == b for a, b in zip(eager, graphs))}
    worst = 0.0
    with Engine(EngineConfig(model="tiny", device=str(device), cuda_graphs=True)) as engine:
        _ = [h.result(timeout=120) for h in [engine.submit(np.zeros((64, 64, 3), np.uint8), caption="short",
                                                           params=SamplingParams(max_tokens=8)) for _ in range(5)]]
        g = engine.runner.graphs
        for n, (graph, replay_out) in g._graphs.items():
            _, views = g._static[n]
            slots, pos, write, lens, pages = views
            graph.replay()
            replayed = replay_out.float().clone()
            eager = g.forward(slots, pos, write, pages, lens).float()
            torch.cuda.synchronize(device)
            worst = max(worst, float((replayed - eager).abs().max()))
        out["buckets_captured"] = sorted(g._graphs)
        vg = engine.runner.vision_graphs
        for size, (graph, replay_out) in vg._graphs.items():
            graph.replay()
            replayed = replay_out.float().clone()
            eager = vg.encode(vg._static[size]).float()
            torch.cuda.synchronize(device)
            worst = max(worst, float((replayed - eager).abs().max()))
        out["vision_buckets_captured"] = sorted(vg._graphs)
    out["replay_vs_eager_max_abs"] = worst
    out["ok"] = worst == 0.0 and all(v["identical"] == v["requests"] for k, v in out.items() if isinstance(v, dict))
    return out


def drafts(device: torch.device) -> dict:
    """Greedy answers with drafts (exact, one token changed) against none, on the default CUDA path
    (graphs, kernels): the same tokens, in fewer steps. Draft steps of more rows than the largest
    decode graph run eagerly."""
    n, tokens = (2, 6) if ARGS.quick else (8, 24)
    rng = np.random.default_rng(4)
    images = [rng.integers(0, 255, (240, 320, 3), dtype=np.uint8) for _ in range(n)]
    params = SamplingParams(max_tokens=tokens)
    out = {"requests": n}
    with Engine(EngineConfig(model="tiny", device=str(device), max_batch_size=8)) as engine:
        def run(drafts, params=params):
            before = engine.stats().steps
            handles = [engine.submit(img, caption="short", params=params, draft=d) for img, d in zip(images, drafts)]
            return [h.result(timeout=300).token_ids for h in handles], engine.stats().steps - before

        plain, out["steps_without"] = run([None] * n)
        exact, out["steps_exact"] = run(plain)
        changed = [list(a) for a in plain]
        for a in changed:
            if a:
                a[len(a) // 2] = (a[len(a) // 2] + 1) % 64
        altered, out["steps_changed"] = run(changed)
        # Sticky answers (live's default): with a margin nothing beats, each image keeps another
        # image's answer whole (the preference is applied on the device after the sampling kernel).
        others = plain[1:] + plain[:1]
        sticky, out["steps_sticky"] = run(others, SamplingParams(max_tokens=tokens, sticky=1e6))
        out["sticky_kept"] = sum(a == b for a, b in zip(sticky, others))
        stats = engine.stats()
    out["identical_exact"] = sum(a == b for a, b in zip(plain, exact))
    out["identical_changed"] = sum(a == b for a, b in zip(plain, altered))
    out["draft_kept_of_proposed"] = [stats.draft_accepted, stats.draft_proposed]
    out["ok"] = (out["identical_exact"] == n and out["identical_changed"] == n and out["sticky_kept"] == n
                 and out["steps_exact"] < out["steps_without"])
    out["batch"] = _batch_drafts(device)
    return out


def _batch_drafts(device: torch.device) -> dict:
    """A batch job over a moving scene (32 frames in flight), each frame drafting with the latest
    finished answer or not: frames/s both ways, alternating (on CPU drafts made `video` slower)."""
    from dataclasses import replace

    from tinyvlm.world import render, sample_scene

    n = 8 if ARGS.quick else 96
    scene = sample_scene(np.random.default_rng(5), 640, 360, n_objects=2)
    frames = [render(replace(scene, objects=tuple(replace(o, cx=o.cx + 1.5 * t) for o in scene.objects)))
              for t in range(n)]
    params = SamplingParams(max_tokens=32)
    fps: dict[str, list[float]] = {"drafts": [], "none": []}
    answers = {}
    with Engine(EngineConfig(model="tiny", device=str(device))) as engine:
        engine.submit(frames[0], caption="short", params=params).result(timeout=300)  # warm-up
        for mode in ("none", "drafts", "none", "drafts"):
            t0, last, pending, out = time.perf_counter(), None, [], []
            for f in frames:
                pending.append(engine.submit(f, caption="short", params=params, draft=last if mode == "drafts" else None))
                if len(pending) >= 32:
                    out.append(pending.pop(0).result(timeout=300).token_ids)
                    last = out[-1]
            out += [h.result(timeout=300).token_ids for h in pending]
            fps[mode].append(round(n / (time.perf_counter() - t0), 1))
            answers[mode] = out
    return {"frames": n, "frames_per_s": fps, "identical": answers["drafts"] == answers["none"]}


def _bench(model: str, device: torch.device) -> dict:
    streams = (1, 4) if ARGS.quick else (1, 8, 32)
    cfg = BenchConfig(model=model, device=str(device), streams=streams, tokens=8 if ARGS.quick else 64,
                      repeats=1 if ARGS.quick else 3, frames=0, min_seconds=0.0 if ARGS.quick else 3.0)
    report = run_bench(cfg)
    if report["interrupted"]:  # run_bench keeps what it measured; here Ctrl-C ends the check
        raise KeyboardInterrupt
    rows = {}
    for row in report["results"]:
        rows[str(row["streams"])] = {
            "pipelined_tok_s": round(row["pipelined"]["tokens_per_s"], 1),
            "blocking_tok_s": round(row["blocking"]["tokens_per_s"], 1),
            "ratio": round(row["ratio"], 3),
            "busy_pipelined": round(row["pipelined"]["device_busy_fraction"], 3),
            "busy_blocking": round(row["blocking"]["device_busy_fraction"], 3),
            "ttft_ms_p50": round(row["pipelined"]["ttft_ms_p50"], 2),
            "identical_tokens": row["identical_tokens"],
        }
    return {"model": model, "streams": rows}


def bench_tiny(device: torch.device) -> dict:
    return _bench("tiny", device)


def bench_full(device: torch.device) -> dict:
    return _bench(FULL, device)


def single_query(device: torch.device) -> dict:
    n = 3 if ARGS.quick else 40
    image = np.random.default_rng(2).integers(0, 255, (378, 378, 3), dtype=np.uint8)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    totals, firsts = [], []
    with Engine(EngineConfig(model=FULL, device=str(device))) as engine:
        for _ in range(3):  # warm-up: allocator, kernels, graph captures
            engine.submit(image, question="What is in the image?", params=params).result(timeout=120)
        with _SyncWatch(device) as watch:
            for _ in range(n):
                out = engine.submit(image, question="What is in the image?", params=params).result(timeout=120)
                totals.append(out.timings_ms["total"])
                firsts.append(out.timings_ms["first_token"])
    q = lambda xs, p: round(float(np.percentile(xs, p)), 2)  # noqa: E731
    return {"model": FULL, "n": n, "answer_tokens": 3, "total_ms": {"p50": q(totals, 50), "p99": q(totals, 99)},
            "ttft_ms": {"p50": q(firsts, 50), "p99": q(firsts, 99)}, "host_syncs": watch.counts}


def live(device: torch.device) -> dict:
    from pipelines.live import LiveSession
    from pipelines.sources import Frame

    seconds, fps = (1.0, 30) if ARGS.quick else (10.0, 60)
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 255, (360, 640, 3), dtype=np.uint8) for _ in range(16)]
    with Engine(EngineConfig(model=FULL, device=str(device))) as engine:
        # 6 in flight whatever an answer takes (as `live --max-inflight 6`): the first steps'
        # compiles must not make this run one frame at a time
        session = LiveSession(engine, {"caption": "short"}, SamplingParams(temperature=0.0, max_tokens=32),
                              max_inflight=6, adapt=False)
        t0 = time.perf_counter()
        i = 0
        watch = _SyncWatch(device)
        while time.perf_counter() - t0 < seconds:
            if i == fps // 2:  # after half a second: graphs are captured (captures synchronise)
                watch.__enter__()
            session.offer(Frame("synthetic", i, i / fps, frames[i % len(frames)]))
            i += 1
            time.sleep(max(0.0, t0 + i / fps - time.perf_counter()))
        watch.__exit__(None, None, None)
        session.close()
        stats = session.stats()
        # Every result is in, but a cancelled (stale) frame's pages go back only when the step that
        # still included it commits ("finalize early, release late"): give the loop that moment.
        deadline = time.perf_counter() + 5.0
        while engine.stats().kv_pages_in_use and time.perf_counter() < deadline:
            time.sleep(0.01)
        pages = engine.stats().kv_pages_in_use
    e2e = stats["latency_ms"].get("end_to_end", {})
    return {"model": FULL, "seconds": seconds, "offered_fps": fps, "achieved_fps": round(stats["achieved_fps"], 2),
            "end_to_end_ms": e2e, "dropped": stats["dropped"], "cancelled_stale": stats["cancelled_stale"],
            "kv_pages_in_use_after": pages, "host_syncs": watch.counts}


def floor(device: torch.device, results: dict) -> dict:
    import math

    from engine.config import ModelConfig
    from engine.device import resolve_dtype
    from engine.models.loader import TINY_DIR, read_config
    from engine.models.weights import PREFIX, expected_shapes

    # Bytes a decode step must read: the text decoder's weights, from the layout (no second load).
    config = read_config(TINY_DIR) if ARGS.quick else ModelConfig()
    item = torch.empty((), dtype=resolve_dtype(None, device)).element_size()
    weight_bytes = item * sum(math.prod(shape) for key, shape in expected_shapes(config).items()
                              if key.startswith(PREFIX + "text."))
    bw = results.get("bandwidth", {}).get("gb_per_s")
    one = results.get("bench_full", {}).get("streams", {}).get("1")
    if not bw or not one:
        return {"status": "needs bandwidth and bench_full"}
    floor_ms = weight_bytes / (bw * 1e9) * 1000.0
    step_ms = 1000.0 / one["pipelined_tok_s"]
    return {"text_weight_bytes": weight_bytes, "floor_ms": round(floor_ms, 4), "step_ms": round(step_ms, 4),
            "step_over_floor": round(step_ms / floor_ms, 2), "target": 1.5}


SECTIONS = [("env", env, 5), ("bandwidth", bandwidth, 10), ("kernels", kernels, 40), ("engine_parity", engine_parity, 40),
            ("cuda_graphs", cuda_graphs, 1), ("drafts", drafts, 30), ("bench_tiny", bench_tiny, 60), ("bench_full", bench_full, 120),
            ("single_query", single_query, 40), ("live", live, 40), ("floor", None, 20)]


def main() -> int:
    """0 when every section ran without an error, 1 when one failed or was skipped for the budget
    (the table says which: it had exited 0 with every section failed), 2 for a wrong --device or
    --out, 130 for Ctrl-C."""
    try:
        device = torch.device(ARGS.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cuda", "cpu"):  # mps, gpu...: every section had failed
        print(f"gpu_check: --device must be cuda (or cuda:N) or cpu, got {ARGS.device!r}", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    results: dict = {"date": time.strftime("%Y-%m-%d"), "quick": ARGS.quick, "sections_s": {}}
    try:  # said now, not after the first section's minutes
        ARGS.out.write_text(json.dumps(results) + "\n")
    except OSError as e:
        print(f"gpu_check: cannot write --out {ARGS.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    try:
        return _run(device, results, t_start)
    except KeyboardInterrupt:
        print(f"gpu_check: interrupted; the sections done are in {ARGS.out}", file=sys.stderr)
        return 130


def _run(device: torch.device, results: dict, t_start: float) -> int:
    for name, fn, estimate in SECTIONS:
        left = ARGS.budget_s - (time.perf_counter() - t_start)
        if left < estimate and not ARGS.quick:
            results[name] = {"status": f"skipped: {left:.0f} s of budget left, needs ~{estimate} s"}
            continue
        t0 = time.perf_counter()
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        try:
            results[name] = floor(device, results) if fn is None else fn(device)
        except Exception as e:  # a failing section is a result too; the others still run
            results[name] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                             "traceback": traceback.format_exc(limit=4)}
        results["sections_s"][name] = round(time.perf_counter() - t0, 1)
        ARGS.out.write_text(json.dumps(results, indent=1, default=str) + "\n")  # partial results survive a kill
    results["total_s"] = round(time.perf_counter() - t_start, 1)
    ARGS.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(table(results))
    unchecked = [v for v in results.values() if isinstance(v, dict) and ("error" in v or "skipped" in str(v.get("status")))]
    return 1 if unchecked else 0


def table(r: dict) -> str:
    def get(*path, default="-"):
        x = r
        for p in path:
            if not isinstance(x, dict) or p not in x:
                return default
            x = x[p]
        return x

    attention = get("kernels", "attention", "rel_err")
    # counted on CUDA only, by the sections that ran: "-" otherwise (it read 0, the target, on CPU
    # and when both sections failed)
    counted = str(ARGS.device).startswith("cuda")  # not the env section's word: it may have failed
    syncs = [get(section, "host_syncs", default=None) for section in ("single_query", "live")]
    syncs = [x for x in syncs if isinstance(x, dict)] if counted else []
    rows = [
        ("attention kernel rel err", attention if attention == "-" else round(attention, 5), "<= 2e-2"),
        ("sampling kernel match", get("kernels", "sampling", "match_fraction"), ">= 0.97, greedy exact"),
        ("kv write exact", get("kernels", "kv_write", "exact"), "True"),
        ("pipelined == blocking (kernels)", get("engine_parity", "pipelined_vs_blocking_identical"), "True"),
        ("graph replay vs eager max abs", get("cuda_graphs", "replay_vs_eager_max_abs"), "0"),
        ("drafts: same tokens, fewer steps; sticky kept", get("drafts", "ok"), "True"),
        ("full: pipelined/blocking @1", get("bench_full", "streams", "1", "ratio"), ">= 1.10"),
        ("full: pipelined/blocking @32", get("bench_full", "streams", "32", "ratio"), ">= 1.25"),
        ("tiny: pipelined/blocking @32", get("bench_tiny", "streams", "32", "ratio"), ""),
        ("single query p50 ms", get("single_query", "total_ms", "p50"), "<= 30"),
        ("live 60 fps: achieved", get("live", "achieved_fps"), ">= 57"),
        ("live 60 fps: e2e p50 ms", get("live", "end_to_end_ms", "p50"), "<= 40"),
        ("host syncs (single query, live)", sum(map(_SyncWatch.steps, syncs)) if syncs else "-",
         "0 (graph captures apart)"),
        ("decode step / bandwidth floor", get("floor", "step_over_floor"), "<= 1.5"),
    ]
    errors = [f"{k}: {v['error']}" for k, v in r.items() if isinstance(v, dict) and "error" in v]
    w = max(len(a) for a, _, _ in rows)
    lines = [f"{'check':<{w}}  {'value':>12}  target"]
    lines += [f"{a:<{w}}  {str(b):>12}  {c}" for a, b, c in rows]
    lines += [f"error in {e}" for e in errors]
    lines += [f"{k} {v['status']}" for k, v in r.items() if isinstance(v, dict) and "skipped" in str(v.get("status"))]
    lines.append(f"total {r.get('total_s', '-')} s; full report: {ARGS.out}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
