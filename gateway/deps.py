"""FastAPI dependencies: the app state, API-key authentication -> tenant, and the served model check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Header, Request

from engine.mode import Mode
from gateway.errors import APIError
from gateway.request_audit import request_audit
from policies.model import Policy, Tenant


@dataclass
class AppState:
    """Everything the lifespan owns; routers reach it through `State`."""

    settings: Any  # gateway.settings.Settings
    llm: Any  # engine.async_engine.AsyncLLM
    generator: Any  # gateway.generation.Generator
    policies: Any  # PolicyHolder, or a fixed embedded policy (`.current`)
    open_access: bool  # embedded dev policy: any API key maps to its tenant
    store: Any
    telemetry: Any
    audit: Any
    metrics: Any
    fingerprints: dict[Mode, str]  # the engine's numerics fingerprint per mode (`system_fingerprint`)
    created: int = 0
    in_flight: int = 0

    @property
    def fingerprint(self) -> str:
        return self.fingerprints[Mode.EXECUTION]

    @property
    def policy(self) -> Policy:
        return self.policies.current


# Dependencies are `async def`: FastAPI runs a plain `def` one in its thread pool, two thread hand-offs per request
# for a dictionary lookup (and, under load, a wait for a core each time).
async def get_state(request: Request) -> AppState:
    return request.app.state.moegate


State = Annotated[AppState, Depends(get_state)]


def _bearer(authorization: str | None) -> str:
    if not authorization:
        return ""
    scheme, _, key = authorization.partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


async def get_tenant(request: Request, state: State, authorization: Annotated[str | None, Header()] = None) -> Tenant:
    """The tenant owning the bearer key (named in the request's audit record); 401 with an OpenAI error body
    otherwise."""
    tenant = _authenticate(state, authorization)
    request_audit(request.scope).tenant = tenant.id
    return tenant


def _authenticate(state: AppState, authorization: str | None) -> Tenant:
    key = _bearer(authorization)
    policy = state.policy
    if state.open_access:
        return policy.tenants[0]
    if not key:
        raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                       code="missing_api_key")
    tenant = policy.authenticate(key)
    if tenant is None:
        shown = key[:3] + "*" * max(0, len(key) - 7) + key[-4:] if len(key) > 8 else "***"
        raise APIError(401, f"Incorrect API key provided: {shown}.", code="invalid_api_key")
    return tenant


TenantDep = Annotated[Tenant, Depends(get_tenant)]


def check_model(state: AppState, model: str) -> None:
    if model != state.settings.model_name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                            f"'{state.settings.model_name}'.", param="model", code="model_not_found")
