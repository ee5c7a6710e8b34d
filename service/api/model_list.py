"""GET /v1/models: the served model, and the LoRA adapters served beside it."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from service.api.common import state_of
from service.api.errors import ERROR_RESPONSES
from service.api.schemas import ModelCard, ModelList

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.get("/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state = state_of(request)
    info = state.model.info if state.model else None
    created = info.created if info else int(time.time())
    card = ModelCard(
        id=state.served_name,
        created=created,
        root=info.source if info else None,
        max_model_len=info.max_model_len if info else None,
    )
    adapters = state.model.adapters if state.model else None
    cards = [
        ModelCard(id=name, created=created, root=name, parent=card.id, max_model_len=card.max_model_len)
        for name in (adapters.names() if adapters is not None else ())
    ]
    return ModelList(data=[card, *cards])
