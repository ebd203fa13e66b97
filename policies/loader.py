"""Load a policy YAML file; every error names the file, line, column and field path."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from policies.model import Policy


@dataclass(frozen=True)
class PolicyIssue:
    field: str  # dotted path, e.g. "tenants[1].limits.requests_per_min"
    message: str
    line: int | None  # 1-based
    column: int | None  # 1-based

    def format(self, source: str) -> str:
        where = f"{source}:{self.line}:{self.column}" if self.line else source
        return f"{where}: {self.field or '<document>'}: {self.message}"


class PolicyError(Exception):
    """A policy file could not be loaded; `issues` lists each problem with its YAML position."""

    def __init__(self, source: str, issues: list[PolicyIssue]):
        self.source = source
        self.issues = issues
        super().__init__("invalid policy:\n" + "\n".join("  " + i.format(source) for i in issues))


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans only: `off`, `no`, `on`, `yes` stay strings (`level: off`)."""


_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _field_path(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _node_at(root: yaml.Node, loc: tuple[str | int, ...]) -> yaml.Node:
    """The deepest YAML node on `loc`: the value node, or the key node for an unexpected key,
    or the enclosing mapping for a missing one."""
    node = root
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            value = next((v for k, v in node.value if k.value == str(part)), None)
            if value is None:
                return node
            node = value
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            return node
    return node


def _key_node(root: yaml.Node, loc: tuple[str | int, ...]) -> yaml.Node | None:
    parent = _node_at(root, loc[:-1])
    if isinstance(parent, yaml.MappingNode):
        return next((k for k, _ in parent.value if k.value == str(loc[-1])), None)
    return None


def _duplicate_keys(node: yaml.Node, path: tuple[str | int, ...] = ()) -> list[PolicyIssue]:
    issues: list[PolicyIssue] = []
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            if key.value in seen:
                issues.append(PolicyIssue(_field_path((*path, key.value)), "duplicate key",
                                          key.start_mark.line + 1, key.start_mark.column + 1))
            seen.add(key.value)
            issues += _duplicate_keys(value, (*path, key.value))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            issues += _duplicate_keys(item, (*path, i))
    return issues


def _strip_model_prefix(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    # pydantic reports e.g. ("limits", "function-after[...]", ...) for some validators; drop those parts
    return tuple(p for p in loc if not (isinstance(p, str) and "[" in p and p.endswith("]")))


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    """Parse YAML text into a validated Policy, or raise PolicyError with positions."""
    try:
        loader = _Loader(text)
        try:
            root = loader.get_single_node()
            if root is None:
                raise PolicyError(source, [PolicyIssue("", "the policy file is empty", None, None)])
            issues = _duplicate_keys(root)
            if issues:
                raise PolicyError(source, issues)
            data = loader.construct_document(root)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        raise PolicyError(source, [PolicyIssue("", f"YAML syntax: {exc.problem}",
                                               mark.line + 1 if mark else None,
                                               mark.column + 1 if mark else None)]) from None
    if not isinstance(data, dict):
        raise PolicyError(source, [PolicyIssue("", "the policy must be a mapping at the top level",
                                               root.start_mark.line + 1, root.start_mark.column + 1)])
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        issues = []
        for err in exc.errors():
            loc = _strip_model_prefix(err["loc"])
            on_key = err["type"] == "extra_forbidden" or "[key]" in err["loc"]  # the key itself is wrong
            node = (_key_node(root, loc) if on_key and loc else None) or _node_at(root, loc)
            message = err["msg"]
            if err["type"] == "extra_forbidden":
                message = "unknown field (typo?)"
            issues.append(PolicyIssue(_field_path(loc), message,
                                      node.start_mark.line + 1, node.start_mark.column + 1))
        raise PolicyError(source, issues) from None


def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(str(path), [PolicyIssue("", f"cannot read file: {exc.strerror}", None, None)]) from None
    return parse_policy(text, str(path))
