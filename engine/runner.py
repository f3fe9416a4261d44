"""Device work of one engine step: launch its forward + sampling on the inputs the host built.

`engine/step_inputs.py` turns the step's plan into device inputs on the engine thread; a step
then runs, in this order on the device: vision encoding of the step's images (all crops in one
batch; on CPU the vision thread has done it already, engine/vision_stage.py) and their
bidirectional prefix prefill; prompt prefill chunks; one batched decode forward; then sampling
of every row that produces a token (first tokens of finished prefills, decode rows). On CPU with
TorchScript the prefixes, chunks and decode rows are one call (`scripted.step_forward`), with
the same results. Sampled tokens are scattered into `last_token[slot]` on the device, where the
next step's decode reads them without a host round trip, and copied into the host buffer of the
step's ping-pong slot. A slot is reused only after its step was committed.

KV lives in pages: `k`/`v` are (n_layers, n_pages * page_size, n_kv_heads, head_dim); position p
of a sequence is at flat index page_table[p // page_size] * page_size + p % page_size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .executor import Executor, Pending
from .models.loader import LoadedModel
from .models.text import attention
from .models.tiling import crops_to_tensor, normalize_crops, stage_crops
from .reference import exact_attention
from .sampler import advance_constraints, apply_constraints, constraint_mask, sample, stick, suppress
from .scheduler import StepPlan
from .sequence import Sequence
from .step_inputs import StepInputs, step_inputs


NO_ROWS = torch.zeros(0, dtype=torch.int64)
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
                mlp = loaded.model.vision.proj_mlp
                self.proj_weights = [mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
                with torch.no_grad():
                    self._bos = loaded.model.text.embed(torch.tensor([loaded.config.tokenizer.bos_id]))
                warm_up(self.scripted, self._text_args, self.vision_weights, loaded.model.vision.cfg, t,
                        page_size, loaded.dtype, exact_attention(loaded), (self.proj_weights, self._bos))
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
        self.draft_rows = draft_rows  # draft tokens per step at most (engine/scheduler.py)
        # Past the slots (and the graphs' padding slot): the inputs of rows the host feeds itself
        # (draft rows, and the next row of a sequence after a draft step), written each step.
        self.fed_base = max_batch + 1
        self.last_token = torch.zeros(self.fed_base + max_batch + self.draft_rows, dtype=torch.int64,
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
        if self.scripted is not None:
            from .scripted import held_in_cpp

            self._held = held_in_cpp([self.k, self.v, self.last_token, *rope, *text_weights,
                                      *self.vision_weights, *self.proj_weights, self._bos])
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

    def _fused(self, x_prefix: list[torch.Tensor], ids: torch.Tensor, inputs: tuple,
               decode_slots: torch.Tensor = NO_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
        """scripted.step_forward over this runner's cache and weights; inputs: `step_inputs.fused_inputs`.
        The rows after the prefix take ids, then the last tokens of `decode_slots`."""
        return self.scripted.step(x_prefix, ids, decode_slots, self.last_token, *inputs, self.k, self.v,
                                  *self._text_args, self.exact)

    def launch(self, plan: StepPlan, step_id: int) -> tuple[Pending, _Slot]:
        """Build the step's inputs on the host and launch it; returns its pending handle and slot."""
        slot = self.slots[step_id % 2]
        if slot.busy:
            raise AssertionError("ping-pong slot reused before its step was committed")
        slot.busy = True
        step = step_inputs(self, plan)
        # Steps of the same rows take about as long (the engine's wait uses it, executor.py).
        key = (len(plan.images), sum(img.n_crops for img in plan.images if img.embeds is None),
               sum(ch.length + len(ch.draft) for ch in plan.prefills), len(plan.decodes) + sum(map(len, plan.drafts)))
        return self.executor.launch(lambda: self._run(step, slot), key=key), slot

    def _run(self, step: StepInputs, slot: _Slot) -> StepResult:
        """The step on the device: forwards, then sampling into the slot's host buffer."""
        busy: dict[str, float] = {}
        if step.fed is not None:  # the host-known inputs of draft rows (no prefill reads these slots)
            self.last_token[self.fed_base:self.fed_base + step.fed.shape[0]] = step.fed
        logits = self._forward_fused(step, busy) if step.fused is not None else self._forward(step, busy)
        t0 = time.perf_counter()
        n = len(step.rows)
        if n:
            tokens = self._sample(step, torch.cat(logits))
            self.last_token[step.sampling[0]] = tokens
            self.executor.to_host(tokens, slot.tokens[:n])
        busy["sample"] = (time.perf_counter() - t0) * 1000.0
        return StepResult(step.rows, slot.tokens[:n], busy)

    def _forward_fused(self, step: StepInputs, busy: dict[str, float]) -> list[torch.Tensor]:
        """The step's text forwards in one TorchScript call: the logits of its sampling rows."""
        t0 = time.perf_counter()
        # The vision stage's embeddings go into the call as they are: stacking them here would
        # be an operator on this thread, a GIL take (scripted.step_forward says why that counts).
        x = self._prefix_rows(step.images, step.crops) if step.images else []
        busy["images"] = (time.perf_counter() - t0) * 1000.0  # the vision encoder's, where the step runs it
        t0 = time.perf_counter()
        ids, decode_slots, inputs = step.fused
        _, logits = self._fused(x, ids, inputs, decode_slots)
        busy["text"] = (time.perf_counter() - t0) * 1000.0
        return [logits]

    def _forward(self, step: StepInputs, busy: dict[str, float]) -> list[torch.Tensor]:
        """The step's forwards one after another: images, prompt chunks, decode (eager or a graph)."""
        text, logits = self.model.text, []
        if step.images:
            t0 = time.perf_counter()
            self._hidden(torch.stack(self._prefix_rows(step.images, step.crops)), *step.prefix)
            busy["images"] = (time.perf_counter() - t0) * 1000.0
        t0 = time.perf_counter()
        for ids, pos, write, gather, mask, cows, last in step.prefills:
            for cow in cows:
                self.copy_page(*cow)
            h = self._hidden(text.embed(ids), pos, write, gather, mask)
            if last is not None:
                logits.append(text.logits(h[last, -1]))
        busy["prefill"] = (time.perf_counter() - t0) * 1000.0
        t0 = time.perf_counter()
        if step.graph_decode is not None:
            n, packed, b = step.graph_decode
            logits.append(self.graphs.run(n, packed)[:b])
        if step.decode is not None:
            slots_d, pos, write, gather, mask = step.decode
            if self.kernels:
                attend = self._attend_kernels(write, gather, pos[:, 0] + 1)
            else:
                attend = self._attend(write, gather, mask)
            h = text(text.embed(self.last_token[slots_d])[:, None], pos, attend)
            logits.append(text.logits(h[:, -1]))
        busy["decode"] = (time.perf_counter() - t0) * 1000.0
        return logits

    def _sample(self, step: StepInputs, logits: torch.Tensor) -> torch.Tensor:
        """One token per row: answer-marker suppression, constraints, temperature and top-p (or
        argmax), stickiness; the constraints' automata advance on the device."""
        _, temp, top_p, u, not_first = step.sampling
        answer_id = self.config.tokenizer.answer_id
        if self.kernels:
            allowed, masked = constraint_mask(logits, step.constraint_groups, self.fsm_state)
            tokens = self.kernels[2](logits, allowed, not_first, answer_id, temp, top_p, u)
            if step.sticky is not None:  # the kernel masked its own copy; stick reads these logits
                suppress(logits, answer_id, not_first)
                if allowed is not None:
                    logits.masked_fill_(allowed == 0, float("-inf"))
        else:
            suppress(logits, answer_id, not_first)
            masked = apply_constraints(logits, step.constraint_groups, self.fsm_state)
            tokens = sample(logits, temp, top_p, u, step.all_greedy)
        if step.sticky is not None:
            tokens = stick(tokens, logits, *step.sticky)
        advance_constraints(tokens, masked, self.fsm_state)
        return tokens

    def vision_prefix(self, crops: np.ndarray, tiling: tuple[int, int]) -> torch.Tensor:
        """One image's prefix embeddings (P, C): vision encoder and projection, no KV (the vision
        stage's work; the prefix step then runs them through the decoder)."""
        if self.scripted is not None and self.vision_graphs is None:
            vc = self.config.vision
            return self.scripted.prefix(stage_crops(crops, self.device), self.vision_weights, self.proj_weights,
                                        self._bos, vc.enc_n_layers, vc.enc_n_heads, vc.enc_patch_size,
                                        (int(tiling[0]), int(tiling[1])), vc.overlap_margin, self.model.dtype)
        feats = self._vision_features(crops_to_tensor(crops, self.device, self.model.dtype))
        return self.model.prefix_embeddings(self.model.vision.project(feats, tiling))[0]

    def _vision_features(self, crops: torch.Tensor) -> torch.Tensor:
        if self.vision_graphs:
            return self.vision_graphs.run(crops)
        if self.scripted is not None:
            vc = self.config.vision
            return self.scripted.vision(crops, self.vision_weights, vc.enc_n_layers, vc.enc_n_heads, vc.enc_patch_size)
        return self.model.vision.encode(crops)

    def _prefix_rows(self, images: list, crops: torch.Tensor | None) -> list[torch.Tensor]:
        """Each image's prefix embeddings (P, C): the vision stage's, or encoded here from `crops`
        (uint8, on the device: those of the images without embeddings, in order)."""
        model = self.model
        feats = self._vision_features(normalize_crops(crops, model.dtype)) if crops is not None else None
        prefixes, start = [], 0
        for c, tiling, _, _, embeds in images:
            if embeds is None:
                embeds = model.prefix_embeddings(model.vision.project(feats[start:start + len(c)], tiling))[0]
                start += len(c)
            prefixes.append(embeds)
        return prefixes
