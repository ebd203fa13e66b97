"""A reloaded policy against the running process: what it cannot take is rejected, what it can is applied.

Checked before the new policy replaces the current one (PolicyHolder.add_check): it must still list the
served model with the same source; precision profiles and the audit log's durability are fixed at start
(experts are packed once, the audit file is opened once), so changing them is rejected with a message
rather than accepted and ignored, as is the redis timeout (connections are set up once). Applied after
(PolicyHolder.on_change): exploration's expert deferral (switched by the engine between two steps) and
the stores' fail_open/fail_closed behaviour and circuit-breaker settings.
"""

from __future__ import annotations

import logging
from pathlib import Path

from engine.mode import Mode
from policies.loader import PolicyIssue
from policies.model import Policy

log = logging.getLogger(__name__)


# `deferral_depth: auto` where the dense path runs on a GPU: one expert per token overlaps with the next
# layer's attention (KTransformers reports 1.45x decode at d=1); d=2 drifted further from strict top-1.
AUTO_DEFERRAL_DEPTH = 1


def deferral_for(policy: Policy, top_k: int, device: str) -> int:
    """The policy's exploration deferral depth on `device` (the fast device's type: `auto` resolves to
    AUTO_DEFERRAL_DEPTH on cuda and 0 on the CPU), within what the engine allows (top_k // 2): clamped with
    a warning."""
    wanted = policy.modes.exploration.deferral_depth
    if wanted == "auto":
        wanted = AUTO_DEFERRAL_DEPTH if device == "cuda" else 0
    defer = min(wanted, top_k // 2)
    if defer != wanted:
        log.warning("policy deferral_depth %d clamped to %d for a top-%d model", wanted, defer, top_k)
    return defer


class PolicyReloads:
    """Checks and applies reloads for the process that serves `state.settings.model_name`."""

    def __init__(self, state, top_k: int, device: str, fingerprint) -> None:
        self.state = state
        self.top_k = top_k
        self.device = device  # the fast device's type, for `deferral_depth: auto`
        self.fingerprint = fingerprint  # (llm, settings, mode) -> system_fingerprint

    def install(self, holder) -> None:
        holder.add_check(self.check)
        holder.on_change(self.apply)

    def check(self, new: Policy, current: Policy) -> list[PolicyIssue]:
        served = self.state.settings.model_name
        issues: list[PolicyIssue] = []
        names = [m.name for m in new.models]
        entry = next((m for m in new.models if m.name == served), None)
        before = next((m for m in current.models if m.name == served), None)
        if entry is None:
            issues.append(_issue("models", f"this server serves {served!r}, which the new policy does not list "
                                           f"(it lists {names}); every request would be refused. Keep it listed, "
                                           "or start a server for the new model"))
        elif not _reachable(new, served):
            issues.append(_issue("routes", f"no tenant can reach the served model {served!r} on any route of the "
                                           "new policy (routes[].models / tenants[].models, routes); every "
                                           "request would be refused"))
        elif before is not None and entry.source != before.source and self._served_from(before.source):
            issues.append(_issue(f"models[{names.index(served)}].source",
                                 f"the source of the served model {served!r} changed ({before.source!r} -> "
                                 f"{entry.source!r}); loading another checkpoint needs a restart"))
        for mode in Mode:
            old_p = current.precision_profiles[getattr(current.modes, mode).precision]
            new_p = new.precision_profiles[getattr(new.modes, mode).precision]
            if new_p != old_p:
                changed = ", ".join(f"{k}: {getattr(old_p, k)} -> {getattr(new_p, k)}"
                                    for k in type(new_p).model_fields if getattr(new_p, k) != getattr(old_p, k))
                issues.append(_issue(f"modes.{mode}.precision", f"the {mode} precision profile changed ({changed}); "
                                     "expert and projection weights are packed once at start, so a precision "
                                     "change needs a restart"))
        if new.decoding != current.decoding:
            issues.append(_issue("decoding", f"decoding changed ({current.decoding} -> {new.decoding}); the engine's "
                                             "multi-token decoding is set at start, so it needs a restart"))
        if new.stores.timeout_s != current.stores.timeout_s and hasattr(self.state.store, "breaker"):
            issues.append(_issue("stores.timeout_s", f"stores.timeout_s changed ({current.stores.timeout_s} -> "
                                                     f"{new.stores.timeout_s}); the redis connections are set up "
                                                     "at start, so it needs a restart"))
        for field in ("fsync", "fsync_interval_s"):
            if getattr(new.audit, field) != getattr(current.audit, field):
                issues.append(_issue(f"audit.{field}", f"audit.{field} changed ({getattr(current.audit, field)} -> "
                                                       f"{getattr(new.audit, field)}); the audit log's "
                                                       "durability is set when it opens, so it needs a restart"))
        return issues

    def _served_from(self, source: str | None) -> bool:
        """True when `source` is what this process loaded (not overridden by --model)."""
        from gateway.settings import ModelNotFound, model_source_dir

        if source is None:
            return False
        settings = self.state.settings
        try:
            resolved = model_source_dir(source, settings.policy_path)
        except ModelNotFound:
            return False
        return Path(resolved).resolve() == Path(settings.model).resolve()

    def apply(self, policy: Policy) -> None:
        state = self.state
        if hasattr(state.store, "on_unavailable") and state.store.on_unavailable != policy.stores.on_unavailable:
            log.info("stores: %s -> %s", state.store.on_unavailable, policy.stores.on_unavailable)
            state.store.on_unavailable = policy.stores.on_unavailable
        breaker, stores = getattr(state.store, "breaker", None), policy.stores
        if breaker is not None and (breaker.threshold, breaker.cooldown_s) != (stores.circuit_failures,
                                                                              stores.circuit_cooldown_s):
            log.info("stores: circuit opens after %d failures for %.1f s", stores.circuit_failures,
                     stores.circuit_cooldown_s)
            breaker.threshold, breaker.cooldown_s = stores.circuit_failures, stores.circuit_cooldown_s
        defer = deferral_for(policy, self.top_k, self.device)
        if hasattr(state.llm, "set_deferral") and defer != state.llm.engine.numerics.defer:
            done = state.llm.set_deferral(defer)

            def refresh(future) -> None:  # on the engine thread, once the step boundary applied it
                if future.exception() is not None:
                    log.error("policy deferral_depth %d not applied: %s", defer, future.exception())
                    return
                state.fingerprints.update({m: self.fingerprint(state.llm, state.settings, m)
                                           for m in Mode})
                log.info("policy reload applied: exploration defers %d expert(s)/token", defer)

            done.add_done_callback(refresh)


def _reachable(policy: Policy, model: str) -> bool:
    """Some tenant may call `model` on some route."""
    routes = [r.path for r in policy.routes if r.models is None or model in r.models]
    return any(("*" in t.models or model in t.models) and ("*" in t.routes or set(routes) & set(t.routes))
               for t in policy.tenants if routes)


def _issue(field: str, message: str) -> PolicyIssue:
    return PolicyIssue(field, message, None, None)
