"""Gateway settings: a frozen dataclass built from CLI flags and environment, checked once."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.gguf import find_gguf

log = logging.getLogger(__name__)
DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "engine" / "assets" / "demo-moe"
DEFAULT_MODEL_NAME = "moegate-demo"
BUILTIN_MODELS = {"demo": DEMO_MODEL_DIR}  # `source: builtin:<name>` in a policy


class ModelNotFound(FileNotFoundError):
    """No model directory to serve."""


def default_state_dir() -> Path:
    if os.environ.get("MOEGATE_STATE_DIR"):
        return Path(os.environ["MOEGATE_STATE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moegate"


@dataclass(frozen=True)
class Settings:
    model: str  # checkpoint directory
    model_name: str = DEFAULT_MODEL_NAME  # the id clients send as `model`
    policy_path: str | None = None  # None: the embedded permissive dev policy (any API key)
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    dtype: str = "float32"
    kv_cache_gib: float = 0.5
    max_num_seqs: int = 32
    max_queue: int = 64  # requests in flight (all tenants) before answering 429
    max_request_bytes: int = 2_000_000
    request_timeout_s: float = 300.0
    strict_retries: int = 1  # regenerations (greedy, constrained) after a failed validation
    tool_format: str | None = None  # tool-call format (gateway/structured/tool_formats); None: the checkpoint's family
    state_dir: Path = field(default_factory=default_state_dir)  # audit log and trace file
    redis_url: str | None = None
    otlp_endpoint: str | None = None
    trace_file: bool = True

    def __post_init__(self) -> None:
        if not (Path(self.model) / "config.json").is_file() and find_gguf(self.model) is None:
            raise ModelNotFound(f"{self.model} is not a model directory (no config.json) nor a GGUF file")
        if self.max_queue < 1 or self.max_request_bytes < 1 or self.request_timeout_s <= 0:
            raise ValueError("max_queue, max_request_bytes and request_timeout_s must be positive")
        if self.strict_retries < 0:
            raise ValueError(f"strict_retries must be >= 0, got {self.strict_retries}")
        if self.tool_format is not None:
            from gateway.structured.tool_formats import get_format

            get_format(self.tool_format)  # ToolFormatError (a ValueError) naming the known formats
        object.__setattr__(self, "state_dir", Path(self.state_dir))
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")

    @property
    def audit_path(self) -> Path:
        return Path(self.state_dir) / "audit.jsonl"

    @property
    def trace_path(self) -> Path | None:
        return Path(self.state_dir) / "traces.jsonl" if self.trace_file else None


def resolve_model_dir(model: str | None) -> str:
    """--model, else $MOEGATE_MODEL, else the bundled demo model; a clear error when none exists."""
    chosen = model or os.environ.get("MOEGATE_MODEL")
    if chosen:
        return chosen
    if (DEMO_MODEL_DIR / "config.json").is_file():
        return str(DEMO_MODEL_DIR)
    raise ModelNotFound(
        f"no model to serve: the bundled demo model is not installed at {DEMO_MODEL_DIR}. Pass --model DIR "
        "(a Hugging Face MoE checkpoint directory) or create one with "
        "`moegate model init-random --arch qwen3_moe --preset tiny --out DIR`.")


def model_source_dir(source: str, policy_path: str | Path) -> str:
    """A policy's `models[].source` as a directory: `builtin:<name>`, or a path (relative to the policy file)."""
    if source.startswith("builtin:"):
        name = source.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            raise ModelNotFound(f"{policy_path}: unknown built-in model {source!r}; known: "
                                f"{', '.join('builtin:' + n for n in sorted(BUILTIN_MODELS))}")
        return str(BUILTIN_MODELS[name])
    path = Path(source).expanduser()
    return str(path if path.is_absolute() else Path(policy_path).resolve().parent / path)


def served_from_policy(policy_path: str, model: str | None, model_name: str | None) -> tuple[str, str]:
    """(checkpoint directory, model id) the policy file describes, `model` / `model_name` overriding it.

    The engine hosts one model per process: `model_name` picks one of the policy's models, else the first
    is served (a warning names the others, whose requests get 404). `model` (a directory) replaces that
    entry's `source`."""
    from policies.loader import load_policy

    policy = load_policy(policy_path)
    names = [m.name for m in policy.models]
    if model_name is None:
        entry = policy.models[0]
        if len(names) > 1:
            log.warning("policy %s lists %d models %s; this process serves the first, %r (pick another with "
                        "--model-name; requests for the others get 404)", policy_path, len(names), names, entry.name)
    else:
        entry = next((m for m in policy.models if m.name == model_name), None)
        if entry is None:
            raise ValueError(f"policy {policy_path} does not list the model {model_name!r} (it lists {names}); "
                             "add it to the policy's `models` or pass one of those to --model-name")
    if model:
        return model, entry.name
    if entry.source is None:
        raise ModelNotFound(f"policy {policy_path}: model {entry.name!r} has no `source`; set it to a checkpoint "
                            "directory (or builtin:demo) or pass --model DIR")
    directory = model_source_dir(entry.source, policy_path)
    if not (Path(directory) / "config.json").is_file():
        raise ModelNotFound(f"policy {policy_path}: the source of model {entry.name!r}, {entry.source!r}, is not a "
                            f"model directory (no {directory}/config.json); fix `source` or pass --model DIR")
    return directory, entry.name


def from_env(**overrides) -> Settings:
    """Settings from MOEGATE_* / REDIS_URL / OTEL_EXPORTER_OTLP_ENDPOINT, then explicit overrides.

    With a policy file, the model served is the one the policy lists (from its `source`); --model (or
    $MOEGATE_MODEL) and --model-name override that, they need not repeat it."""
    env = os.environ
    values: dict = {
        "redis_url": env.get("REDIS_URL") or None,
        "otlp_endpoint": env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
    }
    if env.get("MOEGATE_POLICY"):
        values["policy_path"] = env["MOEGATE_POLICY"]
    if env.get("MOEGATE_DEVICE"):
        values["device"] = env["MOEGATE_DEVICE"]
    values.update({k: v for k, v in overrides.items() if v is not None})
    model = values.get("model") or env.get("MOEGATE_MODEL") or None
    if values.get("policy_path"):
        values["model"], values["model_name"] = served_from_policy(values["policy_path"], model,
                                                                   values.get("model_name"))
    else:
        values["model"] = resolve_model_dir(model)
    return Settings(**values)
