"""vLLM's runtime LoRA API: POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"?}
and POST /v1/unload_lora_adapter {"lora_name"}, on with NIM_ALLOW_RUNTIME_LORA_UPDATING=1 (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING is read too) and behind the API key like the rest of /v1.

Adapters are read from inside NIM_PEFT_SOURCE only: `lora_path` must resolve there (a relative
path is taken from it; a symlink leading out is refused), and a loaded adapter gets every check a
scanned one gets (service.engine.lora: finite weights, shapes, rank and its patterns). Unloading is
immediate for new requests (a 404, and gone from /v1/models) while those already accepted finish
with the adapter (service.engine.lora_store). With the engine in a process of its own the change is
made there, where the adapter store lives (service.engine.process).

Answers as vLLM's (vllm/entrypoints/openai/serving_models.py): 200 with a plain-text line, "Success:
LoRA adapter 'sql' added successfully." / "... removed successfully."; 400 when a name or path is
missing, or the name is loaded already ("... set 'load_inplace' to True"); 404 for a path holding no
adapter and for unloading a name not served. Errors are in this API's error shape. Beyond vLLM: a
path outside the adapter source, an invalid name, or an adapter that fails its checks is a 400
saying why (vLLM answers a failed load 500); with the switch off, both paths are a 404 saying so.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from service.api.errors import APIError, ErrorResponse, invalid_request
from service.api.state import ServiceState
from service.engine.protocol import (
    AdapterCatalog,
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    EngineDeadError,
)

log = logging.getLogger(__name__)

router = APIRouter(
    responses={code: {"model": ErrorResponse} for code in (400, 401, 404, 503)},
)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str  # inside NIM_PEFT_SOURCE (relative: from it)
    load_inplace: bool = False  # replace an adapter loaded under that name (its requests finish)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; a name is what identifies an adapter (vLLM too unloads by name)


def _catalog(request: Request, path: str) -> AdapterCatalog:
    """The served model's adapters: 404 while runtime updating is off, 503 until the model serves."""
    state: ServiceState = request.app.state.service
    if not state.limits.runtime_lora_updating:
        raise APIError(
            404,
            f"{path} is off: set NIM_ALLOW_RUNTIME_LORA_UPDATING=1 (adapters load from NIM_PEFT_SOURCE)",
            "invalid_request_error",
            None,
            "not_found",
        )
    ready = state.require_ready()
    if ready.adapters is None:
        raise invalid_request("this server serves no LoRA adapters (NIM_PEFT_SOURCE)")
    return ready.adapters


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    catalog = _catalog(request, "POST /v1/load_lora_adapter")
    name = body.lora_name
    if not name or not body.lora_path:
        raise invalid_request("Both 'lora_name' and 'lora_path' must be provided.")
    async with request.app.state.service.adapter_changes:
        try:
            await asyncio.to_thread(catalog.add, name, Path(body.lora_path), body.load_inplace)
        except AdapterExistsError:
            raise invalid_request(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                "place, set 'load_inplace' to True.",
                "lora_name",
            ) from None
        except AdapterNotFoundError as exc:
            raise APIError(404, str(exc), "invalid_request_error", "lora_path", "not_found") from None
        except AdapterError as exc:
            raise invalid_request(str(exc), "lora_path") from None
        except EngineDeadError as exc:
            raise request.app.state.service.dead_engine_error(exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    catalog = _catalog(request, "POST /v1/unload_lora_adapter")
    name = body.lora_name
    if not name:
        raise invalid_request("'lora_name' needs to be provided to unload a LoRA adapter.")
    async with request.app.state.service.adapter_changes:
        try:
            await asyncio.to_thread(catalog.remove, name)
        except KeyError:
            raise APIError(
                404, f"The lora adapter '{name}' cannot be found.", "invalid_request_error", "lora_name",
                "not_found",
            ) from None  # fmt: skip
        except AdapterError as exc:  # an engine that cannot unload by name says why
            raise invalid_request(str(exc), "lora_name") from None
        except EngineDeadError as exc:
            raise request.app.state.service.dead_engine_error(exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
