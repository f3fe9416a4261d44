"""The host half of an engine step: a StepPlan turned into the device inputs its forward reads.

`step_inputs(runner, plan)` runs on the engine thread when the step is launched. Every
host-to-device copy the step needs (crops, positions, KV slots, page tables, masks, sampling
parameters) is queued here, not inside the step: on CUDA a copy made by the step's function
would queue on the compute stream behind the step in flight. `Runner.launch` then runs the
forward and sampling over these inputs on the device.

Rows: a step samples one token per row, in this order: each prompt prefill that ends in this
step (its first answer token; `n_first` rows), then one row per decode and one per draft token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .models.text import KV_ALIGN
from .models.tiling import stage_crops
from .sampler import step_uniform
from .scheduler import PrefillChunk, StepPlan
from .sequence import Sequence

if TYPE_CHECKING:
    from .runner import Runner


@dataclass
class StepInputs:
    images: list  # per image: crops, tiling, prefix KV slots, prefix pages, embeddings (or None)
    crops: torch.Tensor | None  # uint8, on the device: the crops of images without embeddings, in order
    prefix: tuple | None  # prefix_inputs(images)
    # Per group of chunks of one length and key span: ids, positions, KV slots, pages, mask, the
    # prefix pages to copy into the prompts' own, the group's rows that sample (or None).
    prefills: list
    decode: tuple | None  # an eager decode: slots, positions, KV slots, pages, mask
    graph_decode: tuple | None  # a decode through a graph: its bucket, packed inputs, rows
    fed: torch.Tensor | None  # the input tokens of rows the host feeds (drafts), after the slots
    rows: list[Sequence]  # the sequences that sample a token, in row order
    n_first: int
    sampling: tuple | None  # per row: slot, temperature, top-p, uniform draw, not a first token
    all_greedy: bool
    sticky: tuple | None  # per row: the token a sticky sequence prefers (or -1), its stickiness
    constraint_groups: list  # per automaton: it, its rows, their slots, which rows are first tokens
    fused: tuple | None  # fused_inputs(...): ids, decode slots, the rest, for the one-call TorchScript forward


def step_inputs(runner: Runner, plan: StepPlan) -> StepInputs:
    P, ps, dev = runner.config.prefix_len, runner.page_size, runner.device
    images = [(img.crops, img.tiling, runner.kv_slots(img.pages)[:P], padded(img.pages, aligned(P, ps) // ps),
               img.embeds) for img in plan.images]
    todo = [c for c, _, _, _, e in images if e is None]  # images the vision stage has not encoded
    crops = stage_crops(np.concatenate(todo), dev) if todo else None
    prefix = prefix_inputs(runner, images) if images else None
    prefills, rows = _prefills(runner, plan.prefills)
    # Per row: the token a sticky sequence prefers there (SamplingParams.sticky), or -1.
    prefer = [_at(s.sticky_tail(), 0) for s in rows]
    n_first = len(rows)
    decode, graph_decode, fed = _decodes(runner, plan, rows, prefer)

    params = [s.params for s in rows]
    sampling = None
    if rows:
        r = len(rows)
        floats = to(dev, [p.temperature for p in params] + [p.top_p for p in params]
                    + [step_uniform(p.seed, s.launched) for p, s in zip(params, rows)], torch.float32)
        sampling = (to(dev, [s.slot for s in rows]), floats[:r], floats[r:2 * r], floats[2 * r:],
                    torch.arange(r, device=dev) >= n_first)
    sticky = None
    if any(t >= 0 for t in prefer):
        sticky = (to(dev, prefer), to(dev, [p.sticky for p in params], torch.float32))
    groups: dict[int, tuple] = {}
    for i, s in enumerate(rows):
        if s.constraint is not None:
            groups.setdefault(id(s.constraint), (s.constraint, []))[1].append(i)
    constraint_groups = [(automaton, to(dev, idx), to(dev, [rows[i].slot for i in idx]),
                          to(dev, [i < n_first for i in idx], torch.bool)) for automaton, idx in groups.values()]
    # One TorchScript call for the step's text forwards (CPU); decode graphs (CUDA, or static
    # graphs in tests) keep their own call.
    fused = None
    if runner.scripted is not None and runner.graphs is None:
        fused = fused_inputs(runner, images, prefix, prefills, decode)
    return StepInputs(images, crops, prefix, prefills, decode, graph_decode, fed, rows, n_first, sampling,
                      all(p.temperature == 0 for p in params), sticky, constraint_groups, fused)


def _prefills(runner: Runner, chunks: list[PrefillChunk]) -> tuple[list, list[Sequence]]:
    """The prompt chunks' inputs, and the sequences whose prompt ends here (they sample first).

    Chunks of equal length and key span run as one batched forward (one sequence has at most one
    chunk a step, so batching never reorders a sequence's own chunks): a step admitting eight
    frames runs one 8-row prompt prefill instead of eight 1-row ones."""
    P, ps, dev = runner.config.prefix_len, runner.page_size, runner.device
    groups: dict[tuple[int, int], list[PrefillChunk]] = {}
    for ch in chunks:
        groups.setdefault((ch.length, aligned(P + ch.start + ch.length, ps)), []).append(ch)
    prefills, rows = [], []
    for (length, n_ctx), group in groups.items():
        positions = np.stack([np.arange(P + ch.start, P + ch.start + length) for ch in group])
        cows = [(ch.seq.image.pages[P // ps], ch.seq.pages[0]) for ch in group if ch.start == 0 and P % ps]
        last = [i for i, ch in enumerate(group) if ch.last]
        prefills.append((
            to(dev, np.stack([ch.seq.prompt[ch.start:ch.start + length] for ch in group])),
            to(dev, positions),
            to(dev, np.concatenate([ch.seq.kv_slots[pos] for ch, pos in zip(group, positions)])),
            to(dev, np.stack([padded(ch.seq.page_table, n_ctx // ps) for ch in group])),
            to(dev, np.arange(n_ctx)[None, None, :] <= positions[:, :, None], torch.bool)[:, None],
            cows, to(dev, last) if last else None,
        ))
        rows.extend(group[i].seq for i in last)
    return prefills, rows


def _decodes(runner: Runner, plan: StepPlan, rows: list[Sequence], prefer: list[int]) -> tuple:
    """The decode rows' inputs: (eager decode, graph decode, fed tokens); appends their rows to
    `rows` and their preferred tokens to `prefer`.

    One row per decode, plus one per draft token at the positions after it. Rows whose input the
    host knows are fed from the host: draft tokens, and the next row of a sequence after a draft
    step (the device's last token for its slot came from a draft row that may not have been kept)."""
    first_drafts = [ch for ch in plan.prefills if ch.draft]
    if not (plan.decodes or first_drafts):
        return None, None, None
    P, ps, dev = runner.config.prefix_len, runner.page_size, runner.device
    seqs, slots, positions, fed_tokens = [], [], [], []

    def feed(s: Sequence, p0: int, tokens: list[int], first: int) -> None:
        tail = s.sticky_tail()
        for j, t in enumerate(tokens):
            slots.append(runner.fed_base + len(fed_tokens))
            fed_tokens.append(t)
            positions.append(p0 + j)
            seqs.append(s)
            prefer.append(_at(tail, first + j))

    for s, d in zip(plan.decodes, plan.drafts):
        p0 = P + len(s.prompt) + s.launched - 1
        if d or (s.drafted and not s.inflight):
            feed(s, p0, [s.tokens[-1]] + d, 0)
        else:
            slots.append(s.slot)
            positions.append(p0)
            seqs.append(s)
            prefer.append(_at(s.sticky_tail(), 0))
    for ch in first_drafts:  # from the first answer token on, which this step's prompt row samples
        feed(ch.seq, P + len(ch.seq.prompt), ch.draft, 1)
    rows.extend(seqs)
    b = len(seqs)
    positions = np.array(positions)
    write = np.array([s.kv_slots[p] for s, p in zip(seqs, positions)])
    fed = to(dev, fed_tokens) if fed_tokens else None
    graphs = runner.graphs
    # Draft rows can outnumber the largest decode graph: such a step runs eagerly.
    if graphs is not None and b <= graphs.sizes[-1]:
        n, packed = graphs.host_inputs(slots, positions, write, [s.page_table for s in seqs])
        return None, (n, to(dev, packed), b), fed
    n_ctx = aligned(int(positions.max()) + 1, ps)
    gather = np.stack([padded(s.page_table, n_ctx // ps) for s in seqs])
    # One host-to-device transfer for the step's integer inputs instead of four.
    packed = to(dev, np.concatenate([slots, positions, write, gather.reshape(-1)]))
    pos_d = packed[b:2 * b]
    decode = (packed[:b], pos_d[:, None], packed[2 * b:3 * b], packed[3 * b:].view(b, -1),
              (torch.arange(n_ctx, device=dev)[None, :] <= pos_d[:, None])[:, None, None, :])
    return decode, None, fed


def prefix_inputs(runner: Runner, images: list) -> tuple[torch.Tensor, ...]:
    """Positions (n_img, P), KV slots (n_img * P,), pages (n_img, L / ps) and the bidirectional
    mask of the images' prefixes."""
    P, dev = runner.config.prefix_len, runner.device
    write = to(dev, np.concatenate([w for _, _, w, _, _ in images]))
    pages = to(dev, np.stack([g for _, _, _, g, _ in images]))
    L = pages.shape[1] * runner.page_size
    mask = (torch.arange(L, device=dev) < P).expand(P, L)[None, None]
    return torch.arange(P, device=dev).expand(len(images), P), write, pages, mask


def fused_inputs(runner: Runner, images: list, prefix: tuple | None, prefills: list, decode: tuple | None) -> tuple:
    """What step_forward takes besides the prefix rows: the prompt rows' ids, the decode rows'
    slots, and (positions, KV slots, the prefix pages copied into prompts' own pages, each
    group's shape, pages and mask, the rows that sample)."""
    P, ps = runner.config.prefix_len, runner.page_size
    pos, write, shapes, pages, masks, sample, copies = [], [], [], [], [], [], []
    n = 0
    if images:
        positions, w, gather, mask = prefix
        pos.append(positions.reshape(-1))
        write.append(w)
        shapes.append([len(images), P])
        pages.append(gather)
        masks.append(mask)
        n += len(images) * P
    for ids, positions, w, gather, mask, cows, last in prefills:
        b, t = ids.shape
        pos.append(positions.reshape(-1))
        write.append(w)
        shapes.append([b, t])
        pages.append(gather)
        masks.append(mask)
        if last is not None:
            sample.append(n + last * t + t - 1)
        # The positions of the prefix's partial last page, which `copy_page` would copy.
        copies += [(src * ps + j, dst * ps + j) for src, dst in cows for j in range(P % ps)]
        n += b * t
    if decode is not None:
        slots_d, pos_d, w, gather, mask = decode
        pos.append(pos_d.reshape(-1))
        write.append(w)
        shapes.append([len(slots_d), 1])
        pages.append(gather)
        masks.append(mask)
        sample.append(n + torch.arange(len(slots_d)))
    copy = to(runner.device, np.array(copies, dtype=np.int64).reshape(-1, 2).T)
    none = torch.zeros(0, dtype=torch.int64)
    # The prompts' ids here; the decode rows' (the last tokens of their slots) are read in the call.
    ids = torch.cat([p[0].reshape(-1) for p in prefills]) if prefills else none
    return ids, none if decode is None else decode[0], (
        torch.cat(pos), torch.cat(write), copy[0], copy[1], shapes, pages, masks, torch.cat(sample) if sample else none)


def to(device: torch.device, x: np.ndarray | list, dtype=torch.int64) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x), dtype=dtype).to(device, non_blocking=True)


def aligned(n: int, page_size: int) -> int:
    """Key length to attend over: whole pages, and a multiple of KV_ALIGN (batch invariance)."""
    step = np.lcm(page_size, KV_ALIGN)
    return int(-(-n // step) * step)


def padded(page_table: list[int], n: int) -> np.ndarray:
    """The first n pages of a page table; past the sequence's own pages, page 0 (always masked)."""
    pages = np.asarray(page_table, dtype=np.int64)
    return pages[:n] if len(pages) >= n else np.pad(pages, (0, n - len(pages)))


def _at(tail: tuple[int, ...], j: int) -> int:
    return tail[j] if j < len(tail) else -1
