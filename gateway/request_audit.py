"""Exactly one audit record per API request: the endpoint writes its own (with the policy decision, input
and output); this middleware writes one for every /v1/ request that ended without it (401/403/404/413/429,
validation errors, a record that could not be written)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import anyio

from gateway.schemas import random_hex

log = logging.getLogger(__name__)
SCOPE_KEY = "moegate.audit"
_ERROR_BODY_LIMIT = 16_384


@dataclass
class RequestAudit:
    """Per-request marker in the ASGI scope: who the caller was, and whether its record is settled."""

    tenant: str | None = None
    settled: bool = False  # the endpoint wrote the record, or its audit level says to write none
    failure: str | None = None  # why the endpoint's own record could not be written


def request_audit(scope: dict) -> RequestAudit:
    """The request's marker (a detached one outside the middleware, e.g. in unit tests)."""
    return scope.get(SCOPE_KEY) or RequestAudit()


class AuditEveryRequest:
    """ASGI middleware: after a /v1/ request ends, write a `request` / `request.rejected` record unless the
    endpoint settled its own. Metadata only: a denied request's body is not copied into the log."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            return await self.app(scope, receive, send)
        marker = scope[SCOPE_KEY] = RequestAudit()
        status, headers, body = [500], [{}], bytearray()

        async def settle() -> None:
            marker.settled = True
            with anyio.CancelScope(shield=True):
                await _write(scope, marker, status[0], headers[0], bytes(body))

        async def watching(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                headers[0] = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", [])}
            elif message["type"] == "http.response.body":
                if status[0] >= 400 and len(body) < _ERROR_BODY_LIMIT:
                    body.extend(message.get("body", b"")[:_ERROR_BODY_LIMIT - len(body)])
                if not message.get("more_body", False) and not marker.settled:
                    await settle()  # recorded before the client has the whole answer
            await send(message)

        try:
            await self.app(scope, receive, watching)
        finally:
            if not marker.settled:  # ended without a complete answer (an error before it, or the client left)
                await settle()


async def _write(scope: dict, marker: RequestAudit, status: int, headers: dict, body: bytes) -> None:
    state = getattr(scope["app"].state, "moegate", None)
    if state is None:  # not started (or already stopped): nothing to write to
        return
    policy = state.policy
    tenant = next((t for t in policy.tenants if t.id == marker.tenant), None)
    level = (tenant.audit_level if tenant is not None else None) or policy.audit.level
    if level == "off":
        return
    error: dict = {}
    if body:
        try:
            error = json.loads(body).get("error") or {}
        except (ValueError, AttributeError):
            error = {}
    client = scope.get("client")
    data = {"request_id": headers.get("x-request-id") or f"req-{random_hex()}",
            "method": scope.get("method"), "route": scope.get("path"), "status": status,
            "tenant": marker.tenant, "client": client[0] if client else None, "policy_id": policy.id,
            "policy_digest": policy.digest}
    if error:
        data["error"] = error.get("code") or error.get("type")
        data["message"] = policy.audit.redact_text(str(error.get("message", "")))[:300]
    if headers.get("idempotent-replayed"):
        data["idempotent_replayed"] = True
    if marker.failure:
        data["record_failure"] = marker.failure[:300]
    try:
        await state.audit.aappend("request.rejected" if status >= 400 else "request", data)
    except Exception:  # noqa: BLE001 - nothing more can be done than saying so
        log.exception("audit append failed for %s %s", scope.get("method"), scope.get("path"))
