"""Exploration vs execution: deferral, strict sync, precision profiles, batch invariance, resync.

Deferral drift bound (tiny random Qwen3-MoE, top-4, d=1, int4 experts): on 12 prompts the
next-token distribution under deferral stays within mean KL 0.05 nats of strict, and the top-1
token agrees on at least 75% of them. (Random routers are near-uniform, the worst case for
deferral; the demo model's figures are in evals/.)
"""

from __future__ import annotations

import pytest
import torch

from engine.experts import PlacementConfig
from engine.llm_engine import LLM
from engine.sampling_params import LogitsRecorder, SamplingParams
from tests.engine.conftest import run_requests

PLACEMENT = PlacementConfig(fast_format="int4", exact_format="bf16", formatting_layers=1)


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("qwen3_moe", num_experts_per_tok=4, num_hidden_layers=3)


def _llm(ckpt, **kw) -> LLM:
    kw = {"placement": PLACEMENT, "num_kv_blocks": 256, "block_size": 8, "max_num_batched_tokens": 32,
          "progress": False, **kw}
    return LLM(ckpt, **kw)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _run(llm: LLM, requests) -> dict[str, list[int]]:
    return run_requests(llm.engine, requests)


def test_execution_bytes_identical_alone_and_under_load_over_20_runs(ckpt):
    llm = _llm(ckpt, defer=1)
    prompt = _prompts(1, 99)[0]
    alone = LogitsRecorder()
    ref = _run(llm, [("x", prompt, SamplingParams(max_tokens=10, ignore_eos=True, logits_processors=[alone]),
                      "execution")])["x"]
    for rep in range(20):
        rec = LogitsRecorder()
        load = [(f"e{i}", p, SamplingParams(max_tokens=12, temperature=0.8, seed=rep * 10 + i), "exploration")
                for i, p in enumerate(_prompts(8, rep))]
        # the execution request arrives at a different point of the exploration traffic each time
        requests = load[: rep % 9] + [("x", prompt, SamplingParams(max_tokens=10, ignore_eos=True,
                                                                    logits_processors=[rec]), "execution")]
        requests += load[rep % 9 :]
        out = _run(llm, requests)
        assert out["x"] == ref
        assert rec.bytes() == alone.bytes(), f"repeat {rep}: execution logits changed under load"
    assert llm.engine.blocks.num_free == 256


def test_d0_exploration_equals_strict_when_profiles_match(ckpt):
    same = PlacementConfig(fast_format="int8", exact_format="int8")
    llm = _llm(ckpt, placement=same)
    prompts = _prompts(4, 1)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    explore = _run(llm, [(f"a{i}", p, params, "exploration") for i, p in enumerate(prompts)])
    strict = _run(llm, [(f"b{i}", p, params, "execution") for i, p in enumerate(prompts)])
    assert [explore[f"a{i}"] for i in range(4)] == [strict[f"b{i}"] for i in range(4)]


def test_deferral_differs_from_strict_within_documented_bound(ckpt):
    prompts = _prompts(12, 5)
    first_logits = {}
    for d in (0, 1):
        llm = _llm(ckpt, defer=d)
        recs = [LogitsRecorder() for _ in prompts]
        _run(llm, [(f"r{i}", p, SamplingParams(max_tokens=1, logits_processors=[r]), "exploration")
                   for i, (p, r) in enumerate(zip(prompts, recs, strict=True))])
        first_logits[d] = torch.stack([r.rows[0] for r in recs])  # [12, V]
    strict, deferred = first_logits[0], first_logits[1]
    assert not torch.equal(strict, deferred)  # deferral really changes the computation
    kl = torch.nn.functional.kl_div(deferred.log_softmax(-1), strict.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    assert kl.mean().item() <= 0.05
    assert (strict.argmax(-1) == deferred.argmax(-1)).float().mean().item() >= 0.75


def test_resync_recompute_equals_all_strict_run(ckpt):
    llm = _llm(ckpt, defer=1)
    engine = llm.engine
    prompt = _prompts(1, 7)[0]
    k = 5
    rec = LogitsRecorder()
    engine.add_request("s", prompt, SamplingParams(max_tokens=k + 8, ignore_eos=True, logits_processors=[rec]))
    out = None
    while out is None or len(out.token_ids) < k:
        out = engine.step()[0]
    engine.set_mode("s", "execution", resync="recompute")
    while engine.has_work():
        out = engine.step()[0]
    switched_tail = out.token_ids[k:]
    strict_rec = LogitsRecorder()
    strict = _run(llm, [("t", prompt + out.token_ids[:k],
                         SamplingParams(max_tokens=8, ignore_eos=True, logits_processors=[strict_rec]), "execution")])
    assert switched_tail == strict["t"]
    assert b"".join(r.numpy().tobytes() for r in rec.rows[k:]) == strict_rec.bytes()


def test_switch_leaves_no_deferred_work_on_execution_tokens(ckpt):
    llm = _llm(ckpt, defer=1)
    engine = llm.engine
    worker = engine.runner.expert_worker
    submitted = []
    real_submit = worker.submit

    def counting_submit(fn, x, ids, *args):
        submitted.append(int((ids >= 0).sum()))
        return real_submit(fn, x, ids, *args)

    worker.submit = counting_submit
    engine.add_request("s", _prompts(1, 3)[0], SamplingParams(max_tokens=10, ignore_eos=True))
    for _ in range(4):
        engine.step()
    before = len(submitted)
    assert before > 0 and all(n > 0 for n in submitted)
    engine.set_mode("s", "execution", resync="keep")
    while engine.has_work():
        engine.step()
    assert len(submitted) == before  # nothing deferred once the sequence is in execution mode
    assert engine.blocks.num_free == 256


def test_fingerprint_tracks_profile_and_deferral(ckpt):
    a, b = _llm(ckpt, defer=1).engine, _llm(ckpt, defer=0).engine
    assert a.numerics_fingerprint("execution") == b.numerics_fingerprint("execution")
    assert a.numerics_fingerprint("exploration") != b.numerics_fingerprint("exploration")
    assert a.numerics_fingerprint("exploration") != a.numerics_fingerprint("execution")


def test_numerics_profile_is_the_engine_fields_in_one_object(ckpt):
    """EngineConfig(numerics=...) and the separate fields build the same engine numerics; a contradiction is
    refused; the fingerprint reads the resolved profile."""
    from engine.llm_engine import EngineConfig
    from engine.mode import Mode
    from engine.numerics import NumericsProfile

    profile = NumericsProfile(experts=PLACEMENT, fast_lm_head="int8", defer=1)
    by_fields = _llm(ckpt, fast_lm_head="int8", defer=1).engine
    by_profile = _llm(ckpt, placement=None, numerics=profile).engine
    assert by_fields.numerics == by_profile.numerics and by_profile.config.defer == 1
    for mode in Mode:
        assert by_fields.numerics_fingerprint(mode) == by_profile.numerics_fingerprint(mode)
    with pytest.raises(ValueError, match="contradicts numerics.defer"):
        EngineConfig(model=str(ckpt), numerics=profile, defer=2)
    with pytest.raises(ValueError, match="mode must be exploration or execution"):
        by_fields.set_mode("none", "fast")


def test_mode_triggers_switch_at_the_token_boundary(ckpt):
    llm = _llm(ckpt, defer=1)
    engine = llm.engine
    prompt = _prompts(1, 11)[0]
    free = _run(llm, [("f", prompt, SamplingParams(max_tokens=12, ignore_eos=True), "exploration")])["f"]
    opener, closer = free[3], free[7]
    engine.add_request("s", prompt, SamplingParams(max_tokens=12, ignore_eos=True,
                                                   mode_triggers={opener: "execution", closer: "exploration"}))
    seq = engine._seqs["s"]
    while engine.has_work():
        engine.step()
    # switched right after the opener was sampled; back once the closer was sampled (if it still is)
    assert seq.mode_switches[0] == (free.index(opener) + 1, "execution")
    assert all(m in ("execution", "exploration") for _, m in seq.mode_switches)


def test_fast_lm_head_serves_exploration_only(ckpt):
    prompt = _prompts(1, 21)[0]
    rows = {}
    for head in (None, "int8"):
        llm = _llm(ckpt, fast_lm_head=head)
        recs = {m: LogitsRecorder() for m in ("exploration", "execution")}
        _run(llm, [(m, prompt, SamplingParams(max_tokens=1, logits_processors=[r]), m) for m, r in recs.items()])
        rows[head] = {m: r.rows[0] for m, r in recs.items()}
    assert torch.equal(rows[None]["execution"], rows["int8"]["execution"])  # execution keeps its lm_head
    diff = (rows[None]["exploration"] - rows["int8"]["exploration"]).abs().max().item()
    assert 0 < diff < 0.05 * rows[None]["exploration"].abs().max().item()  # int8 rows: close, not equal


@pytest.mark.parametrize("dense,head", [("int8", "int4"), ("int4", "int8")])
def test_fast_dense_serves_exploration_only(ckpt, dense, head):
    """Quantized attention projections and lm_head (CPU kernel) change exploration logits by little, leave
    execution bit-identical, are named by the exploration fingerprint only, and decode many tokens."""
    prompt = _prompts(1, 22)[0]
    rows, fps = {}, {}
    for cfg in ((None, None), (dense, head)):
        llm = _llm(ckpt, fast_dense=cfg[0], fast_lm_head=cfg[1])
        recs = {m: LogitsRecorder() for m in ("exploration", "execution")}
        _run(llm, [(m, prompt, SamplingParams(max_tokens=6, ignore_eos=True, logits_processors=[r]), m)
                   for m, r in recs.items()])
        rows[cfg] = {m: torch.stack(r.rows) for m, r in recs.items()}
        fps[cfg] = {m: llm.engine.numerics_fingerprint(m) for m in recs}
    base, fast = rows[(None, None)], rows[(dense, head)]
    assert torch.equal(base["execution"], fast["execution"])
    assert fps[(None, None)]["execution"] == fps[(dense, head)]["execution"]
    assert fps[(None, None)]["exploration"] != fps[(dense, head)]["exploration"]
    first_base, first_fast = base["exploration"][0], fast["exploration"][0]  # same prefix: comparable
    kl = torch.nn.functional.kl_div(first_fast.log_softmax(-1), first_base.log_softmax(-1), log_target=True,
                                    reduction="sum").item()
    assert not torch.equal(first_base, first_fast) and kl < 0.05
    assert fast["exploration"].shape[0] == 6 and torch.isfinite(fast["exploration"]).all()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fused_decode_matches_the_torch_fast_path(hf_checkpoint, arch):
    """Small exploration batches run each layer in one kernel call (engine.models.fused_decode); its
    logits equal the torch modules' fast path up to fp32 summation order, for a batch of sequences
    with different context lengths (decode steps and a short prefill mixed), and the KV it writes
    serves later steps."""
    ckpt = hf_checkpoint(arch, num_hidden_layers=2)
    prompts = [p[:12] for p in _prompts(3, 23)]
    res = {}
    for fused in (False, True):
        llm = _llm(ckpt, fast_dense="int8", fast_lm_head="int8", fused_decode=fused)
        assert llm.engine.fused_decode == fused
        recs = [LogitsRecorder() for _ in prompts]
        _run(llm, [(f"r{i}", p, SamplingParams(max_tokens=8, ignore_eos=True, logits_processors=[r]), "exploration")
                   for i, (p, r) in enumerate(zip(prompts, recs, strict=True))])
        res[fused] = [torch.stack(r.rows) for r in recs]
    for a, b in zip(res[False], res[True], strict=True):
        finite = torch.isfinite(a[0])
        assert torch.isfinite(b[:, finite]).all()
        err = (a[:, finite] - b[:, finite]).abs().max().item()
        assert err <= 1e-4 * a[:, finite].abs().max().item() + 1e-5, err


def test_decode_with_a_kernel_lm_head_keeps_torch_single_threaded(ckpt, monkeypatch):
    """A decode step whose lm_head is the compiled kernel must not raise torch's thread count: torch's
    OpenMP workers would then spin on the cores the kernel's own pool is using."""
    prompt = _prompts(1, 24)[0][:8]
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n))[1])
    before = torch.get_num_threads()
    try:
        real(2)
        llm = _llm(ckpt, fast_dense="int8", fast_lm_head="int4")
        llm.engine.runner.max_threads = 2
        calls.clear()
        _run(llm, [("r", prompt, SamplingParams(max_tokens=6, ignore_eos=True), "exploration")])
        assert calls and set(calls) == {1}  # dropped to 1 for the small forwards, never raised back
        calls.clear()
        _run(llm, [("e", prompt, SamplingParams(max_tokens=3, ignore_eos=True), "execution")])
        assert set(calls) <= {1}  # the fused execution path and its lm_head: the kernel's pool, never raised
        serial = _llm(ckpt, fast_dense="int8", fast_lm_head="int4", batch_invariant_execution=False)
        serial.engine.runner.max_threads = 2
        calls.clear()
        _run(serial, [("e", prompt, SamplingParams(max_tokens=3, ignore_eos=True), "execution")])
        assert 2 in calls  # an execution lm_head on torch: worth every core
    finally:
        real(before)
