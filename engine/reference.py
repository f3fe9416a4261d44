"""The single-sequence reference decoder: the oracle the engine is tested against.

Batch 1, one contiguous KV buffer, no pipelining, a host sync after every step. It follows the
Moondream generation rules to the letter: image prefix (BOS + image tokens, bidirectional) at
positions 0..prefix_len-1, the prompt after it, the first answer token from the prompt's last
position, then one token per step with the answer marker suppressed, until EOS or max_tokens.
Sampling draws its uniform for token k from (seed, k), as the engine does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from .device import synchronize
from .detokenizer import WordStreamer
from .errors import RequestError
from .models.loader import LoadedModel
from .models.prompt import prompt_ids
from .models.text import KV_ALIGN, attention, attention_mask
from .sampler import advance_constraints, apply_constraints, sample, step_uniform, stick, suppress
from .types import RequestOutput, SamplingParams, StageTimings


@dataclass
class EncodedImage:
    """The image prefix's KV, (n_layers, 1, n_kv_heads, prefix_len, head_dim) each, and its timings."""

    k: torch.Tensor
    v: torch.Tensor
    timings: StageTimings = field(default_factory=StageTimings)


class ContiguousKV:
    """One sequence's keys and values in a buffer of max_context positions.

    Every attention reads the whole buffer under a (T, max_context) boolean mask, as the
    published Moondream code does.
    """

    def __init__(self, prefix: EncodedImage, capacity: int, prefix_len: int, exact: bool):
        n_layers, _, h, p, d = prefix.k.shape
        capacity = -(-capacity // KV_ALIGN) * KV_ALIGN  # masked tail: keeps decode batch invariant
        self.k = prefix.k.new_zeros((n_layers, 1, h, capacity, d))
        self.v = torch.zeros_like(self.k)
        self.k[:, :, :, :p] = prefix.k
        self.v[:, :, :, :p] = prefix.v
        self.capacity = capacity
        self.prefix_len = prefix_len
        self.exact = exact

    def attender(self, pos0: int, n_new: int):
        end = pos0 + n_new
        mask = attention_mask(torch.arange(pos0, end, device=self.k.device), self.capacity, self.prefix_len)

        def attend(layer: int, q, k, v):
            self.k[layer, :, :, pos0:end] = k
            self.v[layer, :, :, pos0:end] = v
            return attention(q, self.k[layer], self.v[layer], mask[None, None], self.exact)

        return attend


def exact_attention(loaded: LoadedModel) -> bool:
    """fp64 attention where it makes results batch invariant (fp32 on CPU); SDPA elsewhere."""
    return loaded.device.type == "cpu" and loaded.dtype == torch.float32


class ReferenceDecoder:
    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.model.device
        self.exact = exact_attention(loaded)

    def _ms_since(self, t0: float) -> float:
        synchronize(self.device)
        return (time.perf_counter() - t0) * 1000.0

    @torch.inference_mode()
    def encode_image(self, rgb_HW3: np.ndarray) -> EncodedImage:
        timings = StageTimings()
        t0 = time.perf_counter()
        crops, tiling = self.model.preprocess(rgb_HW3)
        timings.preprocess = self._ms_since(t0)

        t0 = time.perf_counter()
        tokens = self.model.image_tokens(crops, tiling)
        timings.vision = self._ms_since(t0)

        t0 = time.perf_counter()
        x = self.model.prefix_embeddings(tokens)
        p = x.shape[1]
        cfg = self.config.text
        empty = EncodedImage(
            k=x.new_zeros((cfg.n_layers, 1, cfg.n_kv_heads, 0, cfg.head_dim)),
            v=x.new_zeros((cfg.n_layers, 1, cfg.n_kv_heads, 0, cfg.head_dim)),
        )
        kv = ContiguousKV(empty, cfg.max_context, p, self.exact)
        pos = torch.arange(p, device=self.device)[None]
        self.model.text(x, pos, kv.attender(0, p))
        timings.prefill = self._ms_since(t0)
        return EncodedImage(k=kv.k[:, :, :, :p].clone(), v=kv.v[:, :, :, :p].clone(), timings=timings)

    @torch.inference_mode()
    def generate(
        self,
        image: np.ndarray | EncodedImage,
        caption: str | None = None,
        question: str | None = None,
        params: SamplingParams = SamplingParams(),
        on_text: Callable[[str], None] | None = None,
        constraint: Any = None,
        draft: list[int] | None = None,
    ) -> RequestOutput:
        """Generate an answer; `constraint` is a Regex, Choice or JsonSchema (engine.constraints).
        `draft` matters only with `params.sticky`, as in the engine."""
        t_start = time.perf_counter()
        ids = prompt_ids(self.config, self.loaded.tokenizer, caption=caption, question=question)
        params = params.with_seed()
        automaton = None
        if constraint is not None:
            from .constraints import compile_constraint

            automaton = compile_constraint(constraint, self.loaded.tokenizer, self.config.text.vocab_size,
                                           self.config.tokenizer.eos_id, self.device)
        fsm_state = torch.zeros(1, dtype=torch.int64, device=self.device)
        if isinstance(image, EncodedImage):
            encoded, timings = image, StageTimings()  # the image's cost was paid by encode_image
        else:
            encoded = self.encode_image(image)
            timings = StageTimings(**encoded.timings.__dict__)

        text_model, cfg, tok = self.model.text, self.config, self.config.tokenizer
        pos = cfg.prefix_len
        if pos + len(ids) > cfg.text.max_context:  # a prompt up to the last position has room for one token
            raise RequestError(
                f"the prompt ({len(ids)} tokens) does not fit in the context ({cfg.text.max_context} "
                f"tokens, {pos} taken by the image)"
            )
        capacity = cfg.text.max_context
        kv = ContiguousKV(encoded, capacity, cfg.prefix_len, self.exact)
        temperature = torch.tensor([params.temperature], device=self.device)
        top_p = torch.tensor([params.top_p], device=self.device)
        suppress_row = torch.tensor([True], device=self.device)
        # While the answer repeats it, the draft's next token is preferred (SamplingParams.sticky).
        sticky = tuple(draft) + (tok.eos_id,) if draft and params.sticky else ()
        margin = torch.tensor([float(params.sticky)], device=self.device)

        def draw(logits: torch.Tensor, index: int) -> int:
            u = torch.tensor([step_uniform(params.seed, index)], device=self.device)
            groups = []
            if automaton is not None:
                zero = torch.zeros(1, dtype=torch.int64, device=self.device)
                groups = [(automaton, zero, zero, torch.tensor([index == 0], device=self.device))]
            masked = apply_constraints(logits, groups, fsm_state)
            token = sample(logits, temperature, top_p, u)
            if index < len(sticky) and tuple(token_ids) == sticky[:index]:
                token = stick(token, logits, torch.tensor([sticky[index]], device=self.device), margin)
            advance_constraints(token, masked, fsm_state)
            return int(token[0])

        token_ids: list[int] = []
        t0 = time.perf_counter()
        # Preparing the request (the prompt's ids, a constraint's automaton, the cache) is part of
        # its preprocess: stages that leave it out did not add up to the total (4-7 ms short with
        # a constraint).
        timings.preprocess += max(0.0, (t0 - t_start) * 1000.0 - timings.preprocess - timings.vision - timings.prefill)
        ids_t = torch.tensor([ids], device=self.device)
        positions = torch.arange(pos, pos + len(ids), device=self.device)[None]
        h = text_model(text_model.embed(ids_t), positions, kv.attender(pos, len(ids)))
        next_id = draw(text_model.logits(h[:, -1]), 0)
        pos += len(ids)
        synchronize(self.device)
        t1 = time.perf_counter()  # the decode stage starts where the prefill's ended: one clock
        timings.prefill += (t1 - t0) * 1000.0
        t0 = t1
        streamer = WordStreamer(self.loaded.tokenizer.decode)
        pieces: list[str] = []
        finish = "length"
        while True:
            if next_id == tok.eos_id and not params.ignore_eos:
                finish = "stop"
                break
            token_ids.append(next_id)
            piece = streamer.push(next_id)
            if piece:
                pieces.append(piece)
                if on_text:
                    on_text(piece)
            if len(token_ids) >= params.max_tokens or pos >= capacity:
                break
            x = text_model.embed(torch.tensor([[next_id]], device=self.device))
            h = text_model(x, torch.tensor([[pos]], device=self.device), kv.attender(pos, 1))
            pos += 1
            logits = suppress(text_model.logits(h[:, -1]), tok.answer_id, suppress_row)
            next_id = draw(logits, len(token_ids))
        piece = streamer.flush()
        if piece:
            pieces.append(piece)
            if on_text:
                on_text(piece)
        synchronize(self.device)
        t1 = time.perf_counter()  # read once: the stages add up to the total (it was ~0.01 ms more)
        timings.decode = (t1 - t0) * 1000.0
        timings.total = (t1 - t_start) * 1000.0
        return RequestOutput("".join(pieces), token_ids, finish, timings, params.seed)
