"""The gateway determinism eval on the demo model, small: one json_schema request at temperature 0.7
repeated alone and beside concurrent exploration requests gives one output, and a cache hit the miss's."""

from __future__ import annotations

from evals.determinism import DEMO, run


def test_json_schema_request_is_deterministic_alone_beside_traffic_and_from_cache(tmp_path):
    report = run(str(DEMO), repeats=2, companions=3, out=tmp_path)
    long = report["prompts"]["long"]
    assert long["prompt_tokens"] > 600 and long["hit_cached_tokens_min"] > 0  # the repeats hit the prefix cache
    for name, r in report["prompts"].items():
        assert r["distinct_alone"] == r["distinct_beside"] == r["distinct_all"] == 1, name
        assert r["hit_equals_miss"], name
    assert (tmp_path / "determinism.json").is_file() and (tmp_path / "determinism.png").is_file()
