"""Per-field scoring of structured outputs (evals/structured_score.py)."""

from __future__ import annotations

from evals.structured_score import field_matches, leaves, missed_fields, sql_literal_matches, sql_literals


def test_leaves_flattens_objects_and_arrays():
    value = {"account_id": "ACC-1001", "positions": [{"symbol": "V", "quantity": -10}], "empty": []}
    assert leaves(value) == {"account_id": "ACC-1001", "positions.0.symbol": "V", "positions.0.quantity": -10,
                             "empty": []}


def test_field_matches_counts_partial_copies():
    want = {"account_id": "ACC-1003", "symbol": "SIE", "side": "buy", "quantity": 170}
    assert field_matches(want, want) == (4, 4)
    assert field_matches({"account_id": "ACC-1004", "symbol": "TSLA", "side": "buy", "quantity": 170}, want) == (2, 4)
    assert field_matches(None, want) == (0, 4)
    assert field_matches({"symbol": "SIE"}, want) == (1, 4)  # missing fields are misses


def test_missed_fields_names_the_paths_got_wrong():
    want = {"account_id": "ACC-1003", "positions": [{"symbol": "V", "quantity": 10}, {"symbol": "KO", "quantity": 5}]}
    got = {"account_id": "ACC-1003", "positions": [{"symbol": "V", "quantity": 12}, {"symbol": "PG", "quantity": 5}]}
    assert missed_fields(got, want) == ["positions.*.quantity", "positions.*.symbol"]
    assert missed_fields(want, want) == []
    assert missed_fields(None, {"side": "buy"}) == ["side"]


def test_field_matches_keeps_json_types_apart():
    assert field_matches({"approved": 1}, {"approved": True}) == (0, 1)
    assert field_matches({"limit_price": None}, {"limit_price": None}) == (1, 1)
    assert field_matches({"p": [{"q": 2}, {"q": 3}]}, {"p": [{"q": 2}, {"q": 4}]}) == (1, 2)


def test_sql_literal_matches():
    want = "SELECT p.close FROM prices p JOIN instruments i ON i.id = p.instrument_id " \
           "WHERE i.symbol = 'SPY' AND p.date = '2026-10-06';"
    assert sorted(sql_literals(want)) == ["2026-10-06", "SPY"]
    assert sql_literal_matches("SELECT COUNT(*) FROM trades WHERE date(executed_at) = '2026-10-06'", want) == (1, 2)
    assert sql_literal_matches(want, want) == (2, 2)
    assert sql_literal_matches("SELEC nonsense (", want) == (0, 2)
    assert sql_literal_matches(None, want) == (0, 2)
