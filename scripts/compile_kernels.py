"""Compile every Triton kernel of `engine.kernels` for CUDA GPUs, on a machine without one.

    python scripts/compile_kernels.py [--arch 90,80] [--json]

Triton's interpreter (how the CPU tests run the kernels) executes a kernel as NumPy: it does not
lower it, so an operation the compiler rejects, a type it cannot unify across a branch, or a
register or shared-memory budget a real GPU would refuse shows up only when the kernel is first
launched on a GPU, and that is the lent H200's one short run (`scripts/gpu_check.py`). This
compiles each kernel all the way to a cubin (Triton's bundled ptxas) for each architecture,
with the compile-time constants the launchers use (`launch_constants`) for the tiny model's
layout and Moondream 2's, for the cache dtypes the engine runs (bf16, fp16, fp32).

Exit 0 when every kernel compiles, 1 otherwise (each failure is one line with its error).
TRITON_INTERPRET must not be set: interpreted kernels cannot be compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def layouts() -> dict[str, dict]:
    """Kernel-relevant sizes of the models the engine serves."""
    from engine.config import ModelConfig
    from engine.models.loader import TINY_DIR, read_config

    out = {}
    for name, cfg in (("tiny", read_config(TINY_DIR)), ("moondream2", ModelConfig())):
        t = cfg.text
        out[name] = dict(n_heads=t.n_heads, n_kv_heads=t.n_kv_heads, head_dim=t.head_dim,
                         vocab_size=t.vocab_size, page_size=16)
    return out


def cases(layout: dict, dtype: str) -> list[tuple[str, object, dict, dict]]:
    """(name, kernel, signature, constants) for every launch of a layout in one dtype; pointer and
    integer types are those the runner passes (int64 page tables, lengths and slots)."""
    from engine.kernels import kv_write, paged_attention, sampling

    t = DTYPES[dtype]
    attention = paged_attention.launch_constants(layout["n_heads"], layout["n_kv_heads"], layout["head_dim"],
                                                 layout["page_size"])
    sig = {"q_ptr": f"*{t}", "k_ptr": f"*{t}", "v_ptr": f"*{t}", "table_ptr": "*i64", "lens_ptr": "*i64",
           "out_ptr": f"*{t}", **{s: "i32" for s in ("stride_qb", "stride_qh", "stride_ks", "stride_kh", "stride_tb",
                                                     "stride_ob", "stride_oh")}, "scale": "fp32"}
    out = [("paged_attention", paged_attention._paged_attention_kernel, sig, attention)]
    sig = {"k_cache": f"*{t}", "v_cache": f"*{t}", "k_new": f"*{t}", "v_new": f"*{t}", "slots": "*i64",
           "stride_cache": "i32", "stride_new": "i32", "n_elems": "i32"}
    out.append(("kv_write", kv_write._kv_write_kernel, sig, kv_write.launch_constants(layout["n_kv_heads"],
                                                                                       layout["head_dim"])))
    sig = {"logits_ptr": f"*{t}", "allowed_ptr": "*u8", "sup_ptr": "*i8", "temp_ptr": "*fp32", "top_p_ptr": "*fp32",
           "u_ptr": "*fp32", "out_ptr": "*i64", "stride_l": "i32", "stride_a": "i32", "V": "i32", "suppress_id": "i32"}
    for allowed in (False, True):
        out.append((f"sampling{'+constraint' if allowed else ''}", sampling._sample_kernel, sig,
                    sampling.launch_constants(layout["vocab_size"], allowed)))
    return out


def compile_all(archs: list[int]) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = []
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for model, layout in layouts().items():
            for dtype in DTYPES:
                for name, kernel, sig, constants in cases(layout, dtype):
                    row = dict(kernel=name, arch=f"sm_{arch}", model=model, dtype=dtype)
                    t0 = time.perf_counter()
                    try:
                        src = ASTSource(kernel, signature={**sig, **{k: "constexpr" for k in constants}},
                                        constexprs=constants)
                        compiled = triton.compile(src, target=target)
                        row.update(ok=bool(compiled.asm.get("cubin")), shared_bytes=compiled.metadata.shared)
                    except Exception as e:  # the compiler's message is the result
                        msg = " ".join(str(e).split())  # the cause comes after the kernel's source
                        row.update(ok=False, error=f"{type(e).__name__}: ...{msg[-400:]}")
                    row["seconds"] = round(time.perf_counter() - t0, 2)
                    results.append(row)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="90,80", help="compute capabilities, e.g. 90 (H100/H200) and 80 (A100)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON list")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_kernels: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)", file=sys.stderr)
        return 2
    try:
        archs = [int(a) for a in args.arch.split(",")]
    except ValueError:
        print(f"compile_kernels: --arch takes numbers such as 90,80, not {args.arch!r}", file=sys.stderr)
        return 2
    results = compile_all(archs)
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            status = "ok" if r["ok"] else f"FAILED {r.get('error', 'no cubin')}"
            print(f"{r['kernel']:<22} {r['arch']:<6} {r['model']:<11} {r['dtype']:<9} {status}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
