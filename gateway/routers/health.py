"""GET /health (liveness + engine state) and GET /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from gateway.deps import State
from gateway.metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health")
async def health(state: State) -> JSONResponse:
    dead = getattr(state.llm, "_dead", None)
    body = {"status": "ok" if dead is None else "engine_dead", "model": state.settings.model_name,
            "in_flight": state.in_flight, "engine_active": state.llm.num_active,
            "policy_id": state.policy.id, "policy_digest": state.policy.digest,
            "system_fingerprint": state.fingerprint}
    reload_error = getattr(state.policies, "last_error", None)
    if reload_error is not None:  # the last reload was rejected: the policy above is the previous one
        body["policy_reload_error"] = str(reload_error)
    breaker = getattr(state.store, "breaker", None)
    if breaker is not None:
        body["store_circuit"] = breaker.state
    return JSONResponse(body, status_code=200 if dead is None else 503)


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(state.llm), media_type=CONTENT_TYPE)
