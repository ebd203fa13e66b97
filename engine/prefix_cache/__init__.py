"""Three-tier prefix cache: KV blocks keyed by a salted hash chain, kept on the device, in RAM, on disk, in redis."""

from engine.prefix_cache.base import CacheTier, CorruptEntry, TierStats
from engine.prefix_cache.hashing import BlockHasher, default_disk_cache_dir, model_fingerprint
from engine.prefix_cache.manager import PrefixCacheConfig, PrefixCacheManager

__all__ = [
    "BlockHasher", "CacheTier", "CorruptEntry", "PrefixCacheConfig", "PrefixCacheManager", "TierStats",
    "default_disk_cache_dir", "model_fingerprint",
]
