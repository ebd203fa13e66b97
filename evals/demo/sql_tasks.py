"""Parametrised natural-language questions over the trading database with their SQLite answers."""

from __future__ import annotations

import random
from collections.abc import Callable

from evals.demo.trading_db import ACCOUNT_CODES, INSTRUMENTS, ORDER_STATUSES, SECTORS, TRADING_DAYS

_J_INST = "JOIN instruments i ON i.id = p.instrument_id"
_J_ACC = "JOIN accounts a ON a.id = p.account_id"
SqlTask = tuple[str, str]  # (question, sql)


def _sym(rng: random.Random) -> str:
    return rng.choice(INSTRUMENTS).symbol


def _day_range(rng: random.Random) -> tuple[str, str]:
    i = rng.randrange(len(TRADING_DAYS) - 5)
    return TRADING_DAYS[i], TRADING_DAYS[i + rng.randint(3, 5)]


def _close_on(rng: random.Random) -> SqlTask:
    s, d = _sym(rng), rng.choice(TRADING_DAYS)
    q = rng.choice([f"What was the closing price of {s} on {d}?", f"Give me the {d} close for {s}.",
                    f"Where did {s} close on {d}?"])
    return q, (f"SELECT p.close FROM prices p {_J_INST} WHERE i.symbol = '{s}' AND p.date = '{d}';")


def _positions_of(rng: random.Random) -> SqlTask:
    a = rng.choice(ACCOUNT_CODES)
    q = rng.choice([f"List all positions in account {a}.", f"What does {a} hold?",
                    f"Show the holdings of {a} with quantity and average cost."])
    return q, (f"SELECT i.symbol, p.quantity, p.avg_cost FROM positions p {_J_INST} {_J_ACC} "
               f"WHERE a.code = '{a}' ORDER BY i.symbol;")


def _order_count(rng: random.Random) -> SqlTask:
    a, st = rng.choice(ACCOUNT_CODES), rng.choice(ORDER_STATUSES)
    q = rng.choice([f"How many {st} orders does {a} have?", f"Count the {st} orders for account {a}."])
    return q, (f"SELECT COUNT(*) FROM orders o JOIN accounts a ON a.id = o.account_id "
               f"WHERE a.code = '{a}' AND o.status = '{st}';")


def _sector_members(rng: random.Random) -> SqlTask:
    sec = rng.choice(SECTORS)
    q = rng.choice([f"Which instruments are in the {sec} sector?", f"List the {sec} names we cover."])
    return q, f"SELECT symbol, name FROM instruments WHERE sector = '{sec}' ORDER BY symbol;"


def _avg_close(rng: random.Random) -> SqlTask:
    s, (d0, d1) = _sym(rng), _day_range(rng)
    q = rng.choice([f"What was the average close of {s} between {d0} and {d1}?",
                    f"Average closing price for {s} from {d0} to {d1}?"])
    return q, (f"SELECT AVG(p.close) FROM prices p {_J_INST} WHERE i.symbol = '{s}' "
               f"AND p.date BETWEEN '{d0}' AND '{d1}';")


def _high_low(rng: random.Random) -> SqlTask:
    s = _sym(rng)
    fn, word = rng.choice([("MAX", "highest"), ("MIN", "lowest")])
    q = rng.choice([f"What was the {word} close for {s}?", f"Find the {word} closing price of {s} in the data."])
    return q, f"SELECT {fn}(p.close) FROM prices p {_J_INST} WHERE i.symbol = '{s}';"


def _traded_quantity(rng: random.Random) -> SqlTask:
    s = _sym(rng)
    q = rng.choice([f"How many shares of {s} have been traded in total?", f"Total executed quantity in {s}?"])
    return q, ("SELECT COALESCE(SUM(t.quantity), 0) FROM trades t JOIN orders o ON o.id = t.order_id "
               f"JOIN instruments i ON i.id = o.instrument_id WHERE i.symbol = '{s}';")


def _top_cash(rng: random.Random) -> SqlTask:
    n = rng.randint(2, 5)
    q = rng.choice([f"Which {n} accounts have the most cash?", f"Top {n} accounts by cash balance."])
    return q, f"SELECT code, name, cash_balance FROM accounts ORDER BY cash_balance DESC LIMIT {n};"


def _orders_by_status(rng: random.Random) -> SqlTask:
    s, st = _sym(rng), rng.choice(ORDER_STATUSES)
    q = rng.choice([f"Show the {st} orders in {s}.", f"List {st} {s} orders with account, side and quantity."])
    return q, ("SELECT o.id, a.code, o.side, o.quantity FROM orders o JOIN accounts a ON a.id = o.account_id "
               f"JOIN instruments i ON i.id = o.instrument_id WHERE i.symbol = '{s}' AND o.status = '{st}' "
               "ORDER BY o.id;")


def _market_value(rng: random.Random) -> SqlTask:
    a = rng.choice(ACCOUNT_CODES)
    q = rng.choice([f"What is the market value of each position in {a} at the latest close?",
                    f"Value the positions of {a} using the last closing prices."])
    return q, (f"SELECT i.symbol, p.quantity * pr.close AS market_value FROM positions p {_J_INST} {_J_ACC} "
               "JOIN prices pr ON pr.instrument_id = p.instrument_id "
               f"AND pr.date = (SELECT MAX(date) FROM prices) WHERE a.code = '{a}' ORDER BY market_value DESC;")


def _trades_on(rng: random.Random) -> SqlTask:
    d = rng.choice(TRADING_DAYS)
    q = rng.choice([f"How many trades were executed on {d}?", f"Number of fills on {d}?"])
    return q, f"SELECT COUNT(*) FROM trades WHERE date(executed_at) = '{d}';"


def _holders_of(rng: random.Random) -> SqlTask:
    s = _sym(rng)
    q = rng.choice([f"Which accounts hold {s}?", f"Who has a position in {s}, largest first?"])
    return q, (f"SELECT a.code, p.quantity FROM positions p {_J_ACC} {_J_INST} WHERE i.symbol = '{s}' "
               "ORDER BY p.quantity DESC;")


def _side_breakdown(rng: random.Random) -> SqlTask:
    a = rng.choice(ACCOUNT_CODES)
    q = rng.choice([f"How many buy and sell orders has {a} sent?", f"Break down {a}'s orders by side."])
    return q, ("SELECT o.side, COUNT(*) FROM orders o JOIN accounts a ON a.id = o.account_id "
               f"WHERE a.code = '{a}' GROUP BY o.side ORDER BY o.side;")


def _short_positions(rng: random.Random) -> SqlTask:
    q = rng.choice(["Which accounts have short positions?", "List all short positions across accounts."])
    return q, (f"SELECT a.code, i.symbol, p.quantity FROM positions p {_J_ACC} {_J_INST} "
               "WHERE p.quantity < 0 ORDER BY a.code, i.symbol;")


SQL_TEMPLATES: tuple[Callable[[random.Random], SqlTask], ...] = (
    _close_on, _positions_of, _order_count, _sector_members, _avg_close, _high_low, _traded_quantity,
    _top_cash, _orders_by_status, _market_value, _trades_on, _holders_of, _side_breakdown, _short_positions,
)


def sample_sql_task(rng: random.Random) -> SqlTask:
    """One (question, SQLite query) pair drawn from the templates."""
    return rng.choice(SQL_TEMPLATES)(rng)
