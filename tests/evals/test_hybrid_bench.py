"""The hybrid benchmark runs end to end (on the CPU here: the fast device played by the CPU) and writes
its JSON and plot; its figures mean something on a GPU only, so nothing is asserted about speed."""

from __future__ import annotations

import json

from evals.perf.hybrid_bench import main
from tests.engine.conftest import write_hf_checkpoint


def test_hybrid_bench_smoke(tmp_path):
    model = tmp_path / "ckpt"
    write_hf_checkpoint(model, "qwen3_moe", num_experts_per_tok=4, num_hidden_layers=2)
    out = tmp_path / "out"
    assert main(["--model", str(model), "--device", "cpu", "--quick", "--out", str(out), "--kv-gib", "0.05"]) == 0
    result = json.loads((out / "hybrid_bench.json").read_text())
    assert set(result["decode_tok_per_s"]) == {"d=0", "d=1", "d=2"}
    assert all(v > 0 for v in result["decode_tok_per_s"].values())
    assert result["prefill"]["layer-wise"]["bursts_on_device"] > 0  # the long prompt ran its experts layer-wise
    assert result["prefill"]["CPU experts"]["bursts_on_device"] == 0
    assert 0 < result["hot_set_hit_rate"]["static uniform"] <= 1
    assert (out / "hybrid_bench.png").stat().st_size > 0
