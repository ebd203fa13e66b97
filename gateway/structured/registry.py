"""The constraint backends by name, and the default per constraint kind; add a backend with `register_backend`."""

from __future__ import annotations

from .base import Backend, ConstraintKind
from .errors import UnknownBackendError

_BACKENDS: dict[str, Backend] = {}

# Default backend per constraint kind, chosen by evals/structured (see docs/structured.md):
# llguidance compiles in ms where outlines-core needs seconds over a 151k vocabulary, and it
# enforces numeric bounds and formats that outlines-core's JSON-Schema regex drops.
DEFAULT_BACKEND: dict[ConstraintKind, str] = {
    ConstraintKind.JSON_SCHEMA: "llguidance",
    ConstraintKind.REGEX: "llguidance",
    ConstraintKind.GRAMMAR: "llguidance",
    ConstraintKind.TOOL_CALLS: "llguidance",
    ConstraintKind.SQL: "llguidance",
}


def register_backend(backend: Backend) -> Backend:
    _BACKENDS[backend.name] = backend
    return backend


def get_backend(kind: ConstraintKind, name: str | None = None) -> Backend:
    _ensure_builtin_backends()
    name = name or DEFAULT_BACKEND[kind]
    backend = _BACKENDS.get(name)
    if backend is None or kind not in backend.kinds:
        avail = sorted(n for n, b in _BACKENDS.items() if kind in b.kinds)
        raise UnknownBackendError(name, kind, avail)
    return backend


def _ensure_builtin_backends() -> None:
    """The built-in backends, imported on first use (outlines-core is slow to import)."""
    if "llguidance" in _BACKENDS:
        return
    from .backend_llguidance import LLGuidanceBackend
    from .backend_outlines import OutlinesBackend

    for backend in (LLGuidanceBackend(), OutlinesBackend()):
        _BACKENDS.setdefault(backend.name, backend)
