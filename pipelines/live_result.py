"""A live frame's answers: `LiveResult`, what a session hands its `on_result`.

One `RequestOutput` per prompt of the session, in its order, with the frame they describe and its
end-to-end latency; `text` is how it is shown, `records()` the lines of a live log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.types import RequestOutput

from .frame import Frame
from .prompts import answers_text
from .sinks import FrameResult


@dataclass
class LiveResult:
    """A frame's answers: one per prompt of the session, in its order (most sessions have one)."""

    frame: Frame
    outputs: list[RequestOutput]
    end_to_end_ms: float  # from the frame's capture to its last answer
    prompts: list[dict] = field(default_factory=list)  # {"caption": kind} or {"question": text} each

    @property
    def output(self) -> RequestOutput:
        return self.outputs[0]

    @property
    def text(self) -> str:
        """The answer, or one line per prompt ("question: answer"), as it is shown (a page, a
        terminal line, a recording's band): an answer max_tokens cut short ends in "…" ('al' for
        [alpha, beta] at 2 tokens read as an answer). The log's lines (`records`) keep it as it
        came, with its finish_reason."""
        return answers_text(self.prompts, [o.text.rstrip() + "…" if o.finish_reason == "length" else o.text
                                           for o in self.outputs])

    @property
    def timings_ms(self) -> dict[str, float]:
        """Per stage, the slowest answer's: the frame waits for all of them."""
        merged: dict[str, float] = {}
        for out in self.outputs:
            for k, v in out.timings_ms.items():
                merged[k] = max(v, merged.get(k, v))
        return merged

    def records(self) -> list[dict]:
        """Lines of a live log (`live -o`, the web UI's export), one per prompt: the fields of
        `video`'s JSONL, the UTC time of the result (taken now: call it when the result arrives),
        and the frame's end-to-end latency among the timings."""
        from datetime import datetime, timezone

        now = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        f = self.frame
        return [{**FrameResult(f.source_id, f.index, round(f.pts, 6), out.text, out.token_ids, out.finish_reason,
                               {**out.timings_ms, "end_to_end": round(self.end_to_end_ms, 3)}, dict(prompt)).to_dict(),
                 "time": now}
                for prompt, out in zip(self.prompts or [{}] * len(self.outputs), self.outputs)]
