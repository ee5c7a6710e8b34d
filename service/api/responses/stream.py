"""A streamed response: the events the openai SDK's accumulator (ResponseStreamState) accepts.

`response.created` and `response.in_progress` (the response with no output), then each output item
in turn -- the thinking (a reasoning parser's) as a `reasoning` item, the answer as a `message`
item, each tool call as a `function_call` item -- opened with `output_item.added` (and
`content_part.added`), filled with deltas, closed with the `.done` events and `output_item.done`;
then exactly one of `response.completed`, `response.incomplete` (max_output_tokens cut the answer)
or `response.failed` (the engine failed, or the time limit passed: the item left open is reported
`incomplete` and never `done`). Every event carries `sequence_number`, counted from 0; the usage
is the terminal event's. Each event is `event: <type>` and `data: <json>`; there is no `[DONE]`.
Whitespace that comes before a tool call is held back, so it makes no empty message item.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from service.api.chat.run import ChatRun, Delta
from service.api.errors import APIError
from service.api.responses.items import call_item, dumped, item_id, message_item, output_text, reasoning_item
from service.api.responses.protocol import IncompleteDetails, ResponseError, ResponseObject, ResponseUsage


class ResponseStream:
    def __init__(self, run: ChatRun, skeleton: ResponseObject, usage_of: Callable[[ChatRun], ResponseUsage],
                 finished: Callable[[ResponseObject], None]) -> None:  # fmt: skip
        self.run, self.skeleton, self.usage_of, self.on_finished = run, skeleton, usage_of, finished
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # items done
        self.open: dict[str, Any] | None = None  # the item being written: reasoning or message
        self.text = ""  # the open item's text so far
        self.spaces = ""  # whitespace held back before any message opened

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {dumped(payload)}\n\n"

    def snapshot(self, **changes: Any) -> dict[str, Any]:
        return self.skeleton.model_copy(update=changes).model_dump(mode="json")

    async def events(self) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.snapshot())
        yield self.event("response.in_progress", response=self.snapshot())
        finish = None
        async for piece in self.run.pieces():
            for out in self._text(piece.reasoning, piece.content or ""):
                yield out
            if isinstance(piece, Delta):
                continue
            finish = piece.finish_reason
            if not piece.calls and self.spaces:
                for out in self._text("", self.spaces, hold=False):
                    yield out
            for out in self._close(cut=finish == "length"):
                yield out
            for call in piece.calls:
                for out in self._call(call_item(call)):
                    yield out
            if not piece.calls and not any(i["type"] == "message" for i in self.output):  # as whole
                for out in self._text("", "", hold=False):
                    yield out
                for out in self._close(cut=finish == "length"):
                    yield out
        usage = self.usage_of(self.run)
        if finish == "length":
            response = self.skeleton.model_copy(
                update={
                    "status": "incomplete",
                    "output": self.output,
                    "usage": usage,
                    "incomplete_details": IncompleteDetails(reason="max_output_tokens"),
                }
            )
            kind = "response.incomplete"
        else:
            response = self.skeleton.model_copy(
                update={
                    "status": "completed",
                    "output": self.output,
                    "usage": usage,
                    "completed_at": int(time.time()),
                }
            )
            kind = "response.completed"
        self.on_finished(response)
        yield self.event(kind, response=response.model_dump(mode="json"))

    def failed(self, err: APIError) -> str:
        """The stream's end when it fails after its first event (sse's render_error)."""
        output = list(self.output)
        if self.open is not None:
            output.append(self._item(self.open, "incomplete"))
        error = ResponseError(code="server_error", message=err.message)
        return self.event(
            "response.failed", response=self.snapshot(status="failed", output=output, error=error)
        )

    def _text(self, reasoning: str, content: str, hold: bool = True) -> list[str]:
        out: list[str] = []
        if reasoning:
            out += self._write("reasoning", reasoning)
        if hold and (self.open is None or self.open["type"] != "message") and content.isspace():
            self.spaces += content  # may come before a tool call
            return out
        if content or not hold:
            out += self._write("message", self.spaces + content)
            self.spaces = ""
        return out

    def _write(self, kind: str, text: str) -> list[str]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close(cut=False)
            out += self._open(kind)
        if text:
            self.text += text
            index = len(self.output)
            delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
            out.append(self.event(delta, item_id=self.open["id"], output_index=index, content_index=0,  # type: ignore[index]
                                  delta=text, **extra))  # fmt: skip
        return out

    def _open(self, kind: str) -> list[str]:
        index = len(self.output)
        if kind == "message":
            self.open = message_item(item_id("msg"), "", "in_progress")
            self.open["content"] = []
            part: dict[str, Any] = output_text("")
        else:
            self.open = {"id": item_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.text = ""
        return [
            self.event("response.output_item.added", output_index=index, item=self.open),
            self.event(
                "response.content_part.added",
                item_id=self.open["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def _close(self, cut: bool) -> list[str]:
        if self.open is None:
            return []
        index, open_ = len(self.output), self.open
        item = self._item(open_, "incomplete" if cut and open_["type"] == "message" else "completed")
        ids = {"item_id": open_["id"], "output_index": index, "content_index": 0}
        if open_["type"] == "message":
            done = [self.event("response.output_text.done", **ids, text=self.text, logprobs=[]),
                    self.event("response.content_part.done", **ids, part=output_text(self.text))]  # fmt: skip
        else:
            part = {"type": "reasoning_text", "text": self.text}
            done = [self.event("response.reasoning_text.done", **ids, text=self.text),
                    self.event("response.content_part.done", **ids, part=part)]  # fmt: skip
        self.open = None
        self.output.append(item)
        return [*done, self.event("response.output_item.done", output_index=index, item=item)]

    def _item(self, open_: dict[str, Any], status: str) -> dict[str, Any]:
        if open_["type"] == "message":
            return message_item(open_["id"], self.text, status)
        return reasoning_item(open_["id"], self.text, status)

    def _call(self, item: dict[str, Any]) -> list[str]:
        index = len(self.output)
        added = {**item, "arguments": "", "status": "in_progress"}
        ids = {"item_id": item["id"], "output_index": index}
        self.output.append(item)
        return [
            self.event("response.output_item.added", output_index=index, item=added),
            self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"]),
            self.event(
                "response.function_call_arguments.done", **ids, name=item["name"], arguments=item["arguments"]
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
