"""Ad-hoc tasks as API clients send them: short orders answered against the client's own JSON schema, quote calls
to the client's own tool definitions, and SQL over the client's own small tables.

The gateway does not print a `response_format` into the prompt (its schema or tables only constrain decoding),
while tools are listed by the chat template; so the JSON and SQL chats here show the model only the user turn
(and, for some SQL chats, the tables in a system turn, as a client may also write them there). Key, tool, table
and column names are drawn from small synonym sets, tickers from the demo's instruments and made-up symbols, and
quantities over magnitudes (1-20, round hundreds and thousands, repeated digits), so the answer's values can only
come from copying the user turn. `NAMES` is what training draws; `HELDOUT_NAMES` adds names no training chat uses.
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
import string
from dataclasses import dataclass
from typing import Any

from evals.demo.trading_db import ACCOUNT_CODES, INSTRUMENTS, price_path
from gateway.structured.sql_schema import tables_prompt

JSON_SEPARATORS = (",", ":")
CLIENT_SYSTEMS = (None, None, None, "You are a trading assistant.", "Answer briefly.",
                  "You help a trader with orders and market data.")


@dataclass(frozen=True)
class Names:
    """Synonym sets the ad-hoc schemas, tools and tables draw their names from."""

    symbol_keys: tuple[str, ...] = ("symbol", "ticker", "sym")
    qty_keys: tuple[str, ...] = ("qty", "quantity", "shares", "size")
    side_keys: tuple[str, ...] = ("side", "action")
    account_keys: tuple[str, ...] = ("account", "account_id")
    price_keys: tuple[str, ...] = ("limit_price", "price")
    quote_tools: tuple[str, ...] = ("get_quote", "quote", "get_price", "lookup_quote", "fetch_price", "last_price")
    other_tools: tuple[str, ...] = ("get_news", "place_order", "get_history", "get_positions")
    price_tables: tuple[str, ...] = ("prices", "quotes", "price_history", "ticks", "daily_prices", "bars")
    time_columns: tuple[str, ...] = ("ts", "dt", "trade_date", "quote_time")
    price_columns: tuple[str, ...] = ("price", "close", "last_price", "px")


NAMES = Names()
# every synonym above plus names that no training chat uses, to check that the families generalise
HELDOUT_NAMES = Names(
    symbol_keys=NAMES.symbol_keys + ("instrument", "asset"), qty_keys=NAMES.qty_keys + ("units", "amount"),
    quote_tools=("price_check", "get_last_trade"), price_tables=("market_data", "trade_prices"),
    time_columns=("as_of", "traded_at"), price_columns=("trade_px", "mid"))


def ticker(rng: random.Random) -> str:
    """A demo instrument's symbol or a made-up one of 1-5 capitals."""
    if rng.random() < 0.6:
        return rng.choice(INSTRUMENTS).symbol
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.choice([1, 2, 3, 3, 4, 4, 4, 5])))


def quantity(rng: random.Random) -> int:
    """An order size over magnitudes: small counts, any size up to 999, round sizes and repeated digits."""
    r = rng.random()
    if r < 0.35:
        return rng.randint(1, 20)
    if r < 0.5:
        return rng.randint(21, 999)
    if r < 0.75:
        return rng.choice([1, 2, 3, 5, 10, 15, 25, 50]) * 10 ** rng.randint(1, 3)
    d, n = str(rng.randint(1, 9)), rng.randint(2, 4)
    return int(rng.choice([d * n, d + "0" * n, d * 2 + "0" * (n - 1), d + "0" + d]))


def _price(symbol: str, rng: random.Random) -> float:
    inst = next((i for i in INSTRUMENTS if i.symbol == symbol), None)
    base = price_path(symbol)[-1] if inst else rng.uniform(5, 600)
    return round(base * rng.uniform(0.97, 1.03), 2)


# ---- JSON orders against a response_format schema ---------------------------------------------------
def order_schema(rng: random.Random, names: Names = NAMES) -> tuple[dict[str, Any], dict[str, str]]:
    """An ad-hoc order schema and the role of each of its keys ("symbol", "qty", "side", "account", "price")."""
    sym, qty = rng.choice(names.symbol_keys), rng.choice(names.qty_keys)
    roles = {sym: "symbol", qty: "qty"} if rng.random() < 0.75 else {qty: "qty", sym: "symbol"}
    if rng.random() < 0.4:
        roles[rng.choice(names.side_keys)] = "side"
    if rng.random() < 0.15:
        roles[rng.choice(names.account_keys)] = "account"
    if rng.random() < 0.25:
        roles[rng.choice(names.price_keys)] = "price"
    quantity_schema: dict[str, Any] = {"type": "integer", "minimum": 1}
    if rng.random() < 0.2:
        quantity_schema["maximum"] = 100_000
    kinds = {"symbol": {"type": "string"}, "qty": quantity_schema,
             "side": {"type": "string", "enum": ["buy", "sell"]}, "account": {"type": "string"},
             "price": {"type": "number"}}
    required = [k for k, role in roles.items() if role != "price" and (role != "account" or rng.random() < 0.5)]
    schema: dict[str, Any] = {"type": "object", "properties": {k: kinds[role] for k, role in roles.items()},
                              "required": required}
    if rng.random() < 0.85:
        schema["additionalProperties"] = False
    return schema, roles


def adhoc_order(rng: random.Random, names: Names = NAMES) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """(messages, schema, compact JSON answer) of a short imperative order."""
    schema, roles = order_schema(rng, names)
    sym, qty, side = ticker(rng), quantity(rng), rng.choice(["buy", "sell"])
    verb = rng.choice([side.capitalize(), side.capitalize(), side])
    account = rng.choice(ACCOUNT_CODES) if "account" in roles.values() and rng.random() < 0.8 else None
    price = _price(sym, rng) if "price" in roles.values() and rng.random() < 0.7 else None
    user = rng.choice([f"{verb} {qty} {sym}", f"{verb} {qty} {sym}", f"{verb} {qty} shares of {sym}",
                       f"{verb} {sym}, {qty} shares", f"Please {side} {qty} {sym}"])
    if price is not None:
        user += rng.choice([f" at {price:.2f}", f" limit {price:.2f}"])
    if account is not None:
        user += rng.choice([f" for {account}", f" in {account}"])
    user += rng.choice(["", "", "."])
    values = {"symbol": sym, "qty": qty, "side": side, "account": account, "price": price}
    answer = {k: values[role] for k, role in roles.items() if values[role] is not None}
    missing = [k for k in schema["required"] if k not in answer]
    if missing:  # a required account the user did not give: the schema drops it from required
        schema["required"] = [k for k in schema["required"] if k not in missing]
    system = rng.choice(CLIENT_SYSTEMS)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": json.dumps(answer, separators=JSON_SEPARATORS)}]
    return messages, schema, answer


# ---- quote calls to the client's own tool definitions ----------------------------------------------
def _function(name: str, description: str | None, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if description:
        fn["description"] = description
    fn["parameters"] = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": fn}


def quote_tools(rng: random.Random, names: Names = NAMES) -> tuple[list[dict[str, Any]], str, str]:
    """Ad-hoc tool definitions with one quote tool among 0-2 others -> (tools, quote tool name, its argument)."""
    name, key = rng.choice(names.quote_tools), rng.choice(names.symbol_keys)
    param: dict[str, Any] = rng.choice([{"type": "string"}, {"type": "string"},
                                        {"type": "string", "description": "ticker symbol"}])
    description = rng.choice([None, None, "Get the latest quote for a symbol.", "Latest price of a stock."])
    tools = [_function(name, description, {key: param}, [key])]
    others = {"get_news": ({key: {"type": "string"}}, [key]),
              "place_order": ({key: {"type": "string"}, "qty": {"type": "integer"}}, [key, "qty"]),
              "get_history": ({key: {"type": "string"}, "days": {"type": "integer"}}, [key, "days"]),
              "get_positions": ({"account": {"type": "string"}}, ["account"])}
    for other in rng.sample([n for n in names.other_tools if n != name], rng.choice([0, 0, 1, 2])):
        tools.append(_function(other, None, *others[other]))
    rng.shuffle(tools)
    return tools, name, key


def adhoc_quote(rng: random.Random, names: Names = NAMES) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages ending in the quote call, tools)."""
    tools, name, key = quote_tools(rng, names)
    sym = ticker(rng)
    user = rng.choice([f"Quote {sym}", f"quote {sym}", f"{sym} quote", f"Price of {sym}?", f"What's {sym} at?",
                       f"Latest {sym} price", f"How much is {sym}?", f"Get a quote for {sym}."])
    system = rng.choice(CLIENT_SYSTEMS)
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {key: sym}}}]}
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}, call], \
        tools


# ---- SQL over the client's own small tables ---------------------------------------------------------
def price_table(rng: random.Random, names: Names = NAMES) -> tuple[dict[str, list[str]], dict[str, str]]:
    """{table: [columns]} with one price table (and maybe a trades table) -> (tables, role -> name)."""
    table = rng.choice(names.price_tables)
    role = {"table": table, "symbol": rng.choice(names.symbol_keys), "time": rng.choice(names.time_columns),
            "price": rng.choice(names.price_columns)}
    columns = [role["symbol"], role["time"], role["price"]]
    if rng.random() < 0.4:
        columns.append("volume")
        role["volume"] = "volume"
    if rng.random() < 0.2:
        columns.insert(0, "id")
    tables = {table: columns}
    if rng.random() < 0.25:
        tables["trades"] = ["id", role["symbol"], "qty", role["price"], role["time"]]
    return tables, role


def sql_question(rng: random.Random, role: dict[str, str], sym: str) -> tuple[str, str]:
    """(question, query) over the price table described by `role`."""
    t, k, ts, p = role["table"], role["symbol"], role["time"], role["price"]
    where = f"WHERE {k} = '{sym}'"
    level = rng.choice([10, 50, 100, 150, 200, 250, 400])
    cases = [
        (rng.choice([f"Last {sym} price", f"Latest {sym} price", f"Most recent {sym} price",
                     f"What did {sym} last trade at?", f"Current price of {sym}", f"last price for {sym}"]),
         f"SELECT {p} FROM {t} {where} ORDER BY {ts} DESC LIMIT 1;"),
        (rng.choice([f"First {sym} price", f"Earliest {sym} price"]),
         f"SELECT {p} FROM {t} {where} ORDER BY {ts} ASC LIMIT 1;"),
        (rng.choice([f"Average {sym} price", f"Mean price of {sym}", f"average price for {sym}"]),
         f"SELECT AVG({p}) FROM {t} {where};"),
        (rng.choice([f"Highest {sym} price", f"Max {sym} price"]), f"SELECT MAX({p}) FROM {t} {where};"),
        (rng.choice([f"Lowest {sym} price", f"Min {sym} price"]), f"SELECT MIN({p}) FROM {t} {where};"),
        (rng.choice([f"{sym} prices above {level}", f"When was {sym} above {level}?"]),
         f"SELECT {ts}, {p} FROM {t} {where} AND {p} > {level} ORDER BY {ts};"),
        (rng.choice([f"{sym} prices below {level}", f"When was {sym} under {level}?"]),
         f"SELECT {ts}, {p} FROM {t} {where} AND {p} < {level} ORDER BY {ts};"),
        (rng.choice([f"How many {sym} prices are there?", f"Count the {sym} rows"]),
         f"SELECT COUNT(*) FROM {t} {where};"),
        (rng.choice(["Average price per ticker", "Average price by symbol"]),
         f"SELECT {k}, AVG({p}) FROM {t} GROUP BY {k} ORDER BY {k};"),
        (rng.choice([f"Last 5 {sym} prices", f"Five most recent {sym} prices"]),
         f"SELECT {ts}, {p} FROM {t} {where} ORDER BY {ts} DESC LIMIT 5;"),
    ]
    weights = [4, 1, 2, 1, 1, 1, 1, 1, 1, 1]
    if "volume" in role:
        cases.append((rng.choice([f"Total {sym} volume", f"How much {sym} traded?"]),
                      f"SELECT SUM(volume) FROM {t} {where};"))
        weights.append(1)
    return rng.choices(cases, weights=weights)[0]


def adhoc_sql(rng: random.Random, names: Names = NAMES) -> tuple[list[dict[str, Any]], dict[str, list[str]], str]:
    """(messages, tables, query): a question over ad-hoc tables, answered with a bare query."""
    tables, role = price_table(rng, names)
    sym = ticker(rng)
    question, query = sql_question(rng, role, sym)
    head = []
    if rng.random() < 0.4:  # the tables in a system turn, as a client may write them
        listed = "; ".join(f"{t}({', '.join(cols)})" for t, cols in tables.items())
        head = [{"role": "system", "content": rng.choice([tables_prompt(tables),  # what the gateway writes
                                                          f"Write SQL over: {listed}"])}]
    elif (system := rng.choice(CLIENT_SYSTEMS)) is not None:
        head = [{"role": "system", "content": system}]
    return head + [{"role": "user", "content": question}, {"role": "assistant", "content": query}], tables, query


def sample_db(tables: dict[str, list[str]], symbols: list[str], seed: int = 0) -> sqlite3.Connection:
    """An in-memory SQLite database with the given tables and a few rows per symbol (text, real or integer
    columns by name), to run the ad-hoc queries on."""
    rng = random.Random(seed)
    db = sqlite3.connect(":memory:")
    for table, columns in tables.items():
        db.execute(f"CREATE TABLE {table} ({', '.join(columns)})")
        rows = []
        for i, sym in enumerate(symbols * 3):
            day = f"2026-01-{1 + i:02d}"
            base = 20.0 + 37.0 * (1 + symbols.index(sym))
            by_name = {"id": i + 1, "volume": rng.randint(100, 9000), "qty": rng.randint(1, 500)}
            row = [by_name.get(c, sym if c in NAMES.symbol_keys + HELDOUT_NAMES.symbol_keys else
                               day if c in NAMES.time_columns + HELDOUT_NAMES.time_columns else
                               round(base * rng.uniform(0.9, 1.1), 2)) for c in columns]
            rows.append(row)
        db.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' for _ in columns)})", rows)
    return db


def query_db(tables: dict[str, list[str]], query: str) -> sqlite3.Connection:
    """`sample_db` with rows for every symbol the query names (and one it does not), to check a query's result."""
    return sample_db(tables, sorted(set(re.findall(r"'([A-Z]{1,5})'", query)) | {"ZZZ"}))
