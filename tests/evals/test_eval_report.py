"""`moegate eval --quick` on the shipped demo model writes a complete report."""

from __future__ import annotations

import argparse
import json

from evals.report import DEMO, run


def test_quick_report_on_the_demo_model(tmp_path):
    assert run(argparse.Namespace(model=str(DEMO), out=str(tmp_path), tasks=9, quick=True)) == 0
    report = tmp_path / "report"
    data = json.loads((report / "report.json").read_text())
    for kind, stats in data["structured"].items():  # constrained outputs are always valid
        assert stats["valid"] == stats["n"] > 0, (kind, stats.get("errors"))
    assert data["determinism"]["distinct_outputs"] == 1
    assert set(data["quantization"]) == {"int8", "int4"}
    assert data["routing"]["mean_coverage_frequency"] >= data["routing"]["mean_coverage_uniform"]
    constraints = data["constraints"]
    if "skipped" not in constraints:  # the public benchmark data is present: every sampled output is valid
        for split in constraints["json_schema"].values():
            assert split["valid"] == split["generated"] > 0
        for sql in constraints["sql"]["dialects"].values():  # no write accepted; every finished walk valid
            assert sql["adversarial_accepted"] == 0 and sql["random_walks"]["valid"] == sql["random_walks"]["finished"]
            assert sql["all_three_pct"] > 80
        assert all(b["valid"] == b["compiled"] > 0 for b in constraints["bfcl"].values())
        assert "Spider dev gold SQL" in (report / "report.md").read_text()
    for name in ("report.md", "routing_skew.png", "modes_bench.png", "modes_timeline.png"):
        assert (report / name).stat().st_size > 0
