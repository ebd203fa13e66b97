"""GET /v1/models and /v1/models/{id}: the served model."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.deps import State, TenantDep
from gateway.errors import APIError
from gateway.schemas import ErrorBody, ModelCard, ModelList

router = APIRouter()


def _card(model_id: str, state) -> dict:
    """The OpenAI model object, with the engine's placement plan under the `moegate` extension."""
    return {"id": model_id, "object": "model", "created": state.created, "owned_by": "moegate",
            "moegate": {"placement": state.llm.engine.placement}}


@router.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorBody}})
async def list_models(state: State, tenant: TenantDep) -> dict:
    return {"object": "list", "data": [_card(state.settings.model_name, state)]}


@router.get("/v1/models/{model_id}", response_model=ModelCard,
            responses={401: {"model": ErrorBody}, 404: {"model": ErrorBody}})
async def get_model(model_id: str, state: State, tenant: TenantDep) -> dict:
    if model_id != state.settings.model_name:
        raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
    return _card(model_id, state)
