"""docs/deploy.md stays true: its sizing tables are what `moegate plan` computes today."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from modeltools.plan import GIB, PlanOptions, build_plan

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deploy.md"

REFERENCE = {"model_type": "qwen3_moe", "hidden_size": 1024, "num_hidden_layers": 8, "num_experts": 64,
             "num_experts_per_tok": 8, "moe_intermediate_size": 512, "num_attention_heads": 16,
             "num_key_value_heads": 4, "vocab_size": 151936, "tie_word_embeddings": False}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
                 "vocab_size": 151936, "tie_word_embeddings": False}


def _table_rows(heading: str) -> dict[str, list[str]]:
    section = DOC.read_text().split(heading, 1)[1]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| (int4|int8|bf16) \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = [x.strip() for x in m.group(2).split("|")]
        elif rows and not line.startswith("|"):
            break
    return rows


@pytest.mark.parametrize("heading, config", [("Worked example 1", REFERENCE), ("Worked example 2", QWEN3_30B_A3B)])
def test_sizing_tables_match_the_plan(tmp_path, heading, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    rows = _table_rows(heading)
    assert set(rows) == {"int4", "int8", "bf16"}
    for prec, row in rows.items():
        gpu = build_plan(tmp_path, PlanOptions(experts_precision=prec, device="cuda", kv_tokens=32768), 16.0)
        cpu = build_plan(tmp_path, PlanOptions(experts_precision=prec, device="cpu", kv_tokens=32768), 16.0)
        want = [gpu.experts_bytes / GIB, gpu.fast_device_bytes / GIB, cpu.host_ram_bytes / GIB,
                gpu.streamed_bytes_per_token / 2**20, gpu.decode_ceiling_tok_s, gpu.experts_ceiling_tok_s]
        for text, exp in zip(row, want, strict=True):
            decimals = len(text.split(".")[1]) if "." in text else 0
            assert abs(float(text) - exp) <= 0.5 * 10**-decimals + 1e-9, (prec, row, want)  # as rounded
