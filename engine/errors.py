"""Typed engine errors with messages a person can act on."""

from __future__ import annotations

from collections.abc import Iterable


class EngineError(Exception):
    """Base class of errors raised by the engine."""


class CheckpointError(EngineError):
    """A checkpoint directory is incomplete, inconsistent or corrupt."""


class UnsupportedArchitectureError(CheckpointError):
    def __init__(self, arch: str, supported: Iterable[str]) -> None:
        super().__init__(
            f"unsupported architecture {arch!r}: moegate runs {', '.join(supported)} "
            "(config.json 'model_type')"
        )
        self.arch = arch


class MissingTensorError(CheckpointError):
    def __init__(self, names: list[str]) -> None:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(f"checkpoint is missing {len(names)} tensor(s): {shown}")
        self.names = names


class TensorShapeError(CheckpointError):
    def __init__(self, name: str, expected: tuple[int, ...], found: tuple[int, ...]) -> None:
        super().__init__(f"tensor {name!r} has shape {list(found)}, expected {list(expected)}")
        self.name = name


class UnexpectedTensorError(CheckpointError):
    """Tensors the model has no place for: loading them nowhere would silently change the model."""

    def __init__(self, names: list[str], hint: str = "") -> None:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(
            f"checkpoint has {len(names)} tensor(s) the model does not use: {shown}"
            + (f" ({hint})" if hint else " (a different architecture or an unsupported variant or quantization?)")
        )
        self.names = names


class UnsupportedCheckpointError(CheckpointError):
    """A checkpoint format or quantization the engine cannot load (named in the message)."""


class RequestError(EngineError):
    """A request the engine cannot serve as given (e.g. a prompt longer than the model allows)."""
