"""What decoding enforces of a JSON Schema and what validation checks: the grammar's schema and a
per-keyword report (`Enforcement`), returned with every structured response.

The grammar compiles a schema derived from the caller's: keywords llguidance cannot express are
removed from it (the grammar then admits a superset and jsonschema decides, with the gateway's
bounded strict retry), a few are rewritten into what it can express (`not: {type}`, `not:
{required: [k]}`), unknown formats are annotations (checked where jsonschema has a checker), and
objects the schema leaves open are closed (extra properties stay valid but are not generated).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import jsonschema

from .errors import ConstraintCompileError, UnsupportedSchemaError
from .json_schema import (
    ANNOTATIONS,
    LLGUIDANCE_KEYWORDS,
    STRICT_FORMATS,
    STRICT_JSON_OPTIONS,
    meta_validator,
    normalise,
    parse_schema,
    validator_class,
    walk,
)

GRAMMAR = "grammar"  # decoding cannot produce a violation
GUIDED = "grammar+validation"  # the grammar approximates, jsonschema decides (bounded strict retry)
VALIDATION = "validation"  # jsonschema after decoding, bounded strict retry
ANNOTATION = "annotation"  # asserts nothing (unknown format without a checker)
_RANK = {GRAMMAR: 0, ANNOTATION: 0, GUIDED: 1, VALIDATION: 2}

LLGUIDANCE_FORMATS = frozenset({
    "date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
})
# Assertions llguidance does not implement: dropped from the grammar's schema, checked by jsonschema.
VALIDATION_ONLY = frozenset({
    "not", "if", "then", "else", "dependencies", "dependentRequired", "dependentSchemas", "uniqueItems",
    "contains", "minContains", "maxContains", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
    "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor", "extends", "disallow", "divisibleBy",
})
_CONTAINERS = frozenset({"$defs", "definitions"})
_APPLICATORS = frozenset({"allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "not", "dependencies",
                          "dependentSchemas", "dependentRequired", "unevaluatedProperties", "patternProperties",
                          "propertyNames"})
_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
NUMERIC_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


@dataclass
class Enforcement:
    """How each keyword of the schema is enforced (GRAMMAR / GUIDED / VALIDATION / ANNOTATION)."""

    keywords: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    rewritten: set[str] = field(default_factory=set)  # keywords the grammar enforces through a rewrite

    def set(self, keyword: str, method: str) -> None:
        """Record a method; a keyword enforced differently at several places reports the weakest."""
        if _RANK[method] >= _RANK.get(self.keywords.get(keyword, GRAMMAR), 0) or keyword not in self.keywords:
            self.keywords[keyword] = method

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def needs_validation(self) -> bool:
        return any(m in (GUIDED, VALIDATION) for m in self.keywords.values())

    def to_dict(self) -> dict:
        return {"keywords": dict(sorted(self.keywords.items())), "notes": list(self.notes)}


@dataclass
class GrammarSchema:
    """The schema the grammar compiles (already normalised) and the report of what it enforces."""

    schema: dict | bool
    enforcement: Enforcement


def _repair(sub: dict, apply: bool) -> bool:
    """Meaning-preserving repairs of one sub-schema (in place when `apply`); returns whether any is
    due: duplicate enum/required/type entries dropped, an empty `required` (invalid in draft 4)
    removed, draft-3 forms in their draft-3 meaning (`required: true` on a property moves into the
    object's `required` list, `type: "any"` is no type constraint)."""
    due = False
    for key in ("enum", "required", "type"):
        value = sub.get(key)
        if isinstance(value, list):
            unique = [v for i, v in enumerate(value) if v not in value[:i]]
            if key == "required" and not unique or key == "type" and "any" in unique:
                due = True
                if apply:
                    del sub[key]
            elif len(unique) != len(value):
                due = True
                if apply:
                    sub[key] = unique
    if sub.get("type") == "any":
        due = True
        if apply:
            del sub["type"]
    props = sub.get("properties")
    flagged = [n for n, p in props.items() if isinstance(p, dict) and isinstance(p.get("required"), bool)] \
        if isinstance(props, dict) else []
    if flagged:
        due = True
        if apply:
            required = [n for n in flagged if props[n].pop("required")]
            if required:
                sub["required"] = [*(sub.get("required") if isinstance(sub.get("required"), list) else []),
                                   *[n for n in required if n not in (sub.get("required") or [])]]
    if isinstance(sub.get("required"), bool):  # draft 3 outside `properties`: says nothing here
        due = True
        if apply:
            del sub["required"]
    return due


def repair(schema: dict | bool) -> dict | bool:
    """The schema with `_repair` applied everywhere (a copy; the schema itself when none is due)."""
    if not isinstance(schema, dict) or not any(_repair(sub, False) for _, sub in walk(schema)):
        return schema
    schema = copy.deepcopy(schema)
    for _, sub in walk(schema):
        _repair(sub, True)
    return schema


def meta_validate(schema: dict | bool) -> dict | bool:
    """The schema repaired where the repair keeps its meaning (`repair`), then checked against its
    draft's meta-schema: an invalid schema is a typed 400 naming the place."""
    if not isinstance(schema, dict):
        return schema
    schema = repair(schema)
    cls = validator_class(schema)
    error = jsonschema.exceptions.best_match(meta_validator(cls).iter_errors(schema))
    if error is not None:
        where = "#/" + "/".join(str(p) for p in error.absolute_path)
        raise ConstraintCompileError("json_schema", f"the schema is not a valid {cls.__name__.removesuffix('Validator')}"
                                     f" JSON Schema at {where}: {error.message[:200]}")
    return schema


def _format_method(name: str, checker) -> str:
    if name in LLGUIDANCE_FORMATS or name in STRICT_FORMATS:
        return GRAMMAR
    return VALIDATION if name in checker().checkers else ANNOTATION


def grammar_schema(schema: dict | bool, close_open_objects: bool = True) -> GrammarSchema:
    """Derive the grammar's schema from a meta-validated one and report each keyword's enforcement."""
    report = Enforcement()
    if not isinstance(schema, dict):
        if schema is False:
            raise ConstraintCompileError("json_schema", "the schema `false` admits no value (unsatisfiable)")
        return GrammarSchema(schema, report)
    for _, sub in walk(schema):
        for key, value in sub.items():
            if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
                raise UnsupportedSchemaError("$ref", "#", f"remote reference {value!r} cannot be resolved", "llguidance")
    written = {key for _, sub in walk(schema) for key in sub}  # reported: the caller's keywords, not a rewrite's
    out = copy.deepcopy(schema)
    if out.pop("x-guidance", None) is not None:  # an llguidance extension key, not JSON Schema
        report.note("the schema's x-guidance block is not applied: the gateway sets llguidance's options "
                    "(compact JSON, strict keywords)")
    checker = functools.cache(lambda: validator_class(schema).FORMAT_CHECKER)  # only for formats
    if close_open_objects:
        closed = _close_open_objects(out)
        if closed:
            report.note("objects the schema leaves open (additionalProperties absent or true) are generated with "
                        f"their declared properties only; extra properties stay valid but are not generated: "
                        f"{', '.join(closed[:8])}{' ...' if len(closed) > 8 else ''}")
    for _, sub in walk(out):
        _rewrite_not(sub, report)
        _rewrite_exclusive_required(sub, report)
        _rewrite_dependent_required(sub, report)
        for key in list(sub):
            if key in ANNOTATIONS or key in _CONTAINERS:
                continue
            if key in VALIDATION_ONLY:
                if key == "uniqueItems" and sub[key] is False:
                    sub.pop(key)
                    continue
                sub.pop(key)
                report.set(key, VALIDATION)
            elif key == "format":
                name = sub[key]
                method = _format_method(name, checker) if isinstance(name, str) else ANNOTATION
                report.set(f"format:{name}", method)
                if method != GRAMMAR:
                    sub.pop(key)
            elif key in LLGUIDANCE_KEYWORDS and key in written:
                report.set(key, GRAMMAR)
    report.note("numbers are finite doubles (a decoding guard bounds digits and exponents)")
    return GrammarSchema(normalise(out), report)


def _rewrite_not(sub: dict, report: Enforcement) -> None:
    """`not: {type: T}` narrows `type`; `not: {required: [k]}` forbids property k: both in the grammar."""
    neg = sub.get("not")
    if not isinstance(neg, dict):
        return
    keys = set(neg) - ANNOTATIONS
    if keys == {"type"}:
        banned = {neg["type"]} if isinstance(neg["type"], str) else set(neg["type"])
        if "number" in banned:
            banned.add("integer")
        current = sub.get("type", list(_TYPES))
        current = [current] if isinstance(current, str) else list(current)
        left = [t for t in current if t not in banned and not (t == "integer" and "number" in banned)]
        if left:
            sub["type"] = left
            sub.pop("not")
            report.set("not", GRAMMAR)
            report.rewritten.add("not")
    elif keys == {"required"} and isinstance(neg["required"], list) and len(neg["required"]) == 1:
        name = neg["required"][0]
        if name not in (sub.get("required") or []) and isinstance(sub.get("properties", {}), dict):
            sub.setdefault("properties", {})[name] = False
            sub.pop("not")
            report.set("not", GRAMMAR)
            report.rewritten.add("not")


MAX_ONE_OF_EXPANSION = 64  # alternatives llguidance expands for one oneOf-of-required rewrite


def _rewrite_exclusive_required(sub: dict, report: Enforcement) -> None:
    """`oneOf` of `required` lists ("exactly one of these argument sets") as anyOf branches with the
    same meaning: branch i requires R_i and, for every other set R_j, lacks one of R_j's keys not in
    R_i (a branch whose R_j is a subset of R_i can never be the only match and is dropped). The
    grammar then enforces it."""
    branches = sub.get("oneOf")
    if not isinstance(branches, list) or len(branches) < 2 or "anyOf" in sub:
        return
    sets = []
    for b in branches:
        if not isinstance(b, dict) or set(b) - ANNOTATIONS != {"required"} or not isinstance(b["required"], list):
            return
        sets.append(sorted({r for r in b["required"] if isinstance(r, str)}))
    alternatives, size = [], 0
    for i, own in enumerate(sets):
        others = [[k for k in other if k not in own] for j, other in enumerate(sets) if j != i]
        if any(not missing for missing in others):
            continue  # another set is within this one: both would match
        size += _product(len(m) for m in others)
        lacks = [{"anyOf": [{"properties": {k: False}} for k in missing]} if len(missing) > 1
                 else {"properties": {missing[0]: False}} for missing in others]
        alternatives.append({"required": own, "allOf": lacks})
    if size > MAX_ONE_OF_EXPANSION:
        return
    sub["anyOf"] = alternatives or [False]
    sub.pop("oneOf")
    report.set("oneOf", GRAMMAR)
    report.rewritten.add("oneOf")


def _product(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


MAX_DEPENDENCY_REWRITES = 4  # each becomes a two-way anyOf inside allOf: 2**n branches for llguidance


def _rewrite_dependent_required(sub: dict, report: Enforcement) -> None:
    """`dependentRequired` / array-form `dependencies` ("if a is present, b and c are too") as
    allOf members `anyOf: [{a absent}, {required: [a, b, c]}]`, which the grammar enforces."""
    deps: list[tuple[str, str, list[str]]] = []
    for key in ("dependentRequired", "dependencies"):
        table = sub.get(key)
        if isinstance(table, dict):
            deps += [(key, name, req) for name, req in table.items()
                     if isinstance(req, list) and all(isinstance(r, str) for r in req)]
    if not deps or len(deps) > MAX_DEPENDENCY_REWRITES or not isinstance(sub.get("allOf", []), list):
        return
    members = [{"anyOf": [{"properties": {name: False}}, {"required": [name, *[r for r in req if r != name]]}]}
               for _, name, req in deps if req]
    for key, name, _ in deps:
        sub[key].pop(name)
        report.set(key, GRAMMAR)
        report.rewritten.add(key)
    for key in ("dependentRequired", "dependencies"):
        if key in sub and not sub[key]:
            sub.pop(key)
    if members:
        sub["allOf"] = [*sub.get("allOf", []), *members]


def resolve_pointer(root: dict, ref: str) -> dict | None:
    """The sub-schema a local reference (`#/definitions/x`) names, or None."""
    node: object = root
    for part in ref.lstrip("#").strip("/").split("/") if ref not in ("#", "") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict) else None


def _merged_nodes(root: dict) -> Iterator[dict]:
    """Sub-schemas whose constraints are intersected with a sibling's (allOf members, conditional
    branches, applicator members next to other keywords, $ref targets used so): closing one of them
    would forbid properties the sibling declares."""
    for _, sub in walk(root):
        others = set(sub) - ANNOTATIONS - {"anyOf", "oneOf", "allOf", "$ref"}
        for key in ("allOf", "anyOf", "oneOf"):
            members = sub.get(key)
            if isinstance(members, list) and (key == "allOf" or others or len(set(sub) & {"anyOf", "oneOf", "allOf",
                                                                                          "$ref"}) > 1):
                yield from (m for m in members if isinstance(m, dict))
        for key in ("then", "else", "if", "not"):
            if isinstance(sub.get(key), dict):
                yield sub[key]
        for key in ("dependentSchemas", "dependencies"):
            if isinstance(sub.get(key), dict):
                yield from (m for m in sub[key].values() if isinstance(m, dict))


def _close_open_objects(root: dict) -> list[str]:
    """Set additionalProperties false on open objects where that only narrows what is generated;
    returns their paths."""
    merged = {id(m) for m in _merged_nodes(root)}
    for _, sub in walk(root):  # a $ref target used where it is merged is merged too
        ref = sub.get("$ref")
        if isinstance(ref, str) and (id(sub) in merged or set(sub) - ANNOTATIONS - {"$ref"}):
            target = resolve_pointer(root, ref)
            if target is not None:
                merged.add(id(target))
    todo = [sub for _, sub in walk(root) if id(sub) in merged]
    while todo:  # members and $ref targets of a merged node merge too
        sub = todo.pop()
        nexts = [m for key in ("allOf", "anyOf", "oneOf") if isinstance(sub.get(key), list) for m in sub[key]]
        if isinstance(sub.get("$ref"), str):
            nexts.append(resolve_pointer(root, sub["$ref"]))
        for m in nexts:
            if isinstance(m, dict) and id(m) not in merged:
                merged.add(id(m))
                todo.append(m)
    closed = []
    for path, sub in walk(root):
        props = sub.get("properties")
        if (id(sub) in merged or not isinstance(props, dict) or not props or set(sub) & _APPLICATORS
                or sub.get("additionalProperties", True) is not True
                or "object" not in ([sub["type"]] if isinstance(sub.get("type"), str) else sub.get("type", ["object"]))):
            continue
        required = [r for r in sub.get("required") or [] if isinstance(r, str)]
        names = set(props) | set(required)
        if isinstance(sub.get("minProperties"), int) and sub["minProperties"] > len(names):
            continue
        for name in required:
            props.setdefault(name, {})
        sub["additionalProperties"] = False
        closed.append(path)
    return closed


def drop_keywords(schema: dict, keywords: tuple[str, ...], report: Enforcement, where=None) -> bool:
    """Remove `keywords` from the grammar's schema (at sub-schemas `where(sub)` selects); recorded as
    validation. Returns whether anything was removed."""
    removed = False
    for _, sub in walk(schema):
        if where is not None and not where(sub):
            continue
        for key in keywords:
            if key in sub:
                sub.pop(key)
                report.set(key, VALIDATION)
                removed = True
    return removed


def with_guidance_options(schema: dict | bool, item_sep: str = ", ", key_sep: str = ": ") -> dict:
    """The grammar's schema with an `x-guidance` block, for embedding as %json{...} in a Lark grammar
    (tool arguments, fenced JSON). oneOf is admitted as anyOf there (validation checks exactly one)."""
    derived = grammar_schema(meta_validate(parse_schema(schema)))
    body = {} if derived.schema is True else dict(derived.schema)
    body["x-guidance"] = {**STRICT_JSON_OPTIONS, "coerce_one_of": True, "item_separator": item_sep,
                          "key_separator": key_sep}
    return body
