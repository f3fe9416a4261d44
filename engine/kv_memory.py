"""How large the KV pool may be: its size by default (on a CPU, a share of the memory that the
machine, and any cgroup limit above this process, leaves), and the checks that a pool asked for
holds one full-context request and fits before it is allocated whole at start (`pool_pages`;
engine/kv_cache.py, engine/runner.py)."""

from __future__ import annotations

import os

from .engine_config import EngineConfig
from .errors import ConfigError


KV_SHARE_CPU = 0.25  # of the memory available at start, for a KV pool sized by default on a CPU


def page_bytes(page_size: int, loaded) -> int:
    t = loaded.config.text
    return 2 * t.n_layers * page_size * t.n_kv_heads * t.head_dim * loaded.dtype.itemsize


def default_pages(full: int, least: int, page_size: int, loaded) -> int:
    """The pool when kv_pages is not given: `full` (max_batch_size full-context requests and
    their images), on a CPU at most KV_SHARE_CPU of the memory available, and never less than
    `least`: one full-context request, and a page for each of max_batch_size requests. Moondream
    2's full pool for max_batch_size 32 is 16 GiB in bf16, all of it written at start (35 s
    before any work, 21.5 GB resident for `image` with two pictures), and in fp32 33 GiB, refused
    on a 24 GB machine. Requests that do not fit wait for pages, as with a small kv_pages; real
    answers are far shorter than the context."""
    if loaded.device.type != "cpu":
        return full
    return max(least, min(full, int(available_memory() * KV_SHARE_CPU) // page_bytes(page_size, loaded)))


def available_memory(cgroup: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> int:
    """What the kernel says can be allocated without swapping (MemAvailable), else all of it;
    under a memory limit (this process's cgroup or one above it, v2 or v1), no more than the
    tightest limit leaves: MemAvailable is the host's."""
    room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    room = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit, used in cgroup_limits(cgroup, membership):
        room = min(room, max(0, limit - used))
    return room


# Per cgroup version: its folder under the mount, and its files: limit, usage, and the reclaimable
# file cache in memory.stat (usage counts it: the weights read through a memory map, for one).
CGROUP_FILES = {"v2": ("", "memory.max", "memory.current", "inactive_file"),
                 "v1": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def cgroup_limits(root: str, membership: str) -> list[tuple[int, int]]:
    """(limit, bytes in use less inactive file cache) of each memory cgroup that bounds this
    process: its own and those above it, found through /proc/self/cgroup; unlimited ones left out."""
    paths = {"v2": "/"}  # a container's own namespace: the mount's root is its cgroup
    try:
        with open(membership, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:  # a line not in the kernel's form: the others still count
            continue
        if not parts[1]:
            paths["v2"] = parts[2]
        elif "memory" in parts[1].split(","):
            paths["v1"] = parts[2]
    out = []
    for version, path in paths.items():
        sub, limit_file, usage_file, cache_key = CGROUP_FILES[version]
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            folder = os.path.join(root, sub, *parts[:depth])
            try:
                with open(os.path.join(folder, limit_file)) as f, open(os.path.join(folder, usage_file)) as g:
                    limit, used = int(f.read()), int(g.read())
            except (OSError, ValueError):  # not there, or no limit ("max")
                continue
            try:
                with open(os.path.join(folder, "memory.stat")) as f:
                    cache = next((int(line.split()[1]) for line in f if line.split()[:1] == [cache_key]), 0)
            except (OSError, ValueError, IndexError):
                cache = 0
            out.append((limit, max(0, used - cache)))
    return out


def check_kv_fits(n_pages: int, page_size: int, loaded, cfg: EngineConfig) -> None:
    """The KV cache is allocated whole at start: one that cannot fit is a ConfigError, not the
    allocator's RuntimeError (max_batch_size=100000 asked for 81 GB) or, on a CPU whose memory
    is overcommitted, the process killed while zeroing it."""
    need = (n_pages + 1) * page_bytes(page_size, loaded)
    if loaded.device.type == "cuda":
        import torch

        room = torch.cuda.mem_get_info(loaded.device)[0]
    else:
        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > room:
        raise ConfigError(f"the KV cache for max_batch_size={cfg.max_batch_size} ({n_pages} pages) takes "
                          f"{need / 2**30:.1f} GiB, more than the {room / 2**30:.1f} GiB of "
                          f"{'free GPU memory' if loaded.device.type == 'cuda' else 'memory'}; lower "
                          "max_batch_size or kv_pages")


def pool_pages(cfg: EngineConfig, loaded) -> tuple[int, int, int]:
    """The KV pool for `cfg` and the loaded model, checked (ConfigError): its pages, those of an
    image's prefix, and those one full-context request on a new image needs (what images encoded
    ahead of their requests leave free: Budget.reserve_pages)."""
    mc, ps = loaded.config, cfg.page_size
    prefix_pages = -(-mc.prefix_len // ps)
    per_seq = -(-mc.text.max_context // ps)
    need = prefix_pages + per_seq - mc.prefix_len // ps
    n_pages = cfg.kv_pages or default_pages(cfg.max_batch_size * (per_seq + prefix_pages),
                                            max(need, cfg.max_batch_size), ps, loaded)
    if n_pages < need:
        raise ConfigError(f"kv_pages={n_pages} cannot hold one full-context request ({need} pages)")
    if cfg.max_batch_size > n_pages:  # each running request has a page of its own at least
        raise ConfigError(f"max_batch_size={cfg.max_batch_size} is more requests than the KV pool's {n_pages} "
                          "pages can run at once; lower max_batch_size (or raise kv_pages)")
    check_kv_fits(n_pages, ps, loaded, cfg)
    return n_pages, prefix_pages, need
