"""The host-expert pipeline, with the fast device played by the CPU (the same code path, a device argument):
routed rows only, overlap of deferred experts with the next attention, error propagation and abort."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.expert_pipeline import ExpertPipeline, ExpertWorkerError
from engine.experts import PlacementConfig
from engine.llm_engine import LLM
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from kernels import fused_moe

PLACEMENT = PlacementConfig(fast_format="int4", exact_format="int4")


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("qwen3_moe", num_experts_per_tok=4, num_hidden_layers=3)


@pytest.fixture(scope="module")
def moe(ckpt):
    """The routed experts of layer 0 (a model Experts module with packed host shards)."""
    return load_model(ckpt, progress=False, placement=PLACEMENT).model.layers[0].mlp.experts


def _llm(ckpt, **kw) -> LLM:
    return LLM(ckpt, placement=PLACEMENT, num_kv_blocks=64, block_size=8, progress=False, **kw)


def _inputs(t=9, k=4, e=8, h=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)  # [T, H]
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, K]
    weights = torch.softmax(torch.randn(t, k, generator=g), -1)  # [T, K]
    return x, ids, weights


def test_only_routed_rows_are_computed_and_rows_equal_the_kernel(moe):
    x, ids, weights = _inputs()
    ids[[1, 4, 5]] = -1  # tokens with nothing routed to the host
    seen = []
    real = moe.packed.compute_host

    def spy(xs, *a, **kw):
        seen.append(xs.shape[0])
        return real(xs, *a, **kw)

    moe.packed.compute_host = spy
    try:
        out = ExpertPipeline("cpu").run(moe, x, ids, weights)
    finally:
        del moe.packed.compute_host
    assert seen == [6]  # 9 tokens, 3 without a routed expert
    want = fused_moe(x, ids, weights, moe.packed.fast[0].packed, skip_missing=True)
    assert torch.equal(out, want)  # batch-invariant kernel: the routed rows alone give the same bytes
    assert torch.equal(out[[1, 4, 5]], torch.zeros(3, 64))


def test_deferred_and_immediate_paths_give_the_same_bytes(moe):
    x, ids, weights = _inputs(seed=3)
    pipe = ExpertPipeline("cpu", worker=True)
    try:
        later = pipe.submit(moe, x, ids, weights)
        assert torch.equal(later.result(), pipe.run(moe, x, ids, weights))
        assert pipe.in_flight == 0
    finally:
        pipe.shutdown()


def test_deferred_experts_overlap_the_next_layers_attention(ckpt):
    """Layer 0's deferred experts wait until layer 1's attention has started: a pipeline that ran them
    before moving on would never see it start, and the forward would fail."""
    llm = _llm(ckpt, defer=1)
    engine = llm.engine
    attn_started = threading.Event()
    jobs = []
    layers = engine.runner.model.model.layers
    hook = layers[1].self_attn.register_forward_pre_hook(lambda m, a: attn_started.set())
    real = engine.layer_experts[0].compute_host

    def waits_for_attention(*a, **kw):
        if threading.current_thread().name.startswith("moegate-experts"):
            if not attn_started.wait(timeout=60):
                raise AssertionError("layer 1's attention never started while layer 0's experts ran")
            jobs.append(True)
            attn_started.clear()
        return real(*a, **kw)

    engine.layer_experts[0].compute_host = waits_for_attention
    try:
        out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    finally:
        hook.remove()
        engine.runner.shutdown()
    assert len(out.token_ids) == 4 and len(jobs) == 4  # layer 0 defers once per forward: prefill + 3 decodes


def test_expert_thread_error_fails_the_step_and_the_pipeline_recovers(ckpt):
    llm = _llm(ckpt, defer=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    want = llm.generate([[3, 1, 4, 1, 5]], params)[0].token_ids
    real = engine.layer_experts[1].compute_host  # layers 0 and 1 defer, layer 2 is the last MoE layer

    def broken(*a, **kw):
        if threading.current_thread().name.startswith("moegate-experts"):
            raise RuntimeError("expert kernel exploded")
        return real(*a, **kw)

    engine.layer_experts[1].compute_host = broken
    engine.add_request("bad", [3, 1, 4, 1, 5], params)
    with pytest.raises(ExpertWorkerError, match="expert kernel exploded"):
        engine.step()
    assert engine.runner.experts.in_flight == 0  # nothing of the failed forward is left in the thread
    engine.abort("bad")
    engine.layer_experts[1].compute_host = real
    assert llm.generate([[3, 1, 4, 1, 5]], params)[0].token_ids == want
    engine.runner.shutdown()


def test_abort_cancels_queued_work_and_waits_for_the_running_job(moe):
    x, ids, weights = _inputs(seed=5)
    pipe = ExpertPipeline("cpu", worker=True)
    release, running = threading.Event(), threading.Event()
    real = moe.packed.compute_host

    def blocking(*a, **kw):
        running.set()
        assert release.wait(timeout=60)
        return real(*a, **kw)

    moe.packed.compute_host = blocking
    try:
        first = pipe.submit(moe, x, ids, weights)
        queued = pipe.submit(moe, x, ids, weights)
        assert running.wait(timeout=60)
        aborter = threading.Thread(target=pipe.abort)
        aborter.start()
        deadline = time.monotonic() + 60
        while not queued.future.cancelled():  # abort cancels what has not started ...
            assert time.monotonic() < deadline, "abort did not cancel the queued job"
            time.sleep(0.01)
        assert aborter.is_alive()  # ... and waits for the running one
        release.set()
        aborter.join(timeout=60)
        assert not aborter.is_alive() and first.future.done() and pipe.in_flight == 0
        with pytest.raises(ExpertWorkerError, match="aborted"):
            queued.result()
    finally:
        del moe.packed.compute_host
    after = pipe.submit(moe, x, ids, weights)  # the pipeline serves again after an abort
    assert torch.equal(after.result(), ExpertPipeline("cpu").run(moe, x, ids, weights))
    pipe.shutdown()
