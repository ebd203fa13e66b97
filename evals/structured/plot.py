"""The structured eval's plot (evals/structured/run.py writes results.json, then this its PNG)."""

from __future__ import annotations

from pathlib import Path


def plot(results: dict, path: Path, splits: tuple[str, ...]) -> None:
    """results.png: JSON coverage per split, mask cost, SQL and BFCL acceptance, compile time against outlines-core."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    js = results["json_schema"]
    shown = [s for s in splits if s in js]
    x, w = np.arange(len(shown)), 0.38
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    ax = axes[0]
    w3 = w * 2 / 3
    ax.bar(x - w3, [js[s]["compiled_pct"] for s in shown], w3, label="moegate compiled %")
    ax.bar(x, [js[s].get("llguidance_alone_pct", float("nan")) for s in shown], w3, label="llguidance alone %")
    ax.bar(x + w3, [js[s]["valid_pct_of_generated"] for s in shown], w3, label="valid % of generated")
    ax.axhline(95, color="r", ls="--", lw=1)
    ax.set(title="JSONSchemaBench", xticks=x, xticklabels=shown, ylim=(0, 105))
    ax.legend(loc="lower left")
    ax = axes[1]
    ax.bar(x - w / 2, [js[s]["mask_fill_us_per_token_p50"] for s in shown], w, label="fill p50")
    ax.bar(x + w / 2, [js[s]["mask_apply_us_per_token_p50"] for s in shown], w, label="apply p50")
    ax.set(title="mask µs / token (151,936 logits)", xticks=x, xticklabels=shown)
    ax.legend()
    sql, bf = results["sql"], results["bfcl"]
    names = [f"Spider {d} all three" for d in sql["dialects"]] + [f"BFCL {k}" for k in bf]
    vals = [v["all_three_pct"] for v in sql["dialects"].values()]
    vals += [bf[k]["valid_pct_of_compiled"] for k in bf]
    axes[2].bar(names, vals)
    axes[2].axhline(95, color="r", ls="--", lw=1)
    axes[2].set(title="SQL gold accepted % / tool calls valid %", ylim=(0, 105))
    axes[2].tick_params(axis="x", rotation=15)
    ax = axes[3]
    ol = results.get("outlines_core")
    if ol:
        both = [s for s in shown if s in ol]
        xo = np.arange(len(both))
        ax.bar(xo - w / 2, [js[s]["compile_ms_p50"] for s in both], w, label="llguidance")
        ax.bar(xo + w / 2, [1e3 * (ol[s]["compile_s_p50"] or float("nan")) for s in both], w, label="outlines-core")
        ax.set(yscale="log", title="JSON compile ms p50 (log)", xticks=xo, xticklabels=both)
        ax.legend()
    for a in (axes[0], axes[1], axes[3]):
        a.tick_params(axis="x", rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
