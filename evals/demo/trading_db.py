"""A small, seeded trading database (SQLite, in memory) and the market universe the corpus draws on."""

from __future__ import annotations

import datetime as dt
import random
import sqlite3
from dataclasses import dataclass


@dataclass(frozen=True)
class Instrument:
    symbol: str
    name: str
    sector: str
    currency: str
    base_price: float


INSTRUMENTS: tuple[Instrument, ...] = (
    Instrument("AAPL", "Apple Inc.", "Technology", "USD", 188.0),
    Instrument("MSFT", "Microsoft Corp.", "Technology", "USD", 412.0),
    Instrument("NVDA", "NVIDIA Corp.", "Technology", "USD", 121.0),
    Instrument("GOOGL", "Alphabet Inc.", "Communication", "USD", 168.0),
    Instrument("META", "Meta Platforms Inc.", "Communication", "USD", 505.0),
    Instrument("AMZN", "Amazon.com Inc.", "Consumer", "USD", 182.0),
    Instrument("TSLA", "Tesla Inc.", "Consumer", "USD", 245.0),
    Instrument("NKE", "Nike Inc.", "Consumer", "USD", 88.0),
    Instrument("JPM", "JPMorgan Chase & Co.", "Financials", "USD", 205.0),
    Instrument("GS", "Goldman Sachs Group", "Financials", "USD", 470.0),
    Instrument("BAC", "Bank of America Corp.", "Financials", "USD", 39.0),
    Instrument("V", "Visa Inc.", "Financials", "USD", 275.0),
    Instrument("XOM", "Exxon Mobil Corp.", "Energy", "USD", 117.0),
    Instrument("CVX", "Chevron Corp.", "Energy", "USD", 156.0),
    Instrument("JNJ", "Johnson & Johnson", "Healthcare", "USD", 158.0),
    Instrument("PFE", "Pfizer Inc.", "Healthcare", "USD", 29.0),
    Instrument("UNH", "UnitedHealth Group", "Healthcare", "USD", 560.0),
    Instrument("KO", "Coca-Cola Co.", "Staples", "USD", 68.0),
    Instrument("PG", "Procter & Gamble Co.", "Staples", "USD", 167.0),
    Instrument("WMT", "Walmart Inc.", "Staples", "USD", 80.0),
    Instrument("CAT", "Caterpillar Inc.", "Industrials", "USD", 360.0),
    Instrument("BA", "Boeing Co.", "Industrials", "USD", 172.0),
    Instrument("SAP", "SAP SE", "Technology", "EUR", 205.0),
    Instrument("ASML", "ASML Holding", "Technology", "EUR", 690.0),
    Instrument("SIE", "Siemens AG", "Industrials", "EUR", 178.0),
    Instrument("HSBA", "HSBC Holdings", "Financials", "GBP", 7.1),
    Instrument("SHEL", "Shell plc", "Energy", "GBP", 27.0),
    Instrument("SPY", "SPDR S&P 500 ETF", "Index", "USD", 570.0),
    Instrument("QQQ", "Invesco QQQ Trust", "Index", "USD", 490.0),
    Instrument("TLT", "iShares 20+ Year Treasury ETF", "Rates", "USD", 94.0),
)
BY_SYMBOL = {inst.symbol: inst for inst in INSTRUMENTS}
SECTORS = tuple(sorted({inst.sector for inst in INSTRUMENTS}))

ACCOUNT_NAMES = (
    "Global Growth Fund", "Income Portfolio", "Tech Momentum", "Balanced Reserve", "Energy Opportunities",
    "Defensive Equity", "Macro Hedge", "Client Discretionary", "Pension Core", "Treasury Desk",
    "Value Select", "Quant Alpha",
)
ACCOUNT_CODES = tuple(f"ACC-{1001 + i}" for i in range(len(ACCOUNT_NAMES)))
TRADING_DAYS = tuple(
    d.isoformat() for d in (dt.date(2026, 10, 1) + dt.timedelta(days=i) for i in range(42)) if d.weekday() < 5
)
ORDER_STATUSES = ("open", "filled", "cancelled", "rejected")

SCHEMA_SQL = """\
CREATE TABLE instruments (
  id INTEGER PRIMARY KEY,
  symbol TEXT NOT NULL UNIQUE,
  name TEXT NOT NULL,
  sector TEXT NOT NULL,
  currency TEXT NOT NULL
);
CREATE TABLE prices (
  instrument_id INTEGER NOT NULL REFERENCES instruments(id),
  date TEXT NOT NULL,
  open REAL NOT NULL,
  high REAL NOT NULL,
  low REAL NOT NULL,
  close REAL NOT NULL,
  volume INTEGER NOT NULL,
  PRIMARY KEY (instrument_id, date)
);
CREATE TABLE accounts (
  id INTEGER PRIMARY KEY,
  code TEXT NOT NULL UNIQUE,
  name TEXT NOT NULL,
  base_currency TEXT NOT NULL,
  cash_balance REAL NOT NULL,
  risk_limit REAL NOT NULL
);
CREATE TABLE positions (
  account_id INTEGER NOT NULL REFERENCES accounts(id),
  instrument_id INTEGER NOT NULL REFERENCES instruments(id),
  quantity INTEGER NOT NULL,
  avg_cost REAL NOT NULL,
  PRIMARY KEY (account_id, instrument_id)
);
CREATE TABLE orders (
  id INTEGER PRIMARY KEY,
  account_id INTEGER NOT NULL REFERENCES accounts(id),
  instrument_id INTEGER NOT NULL REFERENCES instruments(id),
  side TEXT NOT NULL CHECK (side IN ('buy', 'sell')),
  quantity INTEGER NOT NULL,
  order_type TEXT NOT NULL CHECK (order_type IN ('market', 'limit')),
  limit_price REAL,
  status TEXT NOT NULL,
  created_at TEXT NOT NULL
);
CREATE TABLE trades (
  id INTEGER PRIMARY KEY,
  order_id INTEGER NOT NULL REFERENCES orders(id),
  price REAL NOT NULL,
  quantity INTEGER NOT NULL,
  executed_at TEXT NOT NULL
);
"""


def price_path(symbol: str, seed: int = 0) -> list[float]:
    """Seeded daily closes for `symbol` over TRADING_DAYS (a gentle random walk)."""
    rng = random.Random(f"prices:{seed}:{symbol}")
    price, closes = BY_SYMBOL[symbol].base_price, []
    for _ in TRADING_DAYS:
        price *= 1.0 + rng.gauss(0.0005, 0.015)
        closes.append(round(price, 2))
    return closes


def create_trading_db(seed: int = 0) -> sqlite3.Connection:
    """Build the in-memory trading database; the same seed gives the same rows."""
    rng = random.Random(f"tradingdb:{seed}")
    conn = sqlite3.connect(":memory:")
    conn.executescript(SCHEMA_SQL)
    for iid, inst in enumerate(INSTRUMENTS, start=1):
        conn.execute("INSERT INTO instruments VALUES (?, ?, ?, ?, ?)",
                     (iid, inst.symbol, inst.name, inst.sector, inst.currency))
        for day, close in zip(TRADING_DAYS, price_path(inst.symbol, seed), strict=True):
            open_ = round(close * (1 + rng.gauss(0, 0.006)), 2)
            high = round(max(open_, close) * (1 + abs(rng.gauss(0, 0.005))), 2)
            low = round(min(open_, close) * (1 - abs(rng.gauss(0, 0.005))), 2)
            conn.execute("INSERT INTO prices VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (iid, day, open_, high, low, close, rng.randint(200_000, 9_000_000)))
    for aid, (code, name) in enumerate(zip(ACCOUNT_CODES, ACCOUNT_NAMES, strict=True), start=1):
        currency = "EUR" if aid % 5 == 0 else "USD"
        conn.execute("INSERT INTO accounts VALUES (?, ?, ?, ?, ?, ?)",
                     (aid, code, name, currency, round(rng.uniform(50_000, 2_000_000), 2),
                      float(rng.choice([250_000, 500_000, 1_000_000, 2_000_000]))))
        for iid in sorted(rng.sample(range(1, len(INSTRUMENTS) + 1), rng.randint(3, 8))):
            base = INSTRUMENTS[iid - 1].base_price
            conn.execute("INSERT INTO positions VALUES (?, ?, ?, ?)",
                         (aid, iid, rng.choice([-1, 1, 1, 1]) * rng.randint(1, 60) * 10,
                          round(base * rng.uniform(0.8, 1.1), 2)))
    trade_id = 0
    for oid in range(1, 241):
        iid = rng.randint(1, len(INSTRUMENTS))
        day_index = rng.randrange(len(TRADING_DAYS))
        close = price_path(INSTRUMENTS[iid - 1].symbol, seed)[day_index]
        order_type = rng.choice(["market", "limit"])
        limit = round(close * rng.uniform(0.97, 1.03), 2) if order_type == "limit" else None
        status = rng.choices(ORDER_STATUSES, weights=[3, 6, 2, 1])[0]
        quantity = rng.randint(1, 50) * 10
        created = f"{TRADING_DAYS[day_index]} {rng.randint(9, 15):02d}:{rng.randint(0, 59):02d}:00"
        conn.execute("INSERT INTO orders VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     (oid, rng.randint(1, len(ACCOUNT_CODES)), iid, rng.choice(["buy", "sell"]),
                      quantity, order_type, limit, status, created))
        if status == "filled":
            for part in _split_fill(rng, quantity):
                trade_id += 1
                conn.execute("INSERT INTO trades VALUES (?, ?, ?, ?, ?)",
                             (trade_id, oid, round(limit or close * rng.uniform(0.998, 1.002), 2), part,
                              created))
    conn.commit()
    return conn


def _split_fill(rng: random.Random, quantity: int) -> list[int]:
    if quantity < 20 or rng.random() < 0.6:
        return [quantity]
    first = rng.randint(1, quantity // 10 - 1) * 10
    return [first, quantity - first]
