"""The FastAPI app factory: the lifespan owns the engine, policy, stores, telemetry and audit log."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from engine.gguf import model_dir_of
from engine.identity import checkpoint_identity
from engine.mode import Mode
from gateway.deps import AppState
from gateway.errors import APIError, install_handlers
from gateway.metrics import Metrics
from gateway.request_audit import AuditEveryRequest
from gateway.settings import Settings
from policies.model import ModelEntry, Policy

log = logging.getLogger(__name__)
DEV_POLICY = Path(__file__).resolve().parent.parent / "policies" / "examples" / "dev.yaml"


class FixedPolicy:
    """The embedded default: policies/examples/dev.yaml serving `model_name`, any API key accepted."""

    def __init__(self, model_name: str, model_dir: str):
        from policies.loader import load_policy

        base = load_policy(DEV_POLICY)
        self.current: Policy = base.model_copy(update={"models": [ModelEntry(name=model_name, source=model_dir)]})


def numerics_from_policy(policy: Policy, defer: int = 0):
    """The engine's numerics profile (engine/numerics.py) from the policy's precision profiles of the two modes:
    both expert profiles resident, fp32 lm_head in execution, exploration's lm_head and attention formats and
    hot experts, exploration's deferral `defer` (resolved by `deferral_for`)."""
    from engine.experts import DynamicHotConfig, PlacementConfig
    from engine.numerics import NumericsProfile

    fast = policy.precision_profiles[policy.modes.exploration.precision]
    exact = policy.precision_profiles[policy.modes.execution.precision]
    if fast.formatting_layers:
        log.warning("exploration profile sets formatting_layers=%d: formatting layers apply to execution only",
                    fast.formatting_layers)
    if exact.lm_head in ("int8", "int8_a8", "int4", "bf16_a16"):
        log.warning("execution lm_head %s is not available: execution keeps the model's lm_head", exact.lm_head)
    if exact.attention != "model":
        log.warning("execution attention %s is not available: execution keeps the model's weights", exact.attention)
    hot = fast.hot_experts
    placement = PlacementConfig(
        fast_format=fast.routed_experts,
        execution_format=exact.routed_experts,
        exact_format=exact.formatting_dtype,
        formatting_layers=exact.formatting_layers,
        **({} if hot is None else dict(
            hot_experts=hot.gpu_per_layer, mixed_hot_fraction=hot.exact_share, mixed_format=fast.formatting_dtype,
            hot_strategy=hot.strategy, stats_file=hot.stats_file,
            dynamic=DynamicHotConfig(hot.interval_steps, hot.decay, hot.threshold, hot.max_swaps))),
    )
    return NumericsProfile(experts=placement, exact_lm_head=exact.lm_head == "fp32",
                           fast_lm_head=fast.lm_head if fast.lm_head != "fp32" else None,
                           fast_dense=fast.attention if fast.attention != "model" else None, defer=defer)


def numerics_fingerprint(llm, settings: Settings, mode: Mode = Mode.EXECUTION) -> str:
    """`system_fingerprint`: the engine's numerics fingerprint for `mode` when it has one, else a hash of what
    decides the numerics (config, weight files, tokenizer, dtype, device)."""
    own = getattr(llm, "numerics_fingerprint", None)
    if callable(own):
        value = own(mode)
        return value if value.startswith("fp_") else "fp_" + value.removeprefix("sha256:")[:16]
    engine = llm.engine
    h = hashlib.sha256()
    h.update(checkpoint_identity(settings.model).encode())
    h.update(str(getattr(engine.tokenizer, "fingerprint", "")).encode())
    h.update(f"{settings.dtype}:{engine.device}".encode())
    return "fp_" + h.hexdigest()[:16]


class BodyLimit:
    """ASGI middleware: refuse bodies over `limit` bytes with 413, whether declared (Content-Length) or
    streamed (chunked): the body is read up to the limit before the app sees it, then replayed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _too_large(self.limit, send)
        body, first = bytearray(), None
        while first is None:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the body ended: the app sees it
                first = message
            body += message.get("body", b"")
            if len(body) > self.limit:
                return await _too_large(self.limit, send)
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": bytes(body), "more_body": False}
        pending = [first]

        async def replayed():
            return pending.pop() if pending else await receive()

        return await self.app(scope, replayed, send)


async def _too_large(limit: int, send) -> None:
    import json

    error = APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RequestMetrics:
    """ASGI middleware: count answers by route and status, and their latency."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]
        route = scope.get("path", "")
        route = route if route.startswith("/v1/") or route in ("/health", "/metrics") else "other"

        async def recording(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording)
        finally:
            self.metrics.requests.labels(route, str(status[0])).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)


def create_app(settings: Settings) -> FastAPI:
    """The gateway app. The engine loads when the app starts (lifespan), not at import."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state, stop = await asyncio.to_thread(_start, settings, metrics)
        app.state.moegate = state
        watcher = None
        if hasattr(state.policies, "watch_async"):
            with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
                state.policies.install_sighup(asyncio.get_running_loop())  # main thread only
            watcher = asyncio.create_task(state.policies.watch_async(2.0))
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            await stop()

    app = FastAPI(title="moegate", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible gateway with exploration/execution modes.")
    install_handlers(app)
    from gateway.routers import chat, completions, health, models

    for r in (chat.router, completions.router, models.router, health.router):
        app.include_router(r)
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes)
    app.add_middleware(AuditEveryRequest)  # outside BodyLimit: a 413 is audited too
    app.add_middleware(RequestMetrics, metrics=metrics)
    return app


def _kv_dir(settings: Settings) -> Path:
    """The prefix cache's disk tier: $MOEGATE_CACHE_DIR/kv when set (the engine's default), else <state_dir>/kv."""
    import os

    if os.environ.get("MOEGATE_CACHE_DIR"):
        from engine.prefix_cache.hashing import default_disk_cache_dir

        return default_disk_cache_dir()
    return Path(settings.state_dir) / "kv"


def _start(settings: Settings, metrics: Metrics):
    from engine.async_engine import AsyncLLM
    from engine.config import ModelConfig
    from engine.engine_config import EngineConfig, resolve_device
    from engine.llm_engine import LLMEngine
    from gateway.audit import AuditLog
    from gateway.audit_record import KEY_ENV, key_from_env
    from gateway.generation import Generator
    from gateway.policy_reload import PolicyReloads, deferral_for
    from gateway.stores import make_store
    from gateway.structured.tool_formats import select_format
    from gateway.structured.vocab import TokenizerInfo
    from gateway.telemetry import setup_tracing
    from policies.watch import PolicyHolder

    if settings.policy_path:
        policies, open_access = PolicyHolder(settings.policy_path), False
        names = [m.name for m in policies.current.models]
        if settings.model_name not in names:
            raise ValueError(f"policy {settings.policy_path} does not list the served model "
                             f"{settings.model_name!r} (it lists {names}); pass --model-name")
    else:
        policies, open_access = FixedPolicy(settings.model_name, settings.model), True
        log.warning("no --config: embedded dev policy, every API key is accepted (tenant 'dev')")
    policy = policies.current
    top_k = ModelConfig.from_dir(Path(settings.model)).top_k
    device = resolve_device(settings.device).type
    defer = deferral_for(policy, top_k, device)
    if policy.modes.exploration.deferral_depth == "auto":
        log.info("expert deferral auto: exploration defers %d expert(s) per token on %s%s", defer, device,
                 "" if device == "cuda" else " (CPU only: experts and the dense path share the cores, nothing "
                 "to overlap; set modes.exploration.deferral_depth to force a depth)")
    engine = LLMEngine(EngineConfig(model=settings.model, device=settings.device, dtype=settings.dtype,
                                    kv_cache_gib=settings.kv_cache_gib, max_num_seqs=settings.max_num_seqs,
                                    numerics=numerics_from_policy(policy, defer),
                                    disk_cache_dir=str(_kv_dir(settings)),
                                    redis_url=settings.redis_url, **policy.decoding.model_dump(),
                                    progress=sys.stderr.isatty()))  # load bars on a terminal, not in logs
    if engine.tokenizer is None:
        raise ValueError(f"{model_dir_of(settings.model)} has no tokenizer.json; the gateway needs one "
                         "(a GGUF model without a tokenizer moegate can rebuild takes the tokenizer.json beside it)")
    tokenizer_file = model_dir_of(settings.model) / "tokenizer.json"
    if tokenizer_file.is_file():
        tok = TokenizerInfo.from_file(tokenizer_file, sorted(engine.eos_token_ids))
    else:  # the tokenizer a GGUF file carries
        tok = TokenizerInfo.from_json(engine.tokenizer.to_json(), sorted(engine.eos_token_ids), str(settings.model))
    tok.warm()  # the constraint vocabulary built once, before the first request
    cfg = engine.model_config
    tool_format, why = select_format(cfg.model_type or cfg.arch, tok, engine.tokenizer.chat_template,
                                     settings.tool_format)
    log.info("tool calls in the %s format (%s)", tool_format.name, why)
    llm = AsyncLLM(engine)
    store = make_store(settings.redis_url or "", policy.stores.on_unavailable, timeout_s=policy.stores.timeout_s,
                       circuit_failures=policy.stores.circuit_failures,
                       circuit_cooldown_s=policy.stores.circuit_cooldown_s)
    Path(settings.state_dir).mkdir(parents=True, exist_ok=True)
    tel = setup_tracing("moegate", settings.otlp_endpoint, jsonl_path=settings.trace_path)
    key = key_from_env()
    audit = AuditLog(settings.audit_path, fsync=policy.audit.fsync, fsync_interval_s=policy.audit.fsync_interval_s,
                     key=key)
    if key is None:
        log.warning("audit chain unkeyed (sha256): set %s to make it HMAC-SHA256", KEY_ENV)
    state = AppState(settings=settings, llm=llm, generator=Generator(llm, tok, settings.strict_retries, tool_format),
                     policies=policies, open_access=open_access, store=store, telemetry=tel, audit=audit,
                     metrics=metrics, fingerprints={m: numerics_fingerprint(llm, settings, m) for m in Mode}, created=int(time.time()))
    if isinstance(policies, PolicyHolder):  # reloads are checked against, and applied to, this process
        PolicyReloads(state, top_k, device, numerics_fingerprint).install(policies)

    async def stop() -> None:
        await asyncio.to_thread(llm.shutdown)
        with contextlib.suppress(Exception):
            await store.close()
        audit.close()
        tel.shutdown()
        if hasattr(policies, "stop"):
            policies.stop()

    return state, stop
