"""The demo agent's tool definitions (OpenAI format) and the JSON report schemas."""

from __future__ import annotations

from typing import Any

_SYMBOL = {"type": "string", "pattern": "^[A-Z]{1,5}$"}
_ACCOUNT = {"type": "string", "pattern": "^ACC-[0-9]{4}$"}
_SIDE = {"type": "string", "enum": ["buy", "sell"]}
_QUANTITY = {"type": "integer", "minimum": 1}


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


TOOLS: dict[str, dict[str, Any]] = {t["function"]["name"]: t for t in (
    _tool("get_quote", "Get the latest quote for an instrument.", {"symbol": _SYMBOL}, ["symbol"]),
    _tool("get_price_history", "Get daily closing prices for an instrument.",
          {"symbol": _SYMBOL, "days": {"type": "integer", "minimum": 1, "maximum": 30}}, ["symbol", "days"]),
    _tool("get_positions", "List the open positions of an account.", {"account_id": _ACCOUNT}, ["account_id"]),
    _tool("check_risk", "Run the pre-trade risk check for a proposed order.",
          {"account_id": _ACCOUNT, "symbol": _SYMBOL, "side": _SIDE, "quantity": _QUANTITY},
          ["account_id", "symbol", "side", "quantity"]),
    _tool("place_order", "Place an order for an account.",
          {"account_id": _ACCOUNT, "symbol": _SYMBOL, "side": _SIDE, "quantity": _QUANTITY,
           "order_type": {"type": "string", "enum": ["market", "limit"]},
           "limit_price": {"type": "number", "exclusiveMinimum": 0},
           "time_in_force": {"type": "string", "enum": ["day", "gtc"]}},
          ["account_id", "symbol", "side", "quantity", "order_type"]),
)}

REPORT_SCHEMAS: dict[str, dict[str, Any]] = {
    "order_ticket": {
        "title": "order_ticket", "type": "object", "additionalProperties": False,
        "properties": {
            "account_id": _ACCOUNT, "symbol": _SYMBOL, "side": _SIDE, "quantity": _QUANTITY,
            "order_type": {"type": "string", "enum": ["market", "limit"]},
            "limit_price": {"type": ["number", "null"]},
            "time_in_force": {"type": "string", "enum": ["day", "gtc"]},
        },
        "required": ["account_id", "symbol", "side", "quantity", "order_type", "limit_price", "time_in_force"],
    },
    "position_summary": {
        "title": "position_summary", "type": "object", "additionalProperties": False,
        "properties": {
            "account_id": _ACCOUNT,
            "position_count": {"type": "integer", "minimum": 0},
            "positions": {"type": "array", "items": {
                "type": "object", "additionalProperties": False,
                "properties": {"symbol": _SYMBOL, "quantity": {"type": "integer"},
                               "direction": {"type": "string", "enum": ["long", "short"]}},
                "required": ["symbol", "quantity", "direction"]}},
            "largest_position": _SYMBOL,
        },
        "required": ["account_id", "position_count", "positions", "largest_position"],
    },
    "risk_report": {
        "title": "risk_report", "type": "object", "additionalProperties": False,
        "properties": {
            "account_id": _ACCOUNT, "symbol": _SYMBOL, "side": _SIDE, "quantity": _QUANTITY,
            "utilization_pct": {"type": "number", "minimum": 0},
            "risk_level": {"type": "string", "enum": ["low", "medium", "high"]},
            "approved": {"type": "boolean"},
        },
        "required": ["account_id", "symbol", "side", "quantity", "utilization_pct", "risk_level", "approved"],
    },
}


def risk_level(utilization_pct: float) -> str:
    """The house rule the risk_report and check_risk answers follow."""
    return "low" if utilization_pct < 50 else "medium" if utilization_pct < 90 else "high"
