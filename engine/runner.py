"""Device work of one engine step: build its inputs on the host, launch forward + sampling.

A step runs, in this order on the device: vision encoding of the step's images (all crops in
one batch; on CPU the vision thread has done it already, engine/vision_stage.py) and their
bidirectional prefix prefill; prompt prefill chunks; one batched decode
forward; then sampling of every row that produces a token (first tokens of finished prefills,
decode rows). On CPU with TorchScript the prefixes, chunks and decode rows are one call
(`scripted.step_forward`), with the same results. Sampled tokens are scattered into
`last_token[slot]` on the device, where the next step's decode reads them without a host round
trip, and copied into the host buffer of the step's ping-pong slot. A slot is reused only after
its step was committed.

KV lives in pages: `k`/`v` are (n_layers, n_pages * page_size, n_kv_heads, head_dim); position p
of a sequence is at flat index page_table[p // page_size] * page_size + p % page_size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .device import Executor, Pending
from .models.loader import LoadedModel
from .models.text import KV_ALIGN, attention
from .models.tiling import crops_to_tensor, normalize_crops, stage_crops
from .reference import exact_attention
from .sampler import advance_constraints, apply_constraints, constraint_mask, sample, step_uniform, stick, suppress
from .scheduler import StepPlan
from .sequence import Sequence


VISION_GRAPH_CROPS = 64  # largest crop-count bucket with a vision graph; more crops run eagerly


@dataclass
class StepResult:
    rows: list[Sequence]  # sequences that got a token this step, in row order
    tokens: torch.Tensor  # host buffer view, valid once the step is done
    busy_ms: dict[str, float] = field(default_factory=dict)


class _Slot:
    def __init__(self, rows: int, device: torch.device):
        self.tokens = torch.zeros(rows, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.busy = False


class Runner:
    def __init__(self, loaded: LoadedModel, n_pages: int, page_size: int, max_batch: int, executor: Executor,
                 kernels: bool = False, graphs: str | None = None, script: bool = False, draft_rows: int = 0):
        self.model = loaded.model
        self.scripted = None
        if script:
            from .scripted import flat_vision_weights, flat_weights, scripted, warm_up

            self.scripted = scripted()
            if self.scripted is not None:
                t = loaded.config.text
                self.vision_weights = flat_vision_weights(loaded.model.vision)
                # The arguments every text call shares, after its inputs and the KV cache.
                rope, text_weights = loaded.model.text.rope_tables(loaded.device), flat_weights(loaded.model.text)
                self._text_args = (*rope, text_weights,
                                   t.n_layers, t.n_heads, t.n_kv_heads, t.head_dim, t.rot_dim, page_size,
                                   loaded.model.text.min_rows, loaded.model.text.min_rows_ff,
                                   loaded.model.text.row_buckets)
                warm_up(self.scripted, self._text_args, self.vision_weights, loaded.model.vision.cfg, t,
                        page_size, loaded.dtype, exact_attention(loaded))
        self.kernels = None
        if kernels:  # imported only here: Triton decides at import whether to interpret (CPU tests)
            from .kernels import kv_write, paged_attention, sampling

            self.kernels = (kv_write.kv_write_triton, paged_attention.paged_attention_triton, sampling.sample_triton)
        self.config = loaded.config
        self.device = loaded.device
        self.page_size = page_size
        self.exact = exact_attention(loaded)
        self.executor = executor
        t = loaded.config.text
        # With decode graphs, one page past the pool is scratch for padding rows, and one token
        # slot past max_batch is theirs.
        shape = (t.n_layers, (n_pages + (graphs is not None)) * page_size, t.n_kv_heads, t.head_dim)
        self.k = torch.zeros(shape, dtype=loaded.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=loaded.dtype, device=self.device)
        if self.scripted is not None:
            from .scripted import held_in_cpp

            self._held = held_in_cpp([self.k, self.v, *rope, *text_weights, *self.vision_weights])
        self.draft_rows = draft_rows  # draft tokens per step at most (engine/scheduler.py)
        # Past the slots (and the graphs' padding slot): the inputs of rows the host feeds itself
        # (draft rows, and the next row of a sequence after a draft step), written each step.
        self._fed_base = max_batch + 1
        self.last_token = torch.zeros(self._fed_base + max_batch + self.draft_rows, dtype=torch.int64,
                                      device=self.device)
        self.graphs = self.vision_graphs = None
        if graphs is not None:
            from .graphs import DecodeGraphs, VisionGraphs

            self.graphs = DecodeGraphs(self._static_decode, max_batch, -(-t.max_context // page_size),
                                       pad_slot=max_batch, scratch_page=n_pages, page_size=page_size,
                                       device=self.device, capture=graphs == "capture")
            vc = loaded.config.vision
            self.vision_graphs = VisionGraphs(self.model.vision.encode, VISION_GRAPH_CROPS,
                                              (vc.in_channels, vc.crop_size, vc.crop_size), loaded.dtype,
                                              self.device, capture=graphs == "capture")
        self.fsm_state = torch.zeros(max_batch, dtype=torch.int64, device=self.device)
        self.max_rows = 2 * max_batch + self.draft_rows  # decodes, their drafts, first tokens of prefills
        self.slots = [_Slot(self.max_rows, self.device), _Slot(self.max_rows, self.device)]

    def kv_slots(self, page_table: list[int]) -> np.ndarray:
        """Flat KV index of every position covered by a page table, in position order."""
        pages = np.asarray(page_table, dtype=np.int64)
        return (pages[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)

    def copy_page(self, src: int, dst: int) -> None:
        ps = self.page_size
        self.k[:, dst * ps:(dst + 1) * ps] = self.k[:, src * ps:(src + 1) * ps]
        self.v[:, dst * ps:(dst + 1) * ps] = self.v[:, src * ps:(src + 1) * ps]

    def _attend(self, write_idx: torch.Tensor, gather_pages: torch.Tensor, mask: torch.Tensor):
        """attend() for TextModel: store new k/v at write_idx, attend over the pages gather_pages (B, L / ps).

        Keys are gathered a page at a time (index_select of page_size * heads * dim contiguous
        values) rather than a position at a time: the same tensor, 5x faster on CPU, where the
        gather was a third of a 32-row decode step.
        """
        ps = self.page_size

        def attend(layer: int, q, k, v):
            b, hk, t, d = k.shape
            self.k[layer].index_copy_(0, write_idx, k.transpose(1, 2).reshape(b * t, hk, d))
            self.v[layer].index_copy_(0, write_idx, v.transpose(1, 2).reshape(b * t, hk, d))
            n, flat = gather_pages.shape[0], gather_pages.reshape(-1)
            keys = self.k[layer].view(-1, ps, hk, d).index_select(0, flat).view(n, -1, hk, d).transpose(1, 2)
            values = self.v[layer].view(-1, ps, hk, d).index_select(0, flat).view(n, -1, hk, d).transpose(1, 2)
            return attention(q, keys, values, mask, self.exact)

        return attend

    def _attend_kernels(self, write_idx: torch.Tensor, pages_BP: torch.Tensor, seq_lens_B: torch.Tensor):
        """attend() for one decode token per row through the Triton kernels (KV write, paged attention)."""
        kv_write, paged_attention, _ = self.kernels
        ps = self.page_size

        def attend(layer: int, q, k, v):
            kv_write(self.k[layer], self.v[layer], k[:, :, 0], v[:, :, 0], write_idx)
            out = paged_attention(q[:, :, 0], self.k[layer], self.v[layer], pages_BP, seq_lens_B, ps,
                                  q.shape[-1] ** -0.5)
            return out[:, :, None]

        return attend

    def _static_decode(self, slots_B, pos_B, write_B, pages_BP, lens_B) -> torch.Tensor:
        """The decode forward of DecodeGraphs: fixed shapes, reads only its inputs and fixed tensors."""
        if self.kernels:
            attend = self._attend_kernels(write_B, pages_BP, lens_B)
        else:
            from .kernels.kv_write import kv_write_reference
            from .kernels.paged_attention import paged_attention_reference

            def attend(layer: int, q, k, v):
                kv_write_reference(self.k[layer], self.v[layer], k[:, :, 0], v[:, :, 0], write_B)
                out = paged_attention_reference(q[:, :, 0], self.k[layer], self.v[layer], pages_BP, lens_B,
                                                self.page_size, q.shape[-1] ** -0.5)
                return out[:, :, None]
        text = self.model.text
        h = text(text.embed(self.last_token[slots_B])[:, None], pos_B[:, None], attend)
        return text.logits(h[:, -1])

    def _hidden(self, x_BTC, pos_BT, write, pages_BP, mask) -> torch.Tensor:
        """TextModel.forward over the paged cache (the eager path; TorchScript runs `_fused`)."""
        return self.model.text(x_BTC, pos_BT, self._attend(write, pages_BP, mask))

    def _fused(self, x_prefix: torch.Tensor, ids: torch.Tensor, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """scripted.step_forward over this runner's cache and weights; inputs: `_fused_inputs`."""
        return self.scripted.step(x_prefix, ids, *inputs, self.k, self.v, *self._text_args, self.exact)

    def _fused_inputs(self, images: list, prefix: tuple | None, prefills: list, decode: tuple | None) -> tuple:
        """What step_forward takes besides its rows' inputs: positions, KV slots, the prefix pages
        copied into prompts' own pages, each group's shape, pages and mask, the rows that sample.
        prefix: `_prefix_inputs(images)`."""
        P, ps = self.config.prefix_len, self.page_size
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
        copy = self._to(np.array(copies, dtype=np.int64).reshape(-1, 2).T)
        none = torch.zeros(0, dtype=torch.int64)
        return (torch.cat(pos), torch.cat(write), copy[0], copy[1], shapes, pages, masks,
                torch.cat(sample) if sample else none)

    def _to(self, x: np.ndarray | list, dtype=torch.int64) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x), dtype=dtype).to(self.device, non_blocking=True)

    def launch(self, plan: StepPlan, step_id: int) -> tuple[Pending, _Slot]:
        """Build the step's inputs on the host and launch it; returns its pending handle and slot."""
        slot = self.slots[step_id % 2]
        if slot.busy:
            raise AssertionError("ping-pong slot reused before its step was committed")
        slot.busy = True
        cfg, ps = self.config, self.page_size
        P = cfg.prefix_len

        images = []
        for img in plan.images:
            images.append((img.crops, img.tiling, self.kv_slots(img.pages)[:P],
                           _padded(img.pages, _aligned(P, ps) // ps), img.embeds))
        # The step's inputs are copied to the device here, before the step (the crops of images
        # the vision stage has not encoded, the prefixes' slots, pages and mask): on CUDA a copy
        # inside the step would queue on the compute stream behind the step in flight.
        todo = [c for c, _, _, _, e in images if e is None]
        crops = stage_crops(np.concatenate(todo), self.device) if todo else None
        prefix = self._prefix_inputs(images) if images else None

        # Chunks of equal length and key span run as one batched forward (one sequence has at most
        # one chunk per step, so batching never reorders a sequence's own chunks): a step admitting
        # eight frames runs one 8-row prompt prefill instead of eight 1-row ones.
        groups: dict[tuple[int, int], list] = {}
        for ch in plan.prefills:
            pos0 = P + ch.start
            groups.setdefault((ch.length, _aligned(pos0 + ch.length, ps)), []).append(ch)
        prefills, rows = [], []
        for (length, n_ctx), chunks in groups.items():
            positions = np.stack([np.arange(P + ch.start, P + ch.start + length) for ch in chunks])
            cows = [(ch.seq.image.pages[P // ps], ch.seq.pages[0]) for ch in chunks if ch.start == 0 and P % ps]
            last = [i for i, ch in enumerate(chunks) if ch.last]
            prefills.append((
                self._to(np.stack([ch.seq.prompt[ch.start:ch.start + length] for ch in chunks])),
                self._to(positions),
                self._to(np.concatenate([ch.seq.kv_slots[pos] for ch, pos in zip(chunks, positions)])),
                self._to(np.stack([_padded(ch.seq.page_table, n_ctx // ps) for ch in chunks])),
                self._to(np.arange(n_ctx)[None, None, :] <= positions[:, :, None], torch.bool)[:, None],
                cows, self._to(last) if last else None,
            ))
            rows.extend(chunks[i].seq for i in last)
        # Per row: the token a sticky sequence prefers there (SamplingParams.sticky), or -1.
        prefer = [_at(s.sticky_tail(), 0) for s in rows]

        n_first = len(rows)  # rows that sample their sequence's first token (after its prompt)
        decode = graph_decode = fed = None
        first_drafts = [ch for ch in plan.prefills if ch.draft]
        if plan.decodes or first_drafts:
            # One row per decode, plus one per draft token at the positions after it. Rows whose
            # input the host knows are fed from the host: draft tokens, and the next row of a
            # sequence after a draft step (the device's last token for its slot came from a
            # draft row that may not have been kept).
            seqs, slots, positions, fed_tokens = [], [], [], []

            def feed(s, p0: int, tokens: list[int], first: int) -> None:
                tail = s.sticky_tail()
                for j, t in enumerate(tokens):
                    slots.append(self._fed_base + len(fed_tokens))
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
            b = len(seqs)
            positions = np.array(positions)
            write = np.array([s.kv_slots[p] for s, p in zip(seqs, positions)])
            if fed_tokens:
                fed = self._to(fed_tokens)
            # Draft rows can outnumber the largest decode graph: such a step runs eagerly.
            if self.graphs is not None and b <= self.graphs.sizes[-1]:
                n, packed = self.graphs.host_inputs(slots, positions, write, [s.page_table for s in seqs])
                graph_decode = (n, self._to(packed), b)
            else:
                n_ctx = _aligned(int(positions.max()) + 1, ps)
                gather = np.stack([_padded(s.page_table, n_ctx // ps) for s in seqs])
                # One host-to-device transfer for the step's integer inputs instead of four.
                packed = self._to(np.concatenate([slots, positions, write, gather.reshape(-1)]))
                pos_d = packed[b:2 * b]
                decode = (
                    packed[:b], pos_d[:, None], packed[2 * b:3 * b], packed[3 * b:].view(b, -1),
                    (torch.arange(n_ctx, device=self.device)[None, :] <= pos_d[:, None])[:, None, None, :],
                )
            rows.extend(seqs)

        params = [s.params for s in rows]
        all_greedy = all(p.temperature == 0 for p in params)
        sampling = None
        if rows:
            r = len(rows)
            floats = self._to([p.temperature for p in params] + [p.top_p for p in params]
                              + [step_uniform(p.seed, s.launched) for p, s in zip(params, rows)], torch.float32)
            sampling = (
                self._to([s.slot for s in rows]), floats[:r], floats[r:2 * r], floats[2 * r:],
                torch.arange(r, device=self.device) >= n_first,
            )
        sticky = None
        if any(t >= 0 for t in prefer):
            sticky = (self._to(prefer), self._to([p.sticky for p in params], torch.float32))

        groups = {}
        for i, s in enumerate(rows):
            if s.constraint is not None:
                groups.setdefault(id(s.constraint), (s.constraint, []))[1].append(i)
        constraint_groups = [
            (automaton, self._to(idx), self._to([rows[i].slot for i in idx]), self._to([i < n_first for i in idx], torch.bool))
            for automaton, idx in groups.values()
        ]
        busy: dict[str, float] = {}
        # One TorchScript call for the step's text forwards (CPU); decode graphs (CUDA, or
        # static graphs in tests) keep their own call.
        fused = None
        if self.scripted is not None and self.graphs is None:
            fused = self._fused_inputs(images, prefix, prefills, decode)

        def run_fused() -> list[torch.Tensor]:
            t0 = time.perf_counter()
            x = self._prefix_embeds(images, crops).flatten(0, 1) if images else self.k.new_zeros(0, cfg.text.dim)
            busy["images"] = (time.perf_counter() - t0) * 1000.0  # the vision encoder's, where the step runs it
            t0 = time.perf_counter()
            ids = [p[0].reshape(-1) for p in prefills] + ([self.last_token[decode[0]]] if decode is not None else [])
            _, step_logits = self._fused(x, torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64), fused)
            busy["text"] = (time.perf_counter() - t0) * 1000.0
            return [step_logits]

        def run_separate() -> list[torch.Tensor]:
            logits = []
            if images:
                t0 = time.perf_counter()
                self._encode_images(images, crops, prefix)
                busy["images"] = (time.perf_counter() - t0) * 1000.0
            t0 = time.perf_counter()
            for ids, pos, write, gather, mask, cows, last in prefills:
                for cow in cows:
                    self.copy_page(*cow)
                text = self.model.text
                h = self._hidden(text.embed(ids), pos, write, gather, mask)
                if last is not None:
                    logits.append(text.logits(h[last, -1]))
            busy["prefill"] = (time.perf_counter() - t0) * 1000.0
            t0 = time.perf_counter()
            if graph_decode is not None:
                n, packed, b = graph_decode
                logits.append(self.graphs.run(n, packed)[:b])
            if decode is not None:
                slots_d, pos, write, gather, mask = decode
                text = self.model.text
                if self.kernels:
                    attend = self._attend_kernels(write, gather, pos[:, 0] + 1)
                else:
                    attend = self._attend(write, gather, mask)
                h = text(text.embed(self.last_token[slots_d])[:, None], pos, attend)
                logits.append(text.logits(h[:, -1]))
            busy["decode"] = (time.perf_counter() - t0) * 1000.0
            return logits

        def run() -> StepResult:
            if fed is not None:  # the host-known inputs of draft rows (no prefill reads these slots)
                self.last_token[self._fed_base:self._fed_base + fed.shape[0]] = fed
            logits = run_fused() if fused is not None else run_separate()
            t0 = time.perf_counter()
            if rows:
                slots_r, temp, top_p, u, not_first = sampling
                all_logits = torch.cat(logits)
                if self.kernels:
                    allowed, masked = constraint_mask(all_logits, constraint_groups, self.fsm_state)
                    tokens = self.kernels[2](all_logits, allowed, not_first, cfg.tokenizer.answer_id, temp, top_p, u)
                    if sticky is not None:  # the kernel masked its own copy; stick reads these logits
                        suppress(all_logits, cfg.tokenizer.answer_id, not_first)
                        if allowed is not None:
                            all_logits.masked_fill_(allowed == 0, float("-inf"))
                else:
                    suppress(all_logits, cfg.tokenizer.answer_id, not_first)
                    masked = apply_constraints(all_logits, constraint_groups, self.fsm_state)
                    tokens = sample(all_logits, temp, top_p, u, all_greedy)
                if sticky is not None:
                    tokens = stick(tokens, all_logits, *sticky)
                advance_constraints(tokens, masked, self.fsm_state)
                self.last_token[slots_r] = tokens
                self.executor.to_host(tokens, slot.tokens[: len(rows)])
            busy["sample"] = (time.perf_counter() - t0) * 1000.0
            return StepResult(rows, slot.tokens[: len(rows)], busy)

        return self.executor.launch(run), slot

    def vision_prefix(self, crops: np.ndarray, tiling: tuple[int, int]) -> torch.Tensor:
        """One image's prefix embeddings (P, C): vision encoder and projection, no KV (the vision
        stage's work; the prefix step then runs them through the decoder)."""
        feats = self._vision_features(crops_to_tensor(crops, self.device, self.model.dtype))
        return self.model.prefix_embeddings(self.model.vision.project(feats, tiling))[0]

    def _vision_features(self, crops: torch.Tensor) -> torch.Tensor:
        if self.vision_graphs:
            return self.vision_graphs.run(crops)
        if self.scripted is not None:
            vc = self.config.vision
            return self.scripted.vision(crops, self.vision_weights, vc.enc_n_layers, vc.enc_n_heads, vc.enc_patch_size)
        return self.model.vision.encode(crops)

    def _prefix_embeds(self, images: list, crops: torch.Tensor | None) -> torch.Tensor:
        """The images' prefix embeddings (n_img, P, C): the vision stage's, or encoded here from
        `crops` (uint8, on the device: those of the images without embeddings, in order)."""
        model = self.model
        feats = self._vision_features(normalize_crops(crops, model.dtype)) if crops is not None else None
        prefixes, start = [], 0
        for c, tiling, _, _, embeds in images:
            if embeds is None:
                embeds = model.prefix_embeddings(model.vision.project(feats[start:start + len(c)], tiling))[0]
                start += len(c)
            prefixes.append(embeds)
        return torch.stack(prefixes)

    def _prefix_inputs(self, images: list) -> tuple[torch.Tensor, ...]:
        """Positions (n_img, P), KV slots (n_img * P,), pages (n_img, L / ps) and the bidirectional
        mask of the images' prefixes."""
        P = self.config.prefix_len
        write = self._to(np.concatenate([w for _, _, w, _, _ in images]))
        pages = self._to(np.stack([g for _, _, _, g, _ in images]))
        L = pages.shape[1] * self.page_size
        mask = (torch.arange(L, device=self.device) < P).expand(P, L)[None, None]
        return torch.arange(P, device=self.device).expand(len(images), P), write, pages, mask

    def _encode_images(self, images: list, crops: torch.Tensor | None, prefix: tuple) -> None:
        """The images' prefixes through the decoder, into their pages (the eager path); prefix:
        `_prefix_inputs(images)`."""
        self._hidden(self._prefix_embeds(images, crops), *prefix)


def _at(tail: tuple[int, ...], j: int) -> int:
    return tail[j] if j < len(tail) else -1


def _aligned(n: int, page_size: int) -> int:
    """Key length to attend over: whole pages, and a multiple of KV_ALIGN (batch invariance)."""
    step = np.lcm(page_size, KV_ALIGN)
    return int(-(-n // step) * step)


def _padded(page_table: list[int], n: int) -> np.ndarray:
    """The first n pages of a page table; past the sequence's own pages, page 0 (always masked)."""
    pages = np.asarray(page_table, dtype=np.int64)
    return pages[:n] if len(pages) >= n else np.pad(pages, (0, n - len(pages)))
