"""compare_trees: one benchmark command run in two source trees, alternating; medians and ratios per figure."""

from __future__ import annotations

import json
import sys

from evals.perf.compare_trees import flatten, main

BENCH = """
import argparse, json, pathlib, speed
ap = argparse.ArgumentParser(); ap.add_argument("--out"); a = ap.parse_args()
pathlib.Path(a.out, "r.json").write_text(json.dumps({"g": {"tok_s": speed.TOK_S, "ok": True}, "name": "x"}))
"""


def test_flatten_keeps_numbers_only():
    assert flatten({"a": {"b": 1, "c": {"d": 2.5}, "e": True, "f": "s"}, "g": [1]}) == {"a/b": 1.0, "a/c/d": 2.5}


def test_each_tree_runs_its_own_code(tmp_path, monkeypatch):
    trees = {}
    for name, speed in (("base", 10.0), ("new", 15.0)):
        tree = trees[name] = tmp_path / name
        tree.mkdir()
        (tree / "speed.py").write_text(f"TOK_S = {speed}\n")  # the code that differs between the trees
        (tree / "bench.py").write_text(BENCH)
    monkeypatch.chdir(trees["new"])
    out = tmp_path / "res" / "cmp"
    res = main(["--baseline", str(trees["base"]), "--result", "r.json", "--rounds", "2", "--out", str(out),
                "--", sys.executable, "bench.py"])
    assert [r["g"]["tok_s"] for r in res["runs"]["baseline"]] == [10.0, 10.0]
    assert res["median"]["this"]["g/tok_s"] == 15.0 and res["this_over_baseline"]["g/tok_s"] == 1.5
    assert json.loads(out.with_suffix(".json").read_text())["this_over_baseline"]["g/tok_s"] == 1.5
    assert out.with_suffix(".png").stat().st_size > 0
