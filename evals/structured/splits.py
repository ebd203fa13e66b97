"""The JSON Schema splits the structured eval runs: every JSONSchemaBench split found in
DATA/jsonschemabench (one schema a line), and splits built from data an installed package ships.

`Kubernetes`: every object schema of the Kubernetes API that `kubernetes-validate` bundles (one file per
kind and version, referencing a shared `_definitions.json`), each made self-contained: the definitions it
reaches are copied under its own `$defs` and the references rewritten to them. JSONSchemaBench's own
Kubernetes split is drawn from the same API; this one is the whole of one release.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

from .common import DATA

KUBERNETES_RELEASE = "v1.29.0-local"
DEFS = "#/$defs/"


def kubernetes_rows(release: str = KUBERNETES_RELEASE) -> list[dict]:
    """[{"id": kind file stem, "schema": self-contained schema}], sorted by id; [] without the package."""
    try:
        import kubernetes_validate
    except ImportError:
        return []
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / release
    defs = json.loads((root / "_definitions.json").read_text())["$defs"]
    rows = []
    for path in sorted(root.glob("*.json")):
        if path.name in ("_definitions.json", "all.json"):  # the shared definitions; a union of every kind
            continue
        schema = json.loads(path.read_text())
        used: set[str] = set()
        _reach(schema, defs, used)
        schema = _local(schema)
        if used:
            schema["$defs"] = {name: _local(defs[name]) for name in sorted(used)}
        rows.append({"id": path.stem, "schema": schema})
    return rows


def _reach(node, defs: dict, used: set[str]) -> None:
    """Adds to `used` every definition `node` references, directly or through another definition."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and DEFS in ref:
            name = ref.split(DEFS, 1)[1]
            if name not in used:
                used.add(name)
                _reach(defs[name], defs, used)
        for value in node.values():
            _reach(value, defs, used)
    elif isinstance(node, list):
        for value in node:
            _reach(value, defs, used)


def _local(node):
    """`/api/_definitions.json#/$defs/X` -> `#/$defs/X`, everywhere in `node`."""
    if isinstance(node, dict):
        return {k: (DEFS + v.split(DEFS, 1)[1] if k == "$ref" and isinstance(v, str) and DEFS in v else _local(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_local(v) for v in node]
    return node


# name -> (the package its data comes from, the rows' loader)
EXTRA_SPLITS: dict[str, tuple[str, Callable[[], list[dict]]]] = {"Kubernetes-1.29": ("kubernetes_validate", kubernetes_rows)}


def _bench_rows(split: str) -> list[dict]:
    return [json.loads(line) for line in open(DATA / "jsonschemabench" / f"{split}.jsonl")]


def splits() -> dict[str, Callable[[], list[dict]]]:
    """Split name -> its rows' loader, JSONSchemaBench's first (in name order), then the built ones."""
    found = {p.stem: (lambda s=p.stem: _bench_rows(s)) for p in sorted((DATA / "jsonschemabench").glob("*.jsonl"))}
    return found | {name: load for name, (package, load) in EXTRA_SPLITS.items() if find_spec(package)}
