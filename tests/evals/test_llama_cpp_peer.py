"""The llama.cpp peer of the engine benchmark without building llama.cpp: llama-bench's JSON (a recorded
sample) parsed into prefill/decode figures, the command the benchmark runs (a stand-in binary that replays
the sample), the part -> type table of a GGUF, and the pairing of moegate rows with their peer files."""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

from evals.perf import llama_cpp
from evals.perf.llama_cpp import MATCHED, PEERS, format_matched, pair_rows, parse_bench_json

SAMPLE = Path(__file__).parent / "data" / "llama_bench_sample.json"


def test_parse_recorded_sample():
    records = json.loads(SAMPLE.read_text())
    rows = parse_bench_json(SAMPLE.read_text())
    combined = [r for r in records if r["n_prompt"] and r["n_gen"]]
    assert combined, "the sample holds a pp+tg test (-pg), which the parser must leave out"
    assert len(rows) == len(records) - len(combined)
    pre = next(r for r in rows if r["kind"] == "prefill")
    dec = next(r for r in rows if r["kind"] == "decode")
    rec_pre = next(r for r in records if r["n_prompt"] and not r["n_gen"])
    rec_dec = next(r for r in records if r["n_gen"] and not r["n_prompt"])
    assert pre["tokens"] == rec_pre["n_prompt"] and dec["tokens"] == rec_dec["n_gen"]
    assert pre["tok_s"] == rec_pre["avg_ts"] and dec["tok_s"] == rec_dec["avg_ts"]
    assert pre["best_tok_s"] == max(rec_pre["samples_ts"]) and dec["best_tok_s"] == max(rec_dec["samples_ts"])
    assert pre["best_tok_s"] >= pre["tok_s"] and dec["best_tok_s"] >= dec["tok_s"]
    assert pre["threads"] == rec_pre["n_threads"] and pre["cpu"] == rec_pre["cpu_info"]


def _fake_build(tmp_path: Path) -> Path:
    """A cache whose llama-bench replays the recorded sample and writes down its arguments."""
    bindir = tmp_path / "cache" / "build" / "bin"
    bindir.mkdir(parents=True)
    script = bindir / "llama-bench"
    script.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'argv'}\ncat {SAMPLE}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return tmp_path / "cache"


def _tiny_gguf(path: Path) -> Path:
    """A GGUF with a Qwen3-MoE's tensor names at the types of llama.cpp's default Q4_0 (output at Q8_0 here)."""
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    rng = np.random.default_rng(0)

    def add(name: str, qtype: T, shape: tuple[int, ...]) -> None:
        data = rng.standard_normal(shape).astype(np.float32)
        if qtype == T.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", T.Q4_0, (16, 64))
    add("output.weight", T.Q8_0, (16, 64))
    add("output_norm.weight", T.F32, (64,))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        add(f"blk.0.{name}.weight", T.Q4_0, (64, 64))
    add("blk.0.attn_q_norm.weight", T.F32, (64,))
    add("blk.0.attn_norm.weight", T.F32, (64,))
    add("blk.0.ffn_gate_inp.weight", T.F32, (4, 64))
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        add(f"blk.0.{name}.weight", T.Q4_0, (4, 32, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tensor_types_per_part(tmp_path):
    types = llama_cpp.tensor_types(_tiny_gguf(tmp_path / "m.gguf"))
    assert types == {"attention": "Q4_0", "embedding": "Q4_0", "experts": "Q4_0", "lm_head": "Q8_0",
                     "norms": "F32", "router": "F32"}


def test_bench_peer_runs_llama_bench_and_pairs_best_runs(tmp_path):
    cache = _fake_build(tmp_path)
    gguf = _tiny_gguf(tmp_path / "m.gguf")
    peer = llama_cpp.bench_peer(str(gguf), 128, 64, 2, reps=5, cache=cache)
    argv = (tmp_path / "argv").read_text().split()
    assert argv[argv.index("-p") + 1] == "128" and argv[argv.index("-n") + 1] == "64"
    assert argv[argv.index("-t") + 1] == "2" and argv[argv.index("-r") + 1] == "5"
    assert argv[argv.index("-m") + 1] == str(gguf) and argv[argv.index("-o") + 1] == "json"
    rows = {r["kind"]: r for r in parse_bench_json(SAMPLE.read_text())}
    assert peer["prefill_tok_s"] == rows["prefill"]["best_tok_s"]
    assert peer["decode_mean_tok_s"] == rows["decode"]["tok_s"]
    assert peer["tensor_types"]["lm_head"] == "Q8_0"

    # the rows: each moegate run divided by its own peer's figures; a row whose peer did not run has no ratio
    summary = {"llama.cpp-Q4_0": peer, "llama.cpp-BF16": {"prefill_tok_s": 50.0, "decode_tok_s": 10.0}}
    for i, row in enumerate(MATCHED):
        summary[row.run] = {"prefill_tok_s": 100.0 + i, "decode_tok_s": 20.0 + i, "precision": {"experts": row.fmt}}
    matched = pair_rows(summary)
    assert [m["label"] for m in matched] == [r.label for r in MATCHED]
    for i, (row, m) in enumerate(zip(MATCHED, matched, strict=True)):
        base = summary.get(f"llama.cpp-{row.peer}")
        if base is None:  # Q8_0 and Q4_0-pure did not run here
            assert "decode_ratio" not in m and "prefill_ratio" not in m
            continue
        assert m["decode_ratio"] == pytest.approx((20.0 + i) / base["decode_tok_s"])
        assert m["prefill_ratio"] == pytest.approx((100.0 + i) / base["prefill_tok_s"])
        assert m["moegate_precision"] == {"experts": row.fmt}
    assert matched[0]["peer_types"] == peer["tensor_types"]
    table = format_matched(matched)
    assert table.count("not measured") == 2 * sum(r.peer in ("Q8_0", "Q4_0-pure") for r in MATCHED)


def test_bench_peer_runs_again_without_repack_where_the_default_dies_of_sigill(tmp_path):
    """llama.cpp's AMX matmul faults on some CPUs / VMs: the default run killed by SIGILL, the file runs again
    with --repack 0 and the record says so; any other failure still raises."""
    cache = _fake_build(tmp_path)
    script = cache / "build" / "bin" / "llama-bench"
    script.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'argv'}\n"
                      f"case \"$*\" in *'--repack 0'*) cat {SAMPLE};; *) kill -ILL $$;; esac\n")
    gguf = _tiny_gguf(tmp_path / "m.gguf")
    peer = llama_cpp.bench_peer(str(gguf), 128, 64, 2, reps=1, cache=cache)
    argv = (tmp_path / "argv").read_text().split()
    assert argv[argv.index("--repack") + 1] == "0"
    assert peer["repack"] is False and "SIGILL" in peer["default_failed"]
    rows = {r["kind"]: r for r in parse_bench_json(SAMPLE.read_text())}
    assert peer["prefill_tok_s"] == rows["prefill"]["best_tok_s"]
    script.write_text("#!/bin/sh\nexit 3\n")
    with pytest.raises(subprocess.CalledProcessError):
        llama_cpp.bench_peer(str(gguf), 128, 64, 2, reps=1, cache=cache)
    fine = _fake_build(tmp_path / "fine")
    assert llama_cpp.bench_peer(str(gguf), 128, 64, 2, reps=1, cache=fine)["repack"] is True


def test_matched_rows_are_distinct_runs_on_known_peers():
    assert {r.peer for r in MATCHED} <= set(PEERS)
    assert len({r.run for r in MATCHED}) == len(MATCHED)  # no two rows share (and so overwrite) a run
    assert {r.peer for r in MATCHED} == set(PEERS)  # every peer file serves a row


def test_engine_bench_rejects_plan_options_with_llama_cpp():
    from evals.perf.engine_bench import main

    with pytest.raises(SystemExit):
        main(["--llama-cpp", "--formats", "int4", "--out", "/nonexistent/never-created"])


def test_repeats_keep_the_facts_the_rows_report():
    from evals.perf.engine_bench import median_runs

    row = MATCHED[0]
    runs = {f"llama.cpp-{row.peer}#0": {"prefill_tok_s": 10.0, "decode_tok_s": 1.0, "tensor_types": {"lm_head": "Q6_K"}},
            f"llama.cpp-{row.peer}#1": {"prefill_tok_s": 30.0, "decode_tok_s": 3.0, "tensor_types": {"lm_head": "Q6_K"}},
            f"{row.run}#0": {"prefill_tok_s": 40.0, "decode_tok_s": 4.0, "precision": {"lm_head": "int8"}},
            f"{row.run}#1": {"prefill_tok_s": 80.0, "decode_tok_s": 8.0, "precision": {"lm_head": "int8"}}}
    m = pair_rows(median_runs(runs), [row])[0]
    assert m["peer_types"] == {"lm_head": "Q6_K"} and m["moegate_precision"] == {"lm_head": "int8"}
    assert m["decode_ratio"] == pytest.approx(6.0 / 2.0) and m["prefill_ratio"] == pytest.approx(60.0 / 20.0)


def test_format_plan_names_the_matched_everything_runs():
    """`--formats bf16_a16,bf16 --lm-head match --fast-dense match --fast-only` (no --llama-cpp) runs exactly the
    moegate side of the two BF16 rows: bf16 activations (matched) and fp32 activations (moegate higher)."""
    from evals.perf.engine_bench import _format_plan, _parser

    args = _parser().parse_args(["--formats", "bf16_a16,bf16", "--lm-head", "match", "--fast-only"])
    plan = _format_plan(args, "model", [1, 2], "pack")
    rows = [r for r in MATCHED if r.peer == "BF16" and r.fmt is not None]
    assert [name for name, *_ in plan] == [r.run for r in rows]
    assert [(kw["lm_head"], kw["fast_dense"]) for *_, kw in plan] == [(r.lm_head, r.attention) for r in rows]
    assert [r.fmt for r in rows] == ["bf16_a16", "bf16"]
