"""PrefixCacheManager: matches a sequence's prompt blocks across the tiers, promotes hits, demotes evictions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.kv_cache import BlockManager
from engine.prefix_cache.base import CacheTier, TierStats
from engine.prefix_cache.disk import DiskTier
from engine.prefix_cache.entry import EntryCodec
from engine.prefix_cache.hashing import BlockHasher
from engine.prefix_cache.ram import RamTier
from engine.prefix_cache.writer import BackgroundWriter
from engine.recurrent_state import RecurrentStates
from engine.sequence import Sequence


@dataclass(frozen=True)
class PrefixCacheConfig:
    ram_bytes: int = 2**30  # 0: no RAM tier
    disk_dir: str | None = None  # None: no disk tier
    disk_bytes: int = 8 * 2**30
    redis_url: str | None = None  # None: no redis tier
    redis_ttl_s: int = 24 * 3600
    exact_chunk: int = 512  # prefill chunk of exact requests: reuse only whole chunks (see `attach`)
    # exact KV does not depend on how a prompt is chunked or batched (the fused execution path): exact requests then
    # reuse and register any full block, as exploration ones do
    chunk_invariant: bool = False
    write_queue_bytes: int = 256 * 2**20  # per lower tier: pending writes beyond this are dropped (counted)

    def __post_init__(self) -> None:
        if min(self.ram_bytes, self.disk_bytes, self.redis_ttl_s, self.write_queue_bytes) < 0 or self.exact_chunk < 1:
            raise ValueError(f"prefix cache sizes must be >= 0: {self}")


class KVBlockIO(Protocol):
    def read_block(self, block: int) -> torch.Tensor:
        """A copy on the CPU of one block's KV: [L, 2, block_size, KV heads, D]."""
        ...

    def write_block(self, block: int, kv: torch.Tensor) -> None: ...


class PrefixCacheManager:
    """The device tier is the KV pool itself (registered blocks in the `BlockManager`); the tiers below hold
    copies. Lookup walks device -> RAM -> disk -> redis per block and stops at the first block no tier has.

    Writes below RAM run on one background writer per tier (a slow or hung tier never holds up another,
    nor the engine), each with a bounded queue that drops (and counts) what does not fit. RAM and disk
    are written back: a block reaches them when it is evicted above. Shared tiers (redis) are written
    through: a block is queued for them as soon as a forward completes it, so another replica can reuse
    it while this one still holds it.

    Exact (execution-mode) requests: CPU GEMMs give a row different bits depending on how many rows share
    the call, so a suffix computed from a mid-chunk offset would not match a cold prefill bit for bit.
    Exact sequences therefore only register blocks of whole, aligned, single-sequence prefill chunks and
    only reuse whole chunks, so the hit computes exactly the cold run's last chunk. Where the execution path
    computes each row in an order fixed by the row alone (`chunk_invariant`: the fused execution path, whose
    numerics fingerprint differs from the serial path's), a token's KV is the same whatever chunk or batch
    computed it, so exact sequences reuse and register every full block, their outputs' blocks included.
    """

    def __init__(self, config: PrefixCacheConfig, blocks: BlockManager, io: KVBlockIO, hasher: BlockHasher,
                 codec: EntryCodec, states: RecurrentStates | None = None) -> None:
        self.config = config
        self.states = states  # linear-attention models: a hit needs the recurrent state at its boundary
        self.blocks = blocks
        self.io = io
        self.hasher = hasher
        self.codec = codec
        self.device_stats = TierStats()
        self._forced_device_evictions = 0
        self.ram = RamTier(config.ram_bytes) if config.ram_bytes else None
        lower: list[CacheTier] = []
        if config.disk_dir:
            lower.append(DiskTier(config.disk_dir, config.disk_bytes, codec))
        if config.redis_url:
            from engine.prefix_cache.redis_tier import RedisTier

            lower.append(RedisTier(config.redis_url, codec, config.redis_ttl_s))
        self.lower = lower  # below RAM: written in the background
        self.writers = {t.name: BackgroundWriter(config.write_queue_bytes) for t in lower}
        self.through = [t for t in lower if t.write_through]
        blocks.on_evict = self._demote_device

    @property
    def tiers(self) -> list[CacheTier]:
        return ([self.ram] if self.ram else []) + self.lower

    def tier(self, name: str) -> CacheTier | None:
        return next((t for t in self.tiers if t.name == name), None)

    def salt_root(self, salt: str, mode_fingerprint: str, exact: bool) -> bytes:
        """Chain root of a request: tenant salt, the numerics of its mode, and exact (whole-chunk) reuse."""
        return self.hasher.root(f"{salt}\x00{mode_fingerprint}\x00exact={int(exact)}")

    # -- admission -----------------------------------------------------------------------------
    def attach(self, seq: Sequence) -> None:
        """Fills an empty block table with the longest cached chain of the sequence's full blocks.

        At least one token is left to compute so the step that follows has logits to sample from.
        """
        if seq.cache_root is None or seq.block_table:
            return
        bs = self.blocks.block_size
        limit = (seq.num_tokens - 1) // bs
        per_chunk = 1
        if seq.cache_exact and not self.config.chunk_invariant:
            chunk = self.config.exact_chunk
            per_chunk = chunk // bs if chunk % bs == 0 else 0
            limit = (seq.num_tokens - 1) // chunk * per_chunk if per_chunk else 0
        self.hasher.extend(seq.block_hashes, seq.cache_root, seq.token_ids, limit)
        table, hits = seq.block_table, {}
        for key in seq.block_hashes[:limit]:
            block = self.blocks.lookup(key)
            if block is not None:
                self.blocks.acquire(block)
                table.append(block)
                self.device_stats.hits += 1
                hits["device"] = hits.get("device", 0) + 1
                continue
            self.device_stats.misses += 1
            kv, source = self._find_below(key)
            if kv is None or not self.blocks.can_allocate(1):
                break
            block = self.blocks.allocate()
            self.io.write_block(block, kv)  # promote to the device
            self.blocks.register(block, key)
            table.append(block)
            hits[source] = hits.get(source, 0) + 1
        keep = len(table) - len(table) % per_chunk if per_chunk else len(table)
        if self.states is not None:  # only up to a boundary whose recurrent state was saved
            keep = self.states.longest_hit(seq.block_hashes, keep, max(per_chunk, 1))
        if keep < len(table):
            self.blocks.free(table[keep:])
            del table[keep:]
        seq.num_computed = len(table) * bs
        seq.num_cache_checked = len(table)
        seq.num_cached_tokens = seq.num_computed
        seq.cache_hits = hits

    def detach(self, seq: Sequence) -> None:
        """Undoes `attach` for a sequence that could not be admitted after all (its blocks stay cached)."""
        self.blocks.free(seq.block_table)
        seq.num_computed = seq.num_cache_checked = seq.num_cached_tokens = 0

    def _find_below(self, key: str) -> tuple[torch.Tensor | None, str]:
        for tier in self.tiers:
            kv = tier.get(key)
            if kv is not None:
                tier.stats.hits += 1
                return kv, tier.name
            tier.stats.misses += 1
        return None, ""

    # -- after a forward -----------------------------------------------------------------------
    def register(self, seq: Sequence, start: int, num_tokens: int, alone: bool) -> None:
        """Names the blocks a chunk completed so later requests can reuse them."""
        if seq.cache_root is None:
            return
        bs, end = self.blocks.block_size, (start + num_tokens) // self.blocks.block_size
        if seq.cache_exact and not self.config.chunk_invariant:
            chunk = self.config.exact_chunk
            if not (alone and chunk % bs == 0 and start % chunk == 0 and num_tokens == chunk):
                return
            first = start // bs
        else:
            first = seq.num_cache_checked
        if end > len(seq.block_hashes):  # a block completed: most decode steps complete none (no token list joined)
            self.hasher.extend(seq.block_hashes, seq.cache_root, seq.token_ids, end)
        for i in range(first, end):
            self.blocks.register(seq.block_table[i], seq.block_hashes[i])
            if self.through:
                kv = self.io.read_block(seq.block_table[i])
                for tier in self.through:
                    self.writers[tier.name].submit(tier, seq.block_hashes[i], kv)
        seq.num_cache_checked = max(seq.num_cache_checked, end)
        if self.states is not None and (start + num_tokens) % bs == 0:  # the chunk ended block end - 1, registered
            self.states.save(seq, seq.block_hashes[end - 1])

    # -- demotion ------------------------------------------------------------------------------
    def _demote_device(self, block: int, key: str) -> None:
        """A cached device block is about to be reused: copy its KV to RAM (or straight below)."""
        if self.ram is None and not self.lower:
            return
        self._to_ram(key, self.io.read_block(block))

    def _to_ram(self, key: str, kv: torch.Tensor) -> None:
        evicted = self.ram.put(key, kv) if self.ram is not None else [(key, kv)]
        for k, v in evicted:
            self._to_lower(k, v)

    def _to_lower(self, key: str, kv: torch.Tensor, through: bool = False) -> None:
        """Queues `kv` for the write-back tiers, and for the write-through ones too when `through` (they had it
        queued when it was computed)."""
        for tier in self.lower:
            if through or not tier.write_through:
                self.writers[tier.name].submit(tier, key, kv)

    def drain(self) -> None:
        """Waits until every queued write is done."""
        for writer in self.writers.values():
            writer.flush()

    def evict(self, tier: str) -> None:
        """Pushes everything in `tier` ("device" cached-free blocks, or "ram") one level down (tests, benchmarks)."""
        if tier == "device":
            for block, key in self.blocks.forget_cached():
                self._forced_device_evictions += 1
                self._demote_device(block, key)
        elif tier == "ram" and self.ram is not None:
            for key, kv in self.ram.pop_all():
                self.ram.stats.evictions += 1
                self._to_lower(key, kv)
        self.drain()

    def flush(self) -> None:
        """Writes every cached block (device and RAM) to the durable and shared tiers and waits for the writes
        (shared tiers get them again: a write-through dropped or failed earlier is made now; redis keeps the
        first copy)."""
        if not self.lower:
            return
        for block, key in self.blocks.hashed_blocks():
            if self.ram is None or key not in self.ram:
                self._to_lower(key, self.io.read_block(block), through=True)
        if self.ram is not None:
            for key, kv in self.ram.items():
                self._to_lower(key, kv, through=True)
        self.drain()

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        for tier in self.tiers:
            tier.close()

    def stats(self) -> dict[str, dict[str, int]]:
        dev = self.device_stats
        dev.entries = self.blocks.num_hashed
        dev.bytes = dev.entries * self.codec.payload_bytes
        dev.evictions = self.blocks.evictions + self._forced_device_evictions
        out = {"device": dev.as_dict()}
        for tier in self.tiers:
            out[tier.name] = tier.stats.as_dict()
        if self.writers:
            out["writer"] = {"dropped": sum(w.dropped for w in self.writers.values())}
        return out
