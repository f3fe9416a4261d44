"""The GPU check script runs end to end on CPU in its quick mode (kernels in Triton's interpreter,
the packages the GPU machine lacks made unimportable), so the one run on a lent GPU does not fail
on a bug that a CPU could have shown."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The lent GPU machine starts without these (its image has torch, triton, numpy, pillow,
# tokenizers, safetensors): the script must run with every one of them unimportable.
ABSENT_ON_THE_GPU_MACHINE = ("av", "gradio", "gradio_client", "outlines_core", "hypothesis", "playwright")

_WITHOUT = """import runpy, sys
absent = set(sys.argv[1].split(","))
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in absent:
            raise ImportError(f"no module named {name!r} (absent on the GPU machine)")
sys.meta_path.insert(0, Absent())
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_gpu_check_quick_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _WITHOUT, ",".join(ABSENT_ON_THE_GPU_MACHINE),
                           str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    errors = {k: v["error"] for k, v in r.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    assert r["kernels"]["attention"]["ok"] and r["kernels"]["kv_write"]["ok"] and r["kernels"]["sampling"]["ok"]
    assert r["engine_parity"]["pipelined_vs_blocking_identical"]
    assert r["drafts"]["ok"] and r["drafts"]["batch"]["identical"], r["drafts"]
    assert set(r["bench_full"]["streams"]) == {"1", "4"} and r["bench_full"]["model"] == "random:tiny"
    assert all(row["identical_tokens"] for row in r["bench_tiny"]["streams"].values())
    assert r["single_query"]["total_ms"]["p50"] > 0
    assert r["live"]["achieved_fps"] > 0 and r["live"]["kv_pages_in_use_after"] == 0
    assert r["live"]["host_syncs"] == {} and r["single_query"]["host_syncs"] == {}  # counted on CUDA only
    assert r["floor"]["step_over_floor"] > 0
    assert "decode step / bandwidth floor" in proc.stdout  # the table comes last


def test_gpu_check_says_when_there_is_no_gpu(tmp_path):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr


def test_sync_watch_names_the_project_line_and_sets_captures_apart(monkeypatch):
    """What the GPU run's "host syncs" row rests on, minus CUDA itself: a synchronising call is
    counted at the innermost line of this project that led to it, other warnings are ignored,
    and graph captures do not count against the steps."""
    import importlib.util

    import torch

    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--device", "cpu", "--quick"])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)

    watch = gpu_check._SyncWatch(torch.device("cuda"))  # never entered: only its bookkeeping runs

    def engine_code():  # stands for the project line that made a blocking copy
        watch._record("called a synchronizing CUDA operation", UserWarning, "torch/cuda/__init__.py", 1)

    engine_code()
    engine_code()
    watch._record("some other warning", UserWarning, "x.py", 1)
    line = engine_code.__code__.co_firstlineno + 1
    assert watch.counts == {f"test_gpu_check.py:{line}": 2}
    watch.counts["capture graphs.py:10"] = 3
    assert gpu_check._SyncWatch.steps(watch.counts) == 2


def test_gpu_check_says_what_it_could_not_check(tmp_path):
    """A run that checked nothing exited 0 (every section failed for --device mps; seven skipped
    for the budget, their rows a plain "-"), and a wrong --device or --out was a traceback, the
    latter after the first section's work."""
    script = [sys.executable, str(ROOT / "scripts" / "gpu_check.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for args, said in ((["--device", "mps"], "--device must be cuda (or cuda:N) or cpu, got 'mps'"),
                       (["--device", "gpu"], "got 'gpu'"),
                       (["--device", "cpu", "--out", str(tmp_path / "none" / "x.json")], "cannot write --out")):
        proc = subprocess.run(script + args, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-1000:]
    out = tmp_path / "short.json"
    proc = subprocess.run(script + ["--device", "cpu", "--budget-s", "5", "--out", str(out)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 1, proc.stderr[-1000:]
    assert "kernels skipped: " in proc.stdout and "live skipped: " in proc.stdout
    assert re.search(r"host syncs \(single query, live\) +- ", proc.stdout), proc.stdout  # not 0, the target
