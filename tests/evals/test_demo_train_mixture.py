"""The demo trainer's mixture: --boost-family with one family or a comma-separated list."""

from __future__ import annotations

from collections import Counter

import pytest

from evals.demo.train import split_conversations


def test_boost_list_draws_only_and_all_listed_families():
    kinds = Counter(c.kind for c in split_conversations("train", 300, 0, "quote, sql,order_ticket", 1.0))
    assert set(kinds) == {"quote", "sql", "order_ticket"}
    assert min(kinds.values()) > 60  # drawn uniformly: about 100 each


def test_single_boost_family_keeps_its_draws_and_share():
    convs = list(split_conversations("train", 400, 0, "concept", 0.5))
    share = sum(c.kind == "concept" for c in convs) / len(convs)
    assert 0.45 < share < 0.75  # half boosted plus concept's own 14% of the rest
    assert [c.render() for c in convs[:20]] == [c.render() for c in split_conversations("train", 20, 0, "concept", 0.5)]


def test_unknown_boost_family_is_an_error():
    with pytest.raises(ValueError, match="unknown family"):
        list(split_conversations("train", 5, 0, "nope", 1.0))
