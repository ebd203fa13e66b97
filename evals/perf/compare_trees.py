"""One benchmark, two source trees, side by side: runs a benchmark command in a baseline checkout and in this one,
alternating, in fresh processes, and reports each figure per tree (every run, median) and this tree's ratio to the
baseline. On a shared machine only such ratios mean anything; the load average is kept with every run.

    python -m evals.perf.compare_trees --baseline /path/to/main-checkout --result mode_streams.json \\
        --out evals/perf/results/NAME -- python -m evals.perf.mode_streams --model engine/assets/demo-moe --skip engine

The command runs with the tree as its working directory and PYTHONPATH, and `--out DIR` appended; it must write
`DIR/<--result>`. Writes NAME.json and NAME.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from evals.perf.common import machine_info, save_bar_plot


def flatten(tree: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a result JSON as {"section/name": value} (booleans and strings left out)."""
    out: dict[str, float] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def run_in(tree: Path, command: list[str], result: str) -> dict:
    """The command's result JSON, run in `tree`, with the load average before and after."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        before = os.getloadavg()[0]
        print(f"[{tree}] {' '.join(command)}", flush=True)
        subprocess.run([*command, "--out", tmp], cwd=tree, env=env, check=True)
        res = json.loads((Path(tmp) / result).read_text())
        res["load_average"] = {"before": before, "after": os.getloadavg()[0]}
        return res


def save_plot(res: dict, path: Path, only: list[str], rounds: int) -> None:
    """One panel per section of the result (baseline and this tree side by side) and one of the ratios; `only`:
    the figures whose name contains one of these strings (all but load and machine figures when empty)."""
    median, ratio = res["median"], res["this_over_baseline"]
    shown = [k for k in ratio if "/" in k and k.split("/")[0] not in ("load_average", "machine")
             and (not only or any(o in k for o in only))]
    groups: dict[str, dict[str, float]] = {}
    for k in shown:
        section, name = k.split("/", 1)[0], k.rsplit("/", 1)[-1]
        groups.setdefault(section, {}).update({f"{name} (baseline)": median["baseline"][k],
                                               f"{name} (this)": median["this"][k]})
    groups["this / baseline"] = {k.rsplit("/", 1)[-1]: ratio[k] for k in shown}
    save_bar_plot(path, f"{path.stem}: median of {rounds} runs per tree, {res['machine']['cpu_count']} CPUs", groups)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="the baseline source tree (a checkout of main)")
    ap.add_argument("--result", required=True, help="file name the command writes under its --out")
    ap.add_argument("--out", required=True, help="output path without extension (NAME.json, NAME.png)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per tree, alternating (baseline first)")
    ap.add_argument("--plot", default="", help="comma list: plot only the figures whose name contains one")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark command")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the benchmark command after --")
    trees = {"baseline": Path(args.baseline).resolve(), "this": Path.cwd().resolve()}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(run_in(tree, command, args.result))
    flat = {name: [flatten(r) for r in rs] for name, rs in runs.items()}
    keys = [k for k in flat["this"][0] if all(k in f for fs in flat.values() for f in fs)]
    median = {name: {k: statistics.median(f[k] for f in fs) for k in keys} for name, fs in flat.items()}
    ratio = {k: median["this"][k] / median["baseline"][k] for k in keys if median["baseline"][k]}
    res = {"command": command, "baseline": str(trees["baseline"]), "this": str(trees["this"]),
           "machine": machine_info(), "runs": runs, "median": median, "this_over_baseline": ratio}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    save_plot(res, out.with_suffix(".png"), [k for k in args.plot.split(",") if k], args.rounds)
    json.dump({"median": median, "this_over_baseline": ratio}, sys.stdout, indent=2)
    print()
    return res


if __name__ == "__main__":
    main()
