"""What a request running in the engine sends its client: deltas, and exactly one finished output.

Every finished output is built by RequestOutput.last (one of stop, length or abort, or an
error); a request that never reached the scheduler is refused the same way (`refuse`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from service.engine.output import OutputProcessor
from service.engine.protocol import (
    ErrorCause,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    TokenLogprob,
)
from service.engine.torch.request import Request

Sink = Callable[[RequestOutput], None]


@dataclass
class LiveRequest:
    """Engine-thread state of one request beside its scheduler state: where its outputs go, its
    detokenizer and stop conditions, its prompt logprobs until they are sent (first output), and
    when the engine first scheduled it (every output carries it; None until then)."""

    request: Request
    sink: Sink
    output: OutputProcessor
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    first_scheduled_time: float | None = None

    def scheduled(self, now: float) -> None:
        """A step computes this request; the first such step ends its time in the queue."""
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now

    def send(
        self,
        text: str,
        token_ids: list[int],
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprob] | None,
        now: float,
    ) -> None:
        """The step's delta: its new token, the last output when `finish_reason` ends the request."""
        request = self.request
        prompt_logprobs = self._take_prompt_logprobs()
        if finish_reason is not None:
            self._sink_last(
                RequestOutput.last(
                    request.request_id,
                    request.num_prompt_tokens,
                    finish_reason=finish_reason,
                    text=text,
                    token_ids=token_ids,
                    num_generated_tokens=request.num_generated,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                    num_cached_tokens=request.num_cached_tokens,
                    time=now,
                )
            )
            return
        self.sink(
            RequestOutput(
                request_id=request.request_id,
                text=text,
                token_ids=token_ids,
                num_prompt_tokens=request.num_prompt_tokens,
                num_generated_tokens=request.num_generated,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                num_cached_tokens=request.num_cached_tokens,
                time=now,
                first_scheduled_time=self.first_scheduled_time,
            )
        )

    def end(self, error: str | None = None, cause: ErrorCause = "engine", now: float | None = None) -> None:
        """The last output without a new token: failed with `error`, else aborted."""
        request = self.request
        self._sink_last(
            RequestOutput.last(
                request.request_id,
                request.num_prompt_tokens,
                finish_reason="abort" if error is None else None,
                error=error,
                error_cause=cause,
                num_generated_tokens=request.num_generated,
                prompt_logprobs=self._take_prompt_logprobs() if error is None else None,
                num_cached_tokens=request.num_cached_tokens,
                time=time.monotonic() if now is None else now,
            )
        )

    def _sink_last(self, out: RequestOutput) -> None:
        self.sink(replace(out, first_scheduled_time=self.first_scheduled_time))

    def _take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        if self.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs


def refuse(request: GenerationRequest, sink: Sink, message: str) -> None:
    """The one output of a request that never reached the scheduler: failed with `message`."""
    sink(
        RequestOutput.last(
            request.request_id, len(request.prompt_token_ids), error=message, time=time.monotonic()
        )
    )
