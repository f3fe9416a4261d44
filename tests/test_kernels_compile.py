"""Every Triton kernel compiles to a cubin for the H200 (sm_90), with the launchers' constants for
the tiny and the Moondream 2 layouts in every dtype, without a GPU: the interpreter the other
kernel tests use never lowers a kernel, so a compile error would otherwise first show in the
lent GPU's one short run."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_compile_for_the_h200(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compiled here, not read from an earlier run
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_kernels.py"), "--arch", "90", "--json"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    results = json.loads(proc.stdout)
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed
    assert proc.returncode == 0
    assert {(r["kernel"], r["model"], r["dtype"]) for r in results} == {
        (k, m, d) for k in ("paged_attention", "kv_write", "sampling", "sampling+constraint")
        for m in ("tiny", "moondream2") for d in ("bfloat16", "float16", "float32")}


def test_compile_kernels_refuses_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_kernels.py")], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stderr
