"""Prefix cache in the engine: hits equal misses, salts isolate, tiers demote/promote, accounting stays exact."""

from __future__ import annotations

import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams

BLOCK = 4
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # [L=2, K/V, block, KV heads=2, D=16] fp32


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(path, **kw) -> LLMEngine:
    args = dict(num_kv_blocks=128, block_size=BLOCK, max_num_batched_tokens=32, progress=False)
    return LLMEngine(EngineConfig(str(path), **{**args, **kw}))


def _run(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int = 6, **kw):
    """-> (final output, raw bytes of every logits row the request sampled from)."""
    rows: list[bytes] = []

    def record(_tokens, row):
        rows.append(row.numpy().tobytes())
        return row

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logits_processors=[record])
    engine.add_request(rid, prompt, params, **kw)
    final = None
    while engine.has_work():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                final = out
    return final, rows


def test_exact_hit_is_bit_identical_to_a_cold_run(hf_checkpoint):
    path = hf_checkpoint("qwen3_moe")
    prompt = _prompt(100, 0)
    sibling = prompt[:70] + _prompt(30, 1)  # shares two whole chunks of 32 and a bit more
    cold = _engine(path, prefix_cache=False)
    want = {name: _run(cold, name, p, mode="execution") for name, p in (("p", prompt), ("s", sibling))}
    eng = _engine(path)
    first, first_rows = _run(eng, "a", prompt, mode="execution")
    assert first.num_cached_tokens == 0 and first_rows == want["p"][1]
    hit, rows = _run(eng, "b", prompt, mode="execution")
    assert hit.num_cached_tokens == 96  # whole chunks only: [96, 100) is the cold run's last chunk
    assert rows == want["p"][1] and hit.token_ids == want["p"][0].token_ids
    sib, sib_rows = _run(eng, "c", sibling, mode="execution")
    assert sib.num_cached_tokens == 64
    assert sib_rows == want["s"][1] and sib.token_ids == want["s"][0].token_ids


def test_execution_hit_under_load_is_bit_identical(hf_checkpoint):
    path = hf_checkpoint("qwen3_moe")
    prompt = _prompt(70, 11)
    _, want = _run(_engine(path, prefix_cache=False), "cold", prompt, mode="execution")
    eng = _engine(path)
    _run(eng, "warm", prompt, mode="execution")
    for i in range(3):  # exploration traffic in flight while the execution request hits
        eng.add_request(f"x{i}", _prompt(20 + 7 * i, 50 + i), SamplingParams(max_tokens=12, ignore_eos=True))
    eng.step()
    hit, rows = _run(eng, "hit", prompt, mode="execution")
    assert hit.num_cached_tokens == 64 and rows == want


def test_mode_switch_reroots_or_stops_caching(hf_checkpoint):
    eng = _engine(hf_checkpoint("qwen3_moe"))
    prompt = _prompt(40, 12)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    eng.add_request("keep", prompt, params)
    eng.step()
    eng.step()
    seq = eng._seqs["keep"]
    eng.set_mode("keep", "execution", resync="keep")  # KV of both modes: nothing more is cached
    assert seq.cache_root is None
    eng.add_request("recompute", _prompt(40, 13), params)
    eng.step()
    eng.set_mode("recompute", "execution", resync="recompute")  # all recomputed strictly: cached as execution
    while eng.has_work():
        eng.step()
    out, _ = _run(eng, "again", _prompt(40, 13), mode="execution")
    assert out.num_cached_tokens == 32  # whole chunks of the recomputed execution KV
    out, _ = _run(eng, "explore", _prompt(40, 13))
    assert out.num_cached_tokens == 32  # only the chunk it computed in exploration, before the switch


def test_default_hit_gives_the_same_greedy_tokens(hf_checkpoint):
    path = hf_checkpoint("qwen2_moe")
    system = _prompt(60, 2)
    turns = [system + _prompt(n, 10 + n) for n in (5, 9, 14)]
    cold = _engine(path, prefix_cache=False)
    want = [_run(cold, f"c{i}", p)[0].token_ids for i, p in enumerate(turns)]
    eng = _engine(path)
    outs = [_run(eng, f"r{i}", p)[0] for i, p in enumerate(turns)]
    assert [o.token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0, 60, 60]
    # A multi-turn follow-up: the previous prompt + its answer + a new message reuses the answer's blocks too.
    follow = turns[2] + outs[2].token_ids + _prompt(7, 3)
    out, _ = _run(eng, "f", follow)
    assert out.num_cached_tokens == (len(turns[2]) + len(outs[2].token_ids) - 1) // BLOCK * BLOCK
    assert out.token_ids == _run(cold, "cf", follow)[0].token_ids


def test_tenants_never_share_blocks(hf_checkpoint):
    eng = _engine(hf_checkpoint("qwen3_moe"))
    prompt = _prompt(50, 4)
    assert _run(eng, "a1", prompt, cache_salt="tenant-a")[0].num_cached_tokens == 0
    assert _run(eng, "b1", prompt, cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert _run(eng, "a2", prompt, cache_salt="tenant-a")[0].num_cached_tokens == 48
    eng.prefix_cache.evict("device")  # the same holds for blocks demoted to RAM
    assert _run(eng, "c1", prompt, cache_salt="tenant-c")[0].num_cached_tokens == 0
    out = _run(eng, "b2", prompt, cache_salt="tenant-b")[0]
    assert out.num_cached_tokens == 48 and out.cache_hits == {"ram": 12}


def test_exploration_kv_never_serves_an_execution_request(hf_checkpoint):
    eng = _engine(hf_checkpoint("qwen3_moe"))
    prompt = _prompt(80, 5)
    _run(eng, "explore", prompt, cache_salt="t")
    hits_before = eng.cache_stats()["device"]["hits"]
    out = _run(eng, "execute", prompt, cache_salt="t", mode="execution")[0]
    assert out.num_cached_tokens == 0 and eng.cache_stats()["device"]["hits"] == hits_before
    assert _run(eng, "explore2", prompt, cache_salt="t")[0].num_cached_tokens == 76  # its own mode still hits


def test_ram_hit_after_device_eviction_and_stats(hf_checkpoint):
    path = hf_checkpoint("mixtral")
    prompt = _prompt(40, 6)
    cold = _engine(path, prefix_cache=False)
    want = _run(cold, "c", prompt)[0].token_ids
    # 16 blocks: the second prompt's allocation takes the first one's cached blocks and demotes them.
    eng = _engine(path, num_kv_blocks=16)
    _run(eng, "a", prompt)
    _run(eng, "b", _prompt(40, 7))
    stats = eng.cache_stats()
    assert stats["device"]["evictions"] > 0 and stats["ram"]["entries"] > 0
    out = _run(eng, "a2", prompt)[0]
    assert out.token_ids == want and out.cache_hits.get("ram", 0) > 0
    assert eng.cache_stats()["ram"]["hits"] == out.cache_hits["ram"]
    assert eng.blocks.num_free == 16


def test_corrupt_disk_entry_is_recomputed_and_disk_survives_restart(hf_checkpoint, tmp_path):
    path = hf_checkpoint("qwen3_moe")
    prompt = _prompt(60, 8)
    want = _run(_engine(path, prefix_cache=False), "c", prompt)[0].token_ids
    disk = dict(ram_cache_gib=0, disk_cache_dir=str(tmp_path))
    first = _engine(path, **disk)
    _run(first, "a", prompt)
    first.close()  # writes the cached blocks to disk
    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) == 16  # (60 prompt + 6 output - 1 never computed) // 4 full blocks
    restarted = _engine(path, **disk)
    out = _run(restarted, "b", prompt)[0]
    assert out.token_ids == want and out.cache_hits == {"disk": 59 // BLOCK}
    restarted.close()

    # Damage the entry of block 5 of the prompt: blocks 0-4 are served, the rest recomputed.
    third = _engine(path, **disk)
    key = _block_keys(third, prompt, "")[5]
    victim = next(f for f in files if f.stem == key)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    out = _run(third, "d", prompt)[0]
    assert out.token_ids == want and out.num_cached_tokens == 5 * BLOCK
    assert third.cache_stats()["disk"]["corrupt"] == 1 and not victim.exists()


def _block_keys(engine: LLMEngine, prompt: list[int], salt: str) -> list[str]:
    keys: list[str] = []
    pc = engine.prefix_cache
    pc.hasher.extend(keys, pc.salt_root(salt, engine.numerics_fingerprint("exploration"), False), prompt, len(prompt) // BLOCK)
    return keys


def test_tiers_stay_within_their_configured_sizes(hf_checkpoint, tmp_path):
    ram_blocks, disk_entries = 6, 10
    disk_entry_bytes = BLOCK_BYTES + 400  # header
    eng = _engine(hf_checkpoint("qwen3_moe"), num_kv_blocks=24, ram_cache_gib=ram_blocks * BLOCK_BYTES / 2**30,
                  disk_cache_dir=str(tmp_path), disk_cache_gib=disk_entries * disk_entry_bytes / 2**30)
    for i in range(8):
        _run(eng, f"r{i}", _prompt(40, 20 + i))
        stats = eng.cache_stats()
        assert stats["ram"]["bytes"] <= ram_blocks * BLOCK_BYTES
        assert stats["device"]["entries"] <= 24
    eng.prefix_cache.drain()
    stats = eng.cache_stats()
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*.kv"))
    assert stats["disk"]["bytes"] == on_disk <= disk_entries * disk_entry_bytes
    assert stats["ram"]["evictions"] > 0 and stats["disk"]["evictions"] > 0
    assert eng.blocks.num_free == 24


def test_shared_prefixes_under_preemption_and_abort_keep_block_accounting_exact(hf_checkpoint):
    eng = _engine(hf_checkpoint("qwen3_moe"), num_kv_blocks=40, max_num_batched_tokens=24)
    system = _prompt(24, 30)
    for i in range(8):
        eng.add_request(f"r{i}", system + _prompt(3 + 2 * i, 40 + i), SamplingParams(max_tokens=20, ignore_eos=True))
    seqs = list(eng._seqs.values())
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        if steps == 6:
            eng.abort("r2")
        referenced = {b for s in eng.scheduler.running for b in s.block_table}
        assert eng.blocks.num_used() == len(referenced)
        for b in referenced:  # a block's reference count is the number of tables holding it
            assert eng.blocks._refs[b] == sum(s.block_table.count(b) for s in eng.scheduler.running)
    assert sum(s.num_preemptions for s in seqs) > 0
    assert sum(s.num_cached_tokens > 0 for s in seqs) > 0
    assert eng.blocks.num_free == 40 and eng.blocks.num_used() == 0


def test_disk_entries_of_other_code_are_not_served(hf_checkpoint, tmp_path, monkeypatch):
    """KV a build with other kernel or model code stored (another release, another SIMD build) is not served:
    the code is part of the numerics fingerprint that roots every chain."""
    import engine.llm_engine as llm_engine
    from engine.identity import code_identity

    path = hf_checkpoint("qwen3_moe")
    prompt = _prompt(60, 8)
    disk = dict(ram_cache_gib=0, disk_cache_dir=str(tmp_path))
    first = _engine(path, **disk)
    want = _run(first, "a", prompt)[0].token_ids
    fingerprint = first.numerics_fingerprint("execution")
    first.close()
    monkeypatch.setattr(llm_engine, "code_identity", lambda: code_identity() + "-next-release")
    upgraded = _engine(path, **disk)
    assert upgraded.numerics_fingerprint("execution") != fingerprint
    out = _run(upgraded, "b", prompt)[0]
    assert out.token_ids == want and out.cache_hits.get("disk", 0) == 0 and out.num_cached_tokens == 0
    upgraded.close()
    monkeypatch.undo()
    same = _engine(path, **disk)  # the code that stored them: served
    assert same.numerics_fingerprint("execution") == fingerprint
    assert _run(same, "c", prompt)[0].cache_hits == {"disk": 59 // BLOCK}


def test_code_identity_names_the_kernel_build(monkeypatch):
    from engine.identity import code_identity

    monkeypatch.setenv("MOEGATE_DISABLE_CPP", "1")
    torch_only = code_identity()
    monkeypatch.delenv("MOEGATE_DISABLE_CPP")
    monkeypatch.setenv("MOEGATE_KERNEL_VARIANT", "generic")
    generic = code_identity()
    monkeypatch.setenv("MOEGATE_KERNEL_VARIANT", "avx2")
    assert len({torch_only, generic, code_identity()}) == 3
    assert code_identity() == code_identity()


def test_a_step_that_completes_no_block_hashes_nothing(hf_checkpoint, monkeypatch):
    """Registration after a step hashes (and joins the sequence's token list) only where the step completed a block:
    most decode steps complete none. The chain it keeps is the whole prefix's, block by block."""
    eng = _engine(hf_checkpoint("qwen3_moe"))
    cache, calls, registering = eng.prefix_cache, [], []
    real_extend, real_register = cache.hasher.extend, cache.register

    def extend(hashes, root, token_ids, num_blocks):
        if registering:
            calls.append(num_blocks - len(hashes))
        real_extend(hashes, root, token_ids, num_blocks)

    def register(seq, *args, **kw):
        registering.append(seq)
        try:
            real_register(seq, *args, **kw)
        finally:
            registering.pop()

    monkeypatch.setattr(cache.hasher, "extend", extend)
    monkeypatch.setattr(cache, "register", register)
    seqs = []
    monkeypatch.setattr(eng.scheduler, "add", lambda seq, add=eng.scheduler.add: (seqs.append(seq), add(seq))[1])
    out, _ = _run(eng, "d", _prompt(10, 3), max_tokens=13)
    assert len(out.token_ids) == 13 and calls and min(calls) > 0, calls
    seq = seqs[0]
    want: list[str] = []
    real_extend(want, seq.cache_root, [*seq.prompt_token_ids, *seq.output_token_ids], (10 + 13 - 1) // BLOCK)
    assert seq.block_hashes == want
