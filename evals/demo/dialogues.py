"""Per-family dialogue builders: user phrasings, tool calls with consistent results, reports and prose answers."""

from __future__ import annotations

import json
import random
from typing import Any

from evals.demo.prose import TOPICS
from evals.demo.schemas import risk_level
from evals.demo.trading_db import ACCOUNT_CODES, BY_SYMBOL, INSTRUMENTS, Instrument, price_path

TOOL_SYSTEMS = (
    None, "You are a trading assistant for the desk. Use the tools to look up data and act on orders.",
    "You help portfolio managers with quotes, positions and orders. Call a tool whenever live data is needed.",
    "You are an execution assistant. Always run the risk check when asked, and never invent prices.",
)
PROSE_SYSTEMS = (
    None, "You are a helpful markets analyst. Answer clearly and briefly.",
    "You explain finance to traders and portfolio managers in plain language.",
)
Messages = list[dict[str, Any]]


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def _tool(content: dict[str, Any]) -> dict[str, Any]:
    return {"role": "tool", "content": json.dumps(content)}


def _say(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def _inst(rng: random.Random) -> Instrument:
    return rng.choice(INSTRUMENTS)


def _price(inst: Instrument, rng: random.Random) -> float:
    return round(price_path(inst.symbol)[-1] * (1 + rng.gauss(0, 0.01)), 2)


def _money(x: float) -> str:
    return f"{x:,.2f}"


# ---- prose ---------------------------------------------------------------------------------------

def concept_answer(rng: random.Random) -> tuple[str, str]:
    topic = rng.choice(TOPICS)
    prefix = rng.choice(["", "", "Quick question: ", "I'm new to trading. ", "Can you help? "])
    points = sorted(rng.sample(range(len(topic.points)), rng.randint(2, 3)))
    return prefix + rng.choice(topic.questions), " ".join([topic.opening] + [topic.points[i] for i in points])


def market_summary(rng: random.Random) -> tuple[str, str]:
    insts = rng.sample(INSTRUMENTS, rng.randint(4, 6))
    moves = [(i, _price(i, rng), round(rng.gauss(0.1, 1.6), 1)) for i in insts]
    lines = "\n".join(f"- {i.symbol} {p:.2f} ({c:+.1f}%)" for i, p, c in moves)
    ask = rng.choice(["Give me a short market summary.", "Summarise today's session.", "How did the market do?"])
    up = sum(1 for _, _, c in moves if c > 0)
    best = max(moves, key=lambda m: m[2])
    worst = min(moves, key=lambda m: m[2])
    tone = "a positive" if up > len(moves) / 2 else "a negative" if up < len(moves) / 2 else "a mixed"
    text = (f"It was {tone} session: {up} of {len(moves)} names rose. The best performer was {best[0].symbol}, "
            f"{best[2]:+.1f}% at {best[1]:.2f}, and the weakest was {worst[0].symbol}, {worst[2]:+.1f}% at "
            f"{worst[1]:.2f}.")
    if abs(worst[2]) >= 2 or abs(best[2]) >= 2:
        big = best if abs(best[2]) >= abs(worst[2]) else worst
        text += (f" The {abs(big[2]):.1f}% move in {big[0].symbol} stands out; watch the {big[0].sector} "
                 "sector for follow-through.")
    else:
        text += " Moves were modest overall, with no sign of broad stress."
    return f"Here are today's moves:\n{lines}\n{ask}", text


# ---- tool calls ----------------------------------------------------------------------------------

def quote_dialogue(rng: random.Random) -> Messages:
    inst = _inst(rng)
    user = rng.choice([f"What's {inst.symbol} trading at?", f"Get me a quote for {inst.symbol}.",
                       f"price of {inst.name}?", f"Where is {inst.symbol} right now?",
                       f"How is {inst.name} ({inst.symbol}) doing today?"])
    price, change = _price(inst, rng), round(rng.gauss(0.1, 1.5), 2)
    half = max(0.01, round(price * 0.0002, 2))
    result = {"symbol": inst.symbol, "price": price, "change_pct": change, "bid": round(price - half, 2),
              "ask": round(price + half, 2), "currency": inst.currency}
    direction = "up" if change >= 0 else "down"
    answer = (f"{inst.symbol} ({inst.name}) is trading at {price:.2f} {inst.currency}, {direction} "
              f"{abs(change):.2f}% on the day. The bid is {result['bid']:.2f} and the ask is {result['ask']:.2f}.")
    return [{"role": "user", "content": user}, _call("get_quote", {"symbol": inst.symbol}), _tool(result),
            _say(answer)]


def history_dialogue(rng: random.Random) -> Messages:
    inst, days = _inst(rng), rng.randint(3, 10)
    user = rng.choice([f"How has {inst.symbol} done over the last {days} days?",
                       f"Show me the last {days} closes for {inst.symbol}.",
                       f"{inst.symbol} price history, {days} sessions please."])
    closes = price_path(inst.symbol, seed=rng.randint(1, 10_000))[-days:]
    change = (closes[-1] / closes[0] - 1) * 100
    answer = (f"Over the last {days} sessions {inst.symbol} moved from {closes[0]:.2f} to {closes[-1]:.2f}, "
              f"a {abs(change):.1f}% {'gain' if change >= 0 else 'loss'}. The highest close was {max(closes):.2f} "
              f"and the lowest was {min(closes):.2f}.")
    return [{"role": "user", "content": user}, _call("get_price_history", {"symbol": inst.symbol, "days": days}),
            _tool({"symbol": inst.symbol, "closes": closes}), _say(answer)]


def _random_positions(rng: random.Random) -> list[dict[str, Any]]:
    insts = sorted(rng.sample(INSTRUMENTS, rng.randint(1, 5)), key=lambda i: i.symbol)
    return [{"symbol": i.symbol, "quantity": rng.choice([-1, 1, 1, 1]) * rng.randint(1, 60) * 10,
             "avg_cost": round(i.base_price * rng.uniform(0.8, 1.1), 2)} for i in insts]


def _largest(positions: list[dict[str, Any]]) -> str:
    return max(positions, key=lambda p: (abs(p["quantity"]), p["symbol"]))["symbol"]


def positions_dialogue(rng: random.Random) -> Messages:
    acc = rng.choice(ACCOUNT_CODES)
    user = rng.choice([f"Show me the positions in {acc}.", f"What does {acc} hold?",
                       f"list positions for account {acc}", f"Pull up the book for {acc}."])
    positions = _random_positions(rng)
    parts = [f"{p['quantity']} {p['symbol']}" + (" (short)" if p["quantity"] < 0 else "") +
             f" at an average cost of {p['avg_cost']:.2f}" for p in positions]
    answer = (f"{acc} holds {len(positions)} position{'s' if len(positions) > 1 else ''}: {'; '.join(parts)}. "
              f"The largest by quantity is {_largest(positions)}.")
    return [{"role": "user", "content": user}, _call("get_positions", {"account_id": acc}),
            _tool({"account_id": acc, "positions": positions}), _say(answer)]


def _order_request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A trader's instruction and the place_order arguments it means."""
    inst, acc = _inst(rng), rng.choice(ACCOUNT_CODES)
    side, qty = rng.choice(["buy", "sell"]), rng.randint(1, 100) * rng.choice([1, 5, 10])
    args: dict[str, Any] = {"account_id": acc, "symbol": inst.symbol, "side": side, "quantity": qty}
    verb = side if rng.random() < 0.7 else side.capitalize()
    if rng.random() < 0.5:
        args["order_type"] = "market"
        price_text = rng.choice([" at market", " at the market", ""])
    else:
        limit = round(_price(inst, rng) * rng.uniform(0.97, 1.03), 2)
        args["order_type"] = "limit"
        args["limit_price"] = limit
        price_text = rng.choice([f" at a limit of {limit:.2f}", f" limit {limit:.2f}", f" with a {limit:.2f} limit"])
    tif = rng.choice(["", "", " good till cancelled", " GTC", " for the day"])
    if tif:
        args["time_in_force"] = "gtc" if "G" in tif.upper() and "DAY" not in tif.upper() else "day"
    shares = rng.choice([f"{qty} shares of {inst.symbol}", f"{qty} {inst.symbol}"])
    account = rng.choice([f" in {acc}", f" for {acc}", f" in account {acc}"])
    return rng.choice([f"{verb} {shares}{price_text}{account}{tif}.",
                       f"Please {side} {shares}{account}{price_text}{tif}."]), args


def _order_result(rng: random.Random) -> dict[str, Any]:
    return {"order_id": f"ORD-{rng.randint(10000, 99999)}", "status": "accepted"}


def _order_confirmation(args: dict[str, Any], result: dict[str, Any]) -> str:
    kind = (f"limit order to {args['side']} {args['quantity']} {args['symbol']} at {args['limit_price']:.2f}"
            if args["order_type"] == "limit" else f"market order to {args['side']} {args['quantity']} "
            f"{args['symbol']}")
    tif = " (good till cancelled)" if args.get("time_in_force") == "gtc" else ""
    return f"Done: your {kind}{tif} in {args['account_id']} was accepted as {result['order_id']}."


def order_dialogue(rng: random.Random) -> Messages:
    user, args = _order_request(rng)
    result = _order_result(rng)
    return [{"role": "user", "content": user}, _call("place_order", args), _tool(result),
            _say(_order_confirmation(args, result))]


def _risk_result(rng: random.Random, args: dict[str, Any]) -> dict[str, Any]:
    util = round(rng.choice([rng.uniform(5, 95), rng.uniform(95, 140)]), 1)
    return {"account_id": args["account_id"], "approved": util <= 100, "utilization_pct": util,
            "risk_level": risk_level(util)}


def risk_order_dialogue(rng: random.Random) -> Messages:
    request, args = _order_request(rng)
    user = rng.choice([f"Run the risk check, then: {request}", f"{request} Check risk first.",
                       f"If it passes the risk check: {request}"])
    risk_args = {k: args[k] for k in ("account_id", "symbol", "side", "quantity")}
    risk = _risk_result(rng, args)
    messages = [{"role": "user", "content": user}, _call("check_risk", risk_args), _tool(risk)]
    if not risk["approved"]:
        return messages + [_say(f"I did not place the order: the risk check failed with utilization at "
                                f"{risk['utilization_pct']:.1f}% of the limit for {args['account_id']}. "
                                "Reduce the quantity or ask risk for a higher limit.")]
    result = _order_result(rng)
    return messages + [_call("place_order", args), _tool(result),
                       _say(f"Risk check passed ({risk['utilization_pct']:.1f}% utilization, "
                            f"{risk['risk_level']} risk). " + _order_confirmation(args, result))]


def risk_check_dialogue(rng: random.Random) -> Messages:
    _, args = _order_request(rng)
    a = {k: args[k] for k in ("account_id", "symbol", "side", "quantity")}
    user = rng.choice([f"Can {a['account_id']} {a['side']} {a['quantity']} {a['symbol']} within its limits?",
                       f"Risk check: {a['side']} {a['quantity']} {a['symbol']} in {a['account_id']}."])
    risk = _risk_result(rng, args)
    verdict = "passes" if risk["approved"] else "fails"
    return [{"role": "user", "content": user}, _call("check_risk", a), _tool(risk),
            _say(f"The trade {verdict} the risk check: utilization would be {risk['utilization_pct']:.1f}% of "
                 f"the limit, which is {risk['risk_level']} risk.")]


# ---- JSON reports --------------------------------------------------------------------------------

def order_ticket_report(rng: random.Random) -> tuple[str, dict[str, Any]]:
    request, args = _order_request(rng)
    ticket = {"account_id": args["account_id"], "symbol": args["symbol"], "side": args["side"],
              "quantity": args["quantity"], "order_type": args["order_type"],
              "limit_price": args.get("limit_price"), "time_in_force": args.get("time_in_force", "day")}
    return rng.choice(["Make an order ticket: ", "Ticket this: ", ""]) + request, ticket


def position_summary_report(rng: random.Random) -> tuple[str, dict[str, Any]]:
    acc, positions = rng.choice(ACCOUNT_CODES), _random_positions(rng)
    lines = "\n".join(f"{p['symbol']} {p['quantity']}" for p in positions)
    user = f"Summarise the positions of {acc}:\n{lines}"
    summary = {"account_id": acc, "position_count": len(positions),
               "positions": [{"symbol": p["symbol"], "quantity": p["quantity"],
                              "direction": "long" if p["quantity"] > 0 else "short"} for p in positions],
               "largest_position": _largest(positions)}
    return user, summary


def risk_report(rng: random.Random) -> tuple[str, dict[str, Any]]:
    _, args = _order_request(rng)
    util = _risk_result(rng, args)["utilization_pct"]
    user = (f"Risk report for {args['account_id']}: {args['side']} {args['quantity']} {args['symbol']}. "
            f"Limit utilization after the trade: {util:.1f}%. Approve only up to 100%.")
    report = {"account_id": args["account_id"], "symbol": args["symbol"], "side": args["side"],
              "quantity": args["quantity"], "utilization_pct": util, "risk_level": risk_level(util),
              "approved": util <= 100}
    return user, report


__all__ = ["BY_SYMBOL"]
