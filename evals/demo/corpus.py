"""Seeded, procedural financial-agent conversations (prose, tool calls, JSON reports, SQL) and held-out tasks."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from evals.demo import adhoc, dialogues
from evals.demo.chat_format import render
from evals.demo.schemas import REPORT_SCHEMAS, TOOLS
from evals.demo.sql_tasks import sample_sql_task
from evals.demo.trading_db import SCHEMA_SQL, create_trading_db

SPLITS = ("train", "heldout")
SQL_SYSTEM = ("You write SQLite queries for the trading database below. Reply with one SQL query in a ```sql "
              "code block.\n\n")
# the gateway's response_format "sql" constrains the reply from its first token, so half the SQL chats ask for a bare query
SQL_SYSTEM_BARE = ("You write SQLite queries for the trading database below. Reply with only the SQL query, no code "
                   "block.\n\n")
JSON_SYSTEM = "Reply with only a JSON object that matches this JSON Schema:\n"
BRIEF_JSON_SYSTEMS = ("Reply with the {report} as a JSON object.", "Return only the {report} JSON.",
                      "Write the {report} in JSON.")
# JSON answers are compact, as the gateway's response_format grammar emits them (no free whitespace, "," and ":")
JSON_SEPARATORS = (",", ":")


@dataclass(frozen=True)
class Conversation:
    """A chat in OpenAI message format; `answer_index` points at the assistant turn a task checks."""

    kind: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    schema: dict[str, Any] | None = None
    answer_index: int = -1
    tables: dict[str, list[str]] | None = None  # ad-hoc SQL: the client's {table: [columns]}

    def render(self) -> str:
        return render(self.messages, self.tools)


@dataclass(frozen=True)
class Task:
    """A held-out prompt (messages + tools/schema) and the answer a correct model gives.

    kind: "tool_call" (expected = {"name", "arguments"}), "json" (expected = the object),
    "sql" (expected = {"sql", "rows"}) or "text" (expected = {"reference"}).
    """

    kind: str
    family: str
    messages: list[dict[str, Any]]
    expected: dict[str, Any]
    tools: list[dict[str, Any]] | None = None
    schema: dict[str, Any] | None = None
    db_schema: str | None = field(default=None)
    tables: dict[str, list[str]] | None = None  # ad-hoc SQL: the client's {table: [columns]} (response_format)


def _tool_subset(rng: random.Random, needed: list[str]) -> list[dict[str, Any]]:
    others = [n for n in TOOLS if n not in needed]
    names = needed + rng.sample(others, rng.choice([0, 1, 1, 2]))
    rng.shuffle(names)
    return [TOOLS[n] for n in names]


def _tool_conversation(kind: str, needed: list[str], make: Callable[[random.Random], list[dict[str, Any]]]):
    def build(rng: random.Random) -> Conversation:
        system = rng.choice(dialogues.TOOL_SYSTEMS)
        head = [{"role": "system", "content": system}] if system else []
        tools = _tool_subset(rng, needed)
        body = make(rng)
        return Conversation(kind, head + body, tools=tools, answer_index=len(head) + 1)
    return build


def _json_conversation(kind: str, make: Callable[[random.Random], tuple[str, dict[str, Any]]], brief: bool = False):
    """A JSON report chat; `brief`: the system turn only names the report, as when a client sends the schema as
    `response_format` (the gateway constrains decoding to it; it is not in the prompt)."""
    def build(rng: random.Random) -> Conversation:
        schema = REPORT_SCHEMAS[kind]
        user, obj = make(rng)
        system = rng.choice(BRIEF_JSON_SYSTEMS).format(report=kind.replace("_", " ")) if brief else \
            JSON_SYSTEM + json.dumps(schema)
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": json.dumps(obj, separators=JSON_SEPARATORS)}]
        return Conversation(kind, messages, schema=schema, answer_index=2)
    return build


def _sql_conversation(rng: random.Random) -> Conversation:
    question, sql = sample_sql_task(rng)
    bare = rng.random() < 0.5  # drawn after the task, so the question and query do not depend on it
    messages = [{"role": "system", "content": (SQL_SYSTEM_BARE if bare else SQL_SYSTEM) + SCHEMA_SQL},
                {"role": "user", "content": question},
                {"role": "assistant", "content": sql if bare else f"```sql\n{sql}\n```"}]
    return Conversation("sql", messages, answer_index=2)


def _adhoc_order(rng: random.Random, names: adhoc.Names = adhoc.NAMES) -> Conversation:
    messages, schema, _ = adhoc.adhoc_order(rng, names)
    return Conversation("adhoc_order", messages, schema=schema, answer_index=len(messages) - 1)


def _adhoc_quote(rng: random.Random, names: adhoc.Names = adhoc.NAMES) -> Conversation:
    messages, tools = adhoc.adhoc_quote(rng, names)
    return Conversation("adhoc_quote", messages, tools=tools, answer_index=len(messages) - 1)


def _adhoc_sql(rng: random.Random, names: adhoc.Names = adhoc.NAMES) -> Conversation:
    messages, tables, _ = adhoc.adhoc_sql(rng, names)
    return Conversation("adhoc_sql", messages, answer_index=len(messages) - 1, tables=tables)


def _prose_conversation(kind: str, make: Callable[[random.Random], tuple[str, str]]):
    def build(rng: random.Random) -> Conversation:
        system = rng.choice(dialogues.PROSE_SYSTEMS)
        head = [{"role": "system", "content": system}] if system else []
        user, answer = make(rng)
        return Conversation(kind, head + [{"role": "user", "content": user},
                                          {"role": "assistant", "content": answer}], answer_index=len(head) + 1)
    return build


# (family, weight, builder)
FAMILIES: tuple[tuple[str, float, Callable[[random.Random], Conversation]], ...] = (
    ("concept", 0.14, _prose_conversation("concept", dialogues.concept_answer)),
    ("market_summary", 0.08, _prose_conversation("market_summary", dialogues.market_summary)),
    ("quote", 0.10, _tool_conversation("quote", ["get_quote"], dialogues.quote_dialogue)),
    ("history", 0.06, _tool_conversation("history", ["get_price_history"], dialogues.history_dialogue)),
    ("positions", 0.07, _tool_conversation("positions", ["get_positions"], dialogues.positions_dialogue)),
    ("order", 0.10, _tool_conversation("order", ["place_order"], dialogues.order_dialogue)),
    ("risk_order", 0.08, _tool_conversation("risk_order", ["check_risk", "place_order"],
                                            dialogues.risk_order_dialogue)),
    ("risk_check", 0.04, _tool_conversation("risk_check", ["check_risk"], dialogues.risk_check_dialogue)),
    ("order_ticket", 0.07, _json_conversation("order_ticket", dialogues.order_ticket_report)),
    ("position_summary", 0.06, _json_conversation("position_summary", dialogues.position_summary_report)),
    ("risk_report", 0.06, _json_conversation("risk_report", dialogues.risk_report)),
    # the same reports asked for by name, with the schema outside the prompt: short chats whose answers still carry
    # every entity, where a from-scratch model learns to read the order side from the user's verb within ~150 steps.
    # Weight 0: not in the default mixture (whose draws they leave unchanged); a curriculum phase asks for them with
    # --boost-family
    ("order_ticket_brief", 0.0, _json_conversation("order_ticket", dialogues.order_ticket_report, brief=True)),
    ("position_summary_brief", 0.0, _json_conversation("position_summary", dialogues.position_summary_report,
                                                        brief=True)),
    ("risk_report_brief", 0.0, _json_conversation("risk_report", dialogues.risk_report, brief=True)),
    ("sql", 0.14, _sql_conversation),
    # requests as API clients write them (evals/demo/adhoc.py): their own order schema as response_format, their own
    # quote tool, SQL over their own small tables. Weight 0 like the brief reports: a later phase boosts them
    ("adhoc_order", 0.0, _adhoc_order),
    ("adhoc_quote", 0.0, _adhoc_quote),
    ("adhoc_sql", 0.0, _adhoc_sql),
)
FAMILY_NAMES = tuple(name for name, _, _ in FAMILIES)


def conversation(split: str, index: int, seed: int = 0, family: str | None = None) -> Conversation:
    """The `index`-th conversation of a split; identical for the same (split, index, seed, family)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    rng = random.Random(f"{split}:{seed}:{index}:{family or ''}")
    if family is None:
        _, _, build = rng.choices(FAMILIES, weights=[w for _, w, _ in FAMILIES])[0]
    else:
        matches = [b for name, _, b in FAMILIES if name == family]
        if not matches:
            raise ValueError(f"unknown family {family!r}; use one of {FAMILY_NAMES}")
        build = matches[0]
    return build(rng)


def conversations(split: str, n: int, seed: int = 0) -> Iterator[Conversation]:
    for i in range(n):
        yield conversation(split, i, seed)


def to_task(conv: Conversation, db: Any | None = None) -> Task:
    """Cut a conversation before its checked assistant turn and record the expected answer."""
    answer = conv.messages[conv.answer_index]
    prompt = conv.messages[:conv.answer_index]
    if answer.get("tool_calls"):
        call = answer["tool_calls"][0]["function"]
        return Task("tool_call", conv.kind, prompt, {"name": call["name"], "arguments": call["arguments"]},
                    tools=conv.tools)
    if conv.tables is not None:
        sql = answer["content"]
        rows = adhoc.query_db(conv.tables, sql).execute(sql).fetchall()
        return Task("sql", conv.kind, prompt, {"sql": sql, "rows": [list(r) for r in rows]}, tables=conv.tables)
    if conv.schema is not None:
        return Task("json", conv.kind, prompt, json.loads(answer["content"]), schema=conv.schema)
    if conv.kind == "sql":
        sql = extract_sql(answer["content"])
        rows = (db or create_trading_db()).execute(sql).fetchall()
        return Task("sql", conv.kind, prompt, {"sql": sql, "rows": [list(r) for r in rows]}, db_schema=SCHEMA_SQL)
    return Task("text", conv.kind, prompt, {"reference": answer["content"]})


def heldout_tasks(n: int, seed: int = 0, kinds: tuple[str, ...] = ("tool_call", "json", "sql"),
                  exclude: frozenset[str] = frozenset()) -> list[Task]:
    """`n` held-out tasks of the given kinds, for constrained-decoding evals.

    `exclude`: rendered conversations to skip, e.g. `rendered_set("train", 8000, (0, 1))` to keep only
    conversations the shipped model never saw verbatim (short SQL and concept chats recur across splits).
    """
    db, tasks, i = create_trading_db(), [], 0
    while len(tasks) < n:
        conv = conversation("heldout", i, seed)
        i += 1
        if exclude and conv.render() in exclude:
            continue
        task = to_task(conv, db)
        if task.kind in kinds:
            tasks.append(task)
    return tasks


def adhoc_heldout_tasks(n: int, names: adhoc.Names = adhoc.HELDOUT_NAMES,
                        exclude: frozenset[str] = frozenset()) -> list[Task]:
    """`n` held-out ad-hoc tasks (orders against a response_format schema, quote calls, SQL over small tables, in
    turn), drawn with `names` (by default with key, tool, table and column names no training chat uses) from a
    stream no training split draws from, skipping any conversation in `exclude`."""
    builders = (_adhoc_order, _adhoc_quote, _adhoc_sql)
    tasks, i = [], 0
    while len(tasks) < n:
        conv = builders[i % len(builders)](random.Random(f"heldout-adhoc:{i}"), names)
        i += 1
        if conv.render() not in exclude:
            tasks.append(to_task(conv))
    return tasks


def rendered_set(split: str, n: int, seeds: tuple[int, ...]) -> frozenset[str]:
    """The rendered text of the first `n` conversations of `split` for each seed (a training set's contents)."""
    return frozenset(c.render() for s in seeds for c in conversations(split, n, s))


_SQL_FENCE = re.compile(r"```sql\n(.*?)\n```", re.DOTALL)
_ASSISTANT = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)


def extract_sql(text: str) -> str:
    """The query of a ```sql block, or the whole text when it is a bare query (starts with SELECT or WITH)."""
    match = _SQL_FENCE.search(text)
    if match is not None:
        return match.group(1)
    if text.lstrip().upper().startswith(("SELECT", "WITH")):
        return text.strip()
    raise ValueError(f"no ```sql block or bare query in {text[:80]!r}")


def wants_fenced_sql(messages: list[dict[str, Any]]) -> bool:
    """Whether a SQL chat's system prompt asks for a ```sql code block (else for a bare query)."""
    return bool(messages) and messages[0]["role"] == "system" and messages[0]["content"].startswith(SQL_SYSTEM)


def assistant_spans(rendered: str) -> list[tuple[int, int]]:
    """Character spans of assistant content (including its closing <|im_end|>) in a rendered chat."""
    return [m.span(1) for m in _ASSISTANT.finditer(rendered)]
