"""LLMEngine: one step = schedule, forward, sample, detokenize, finish; and the synchronous `LLM` API."""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Sequence as Seq
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.errors import RequestError
from engine.gguf_tokenizer import load_model_tokenizer
from engine.hot_experts import HotSetUpdater
from engine.identity import checkpoint_identity, code_identity
from engine.kv_cache import BlockManager, KVCacheSpec
from engine.layerwise_prefill import LayerwisePrefill
from engine.loader import load_model
from engine.mode import Mode
from engine.model_runner import ModelRunner
from engine.mtp import MtpDrafter
from engine.multi_token import MultiTokenDecoder
from engine.output import RequestOutput, finish_text, make_output, push_token, record_switch
from engine.placement_plan import PlacementPlan, apply_numa
from engine.prefix_cache import BlockHasher, PrefixCacheConfig, PrefixCacheManager, model_fingerprint
from engine.prefix_cache.entry import EntryCodec
from engine.recurrent_state import RecurrentStates
from engine.sampler import SamplingError
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from engine.segments import SegmentTracker
from engine.sequence import SeqStatus, Sequence

log = logging.getLogger(__name__)

class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.resolve_device()
        model_dir = Path(config.model)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = load_model_tokenizer(model_dir)
        cfg = self.model_config
        numerics = config.numerics
        if numerics.defer and numerics.defer > cfg.top_k // 2:
            raise ValueError(f"defer={numerics.defer} must be at most top_k/2 = {cfg.top_k // 2}")
        self.placement_plan = PlacementPlan.build(cfg, numerics.experts, self.device)
        model = load_model(model_dir, dtype=config.torch_dtype, progress=config.progress,
                           placement=numerics.experts, plan=self.placement_plan, mtp=config.multi_token.mtp)
        self.layer_experts = {i: layer.mlp.experts.packed for i, layer in enumerate(model.model.layers)
                              if layer.is_moe and layer.mlp.experts.packed is not None}
        for le in self.layer_experts.values():
            le.num_threads = torch.get_num_threads()  # the kernel's own pool, whatever torch uses
        self.numa_plan = apply_numa(self.layer_experts)  # more than one node: bind shards
        self.hot_set = HotSetUpdater.build(self.layer_experts, numerics.experts, model.expert_reader, self.device)
        if numerics.exact_lm_head:
            model.exact_lm_head = model.lm_head.weight.detach().float().clone()
        if numerics.fast_lm_head:
            from engine.models.causal_lm import QuantizedLMHead

            model.fast_lm_head = QuantizedLMHead(model.lm_head.weight, numerics.fast_lm_head)
        if numerics.fast_dense and self.device.type == "cpu":
            for layer in tqdm(model.model.layers, desc=f"pack attention {numerics.fast_dense}", leave=False,
                              disable=not config.progress):
                layer.mixer.set_fast_dense(numerics.fast_dense)
            if numerics.fused and config.dtype == "float32":
                from engine.models.fused_decode import build_fused_layers

                model.fused_layers = build_fused_layers(cfg, model.model.layers)
        elif numerics.fast_dense:
            log.warning("fast_dense=%s packs CPU attention projections; on %s the model's own weights run",
                        numerics.fast_dense, self.device)
        if numerics.exact_fused and self.device.type == "cpu" and config.dtype == "float32":
            from engine.models.fused_decode import build_exact_path

            build_exact_path(model)  # else each execution chunk runs alone on torch
        log.info("%s", self.placement_plan.summary(model))
        self.placement = self.placement_plan.describe(model)  # what /v1/models reports
        self.fused_decode = model.fused_layers is not None  # small exploration batches: one call per layer
        self.numerics = numerics.resolved(self.device.type, self.fused_decode,  # what runs, per mode
                                          bool(model.batch_invariant(True)))
        ident = f"{checkpoint_identity(model_dir)}:{code_identity()}"  # the weights and the code computing on them
        self._identity = hashlib.sha256(ident.encode()).hexdigest()[:16]
        spec = (
            KVCacheSpec(config.num_kv_blocks, config.block_size)
            if config.num_kv_blocks
            else KVCacheSpec.from_budget(cfg, config.kv_cache_gib, config.block_size, config.torch_dtype)
        )
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, spec.num_blocks * spec.block_size)
        states = RecurrentStates.build(cfg, config.max_num_seqs, config.state_snapshots, config.prefix_cache,
                                       spec.block_size, self.device)  # linear-attention layers (Qwen3-Next)
        self.runner = ModelRunner(model, spec, self.device, config.torch_dtype, defer=numerics.defer, states=states)
        self.runner.experts.layerwise = LayerwisePrefill.build(self.layer_experts, self.numerics.layerwise_tokens,
                                                               self.device, config.torch_dtype)
        self.blocks = BlockManager(spec.num_blocks, spec.block_size)
        self._fingerprint = model_fingerprint(model_dir, config.dtype, self._numerics())
        self.prefix_cache = self._build_prefix_cache(spec) if config.prefix_cache else None
        self._closed_cache_stats: dict[str, dict[str, int]] = {}
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.blocks, self.prefix_cache,
            states,
        )
        self.eos_token_ids = set(cfg.eos_token_ids) | set(getattr(self.tokenizer, "eos_token_ids", ()) or ())
        self.vocab_limit = (
            self.tokenizer.vocab_size if self.tokenizer is not None and config.mask_unused_vocab else None
        )
        self.runner.vocab_limit = self.vocab_limit
        self._seqs: dict[str, Sequence] = {}
        self.decoder = MultiTokenDecoder(config.multi_token, bool(model.batch_invariant(True)), rollback=states is None,
                                         drafter=MtpDrafter.build(config.multi_token, self.runner, self.blocks))
        log.info(
            "engine ready: %s (%s) on %s, dtype %s, %d KV blocks x %d tokens, max_model_len %d; %s; "
            "exploration defers %d expert(s)/token",
            model_dir, cfg.arch, self.device, config.dtype, spec.num_blocks, spec.block_size, self.max_model_len,
            numerics.experts.describe() if numerics.experts else "experts unpacked (torch reference)",
            numerics.defer,
        )

    def _numerics(self) -> str:  # per-mode settings salt each request
        return f"kv_dtype={self.config.dtype};block_size={self.config.block_size}"

    def _build_prefix_cache(self, spec: KVCacheSpec) -> PrefixCacheManager:
        c, m = self.config, self.model_config
        tensors, heads, width = m.kv_cache_layout
        shape = (len(m.kv_layers), tensors, spec.block_size, heads, width)
        return PrefixCacheManager(
            PrefixCacheConfig(
                ram_bytes=int(c.ram_cache_gib * 2**30), disk_dir=c.disk_cache_dir,
                disk_bytes=int(c.disk_cache_gib * 2**30), redis_url=c.redis_url, redis_ttl_s=c.redis_cache_ttl_s,
                exact_chunk=c.max_num_batched_tokens, chunk_invariant=self.runner.model.batch_invariant(True),
            ),
            self.blocks, self.runner, BlockHasher(self._fingerprint, spec.block_size),
            EntryCodec(self._fingerprint, shape, c.torch_dtype), states=self.runner.states,
        )

    @property
    def fingerprint(self) -> str:
        """sha256 of the checkpoint identity, dtype and KV layout: names disk/redis entries and roots every chain.

        What differs per mode (precision profile, deferral, chunking) enters each request's chain through
        `numerics_fingerprint(mode)`.
        """
        return self._fingerprint

    def cache_stats(self) -> dict[str, dict[str, int]]:
        """Per-tier prefix cache counters (hits, misses, bytes, entries, evictions, writes, corrupt, errors)."""
        return self.prefix_cache.stats() if self.prefix_cache is not None else self._closed_cache_stats

    def close(self) -> None:
        """Writes the cached blocks to the durable tiers (disk, redis) and stops the writer."""
        if self.hot_set is not None:
            self.hot_set.close()
        if self.prefix_cache is not None:
            self.prefix_cache.flush()
            self.prefix_cache.close()
            self._closed_cache_stats = self.prefix_cache.stats()
            self.prefix_cache = self.scheduler.prefix = None

    # -- numerics ------------------------------------------------------------------------------
    def numerics_fingerprint(self, mode: Mode = Mode.EXECUTION) -> str:
        """Identifies what computes a token in `mode` (`self.numerics`, the model, its dtype): the root of its
        prefix-cache chains and the responses' `system_fingerprint`."""
        c = self.config
        return self.numerics.fingerprint(mode, self._identity, c.dtype, c.max_num_batched_tokens,
                                         self.hot_set.digest() if self.hot_set is not None else None)

    def set_deferral(self, defer: int) -> None:
        """Changes exploration's expert deferral from the next step on (the execution profile never defers);
        `numerics_fingerprint("exploration")` names the new setting (see `_exploration_numerics_changed`)."""
        if not 0 <= defer <= self.model_config.top_k // 2:
            raise ValueError(f"defer={defer} must be in [0, top_k/2 = {self.model_config.top_k // 2}]")
        if defer == self.numerics.defer:
            return
        self.config = replace(self.config, numerics=self.config.numerics.with_defer(defer), defer=defer)
        self.numerics = self.numerics.with_defer(defer)
        self.runner.set_defer(defer)
        self._exploration_numerics_changed()
        log.info("exploration defers %d expert(s)/token from the next step", defer)

    def _exploration_numerics_changed(self) -> None:
        """Exploration's numerics changed (deferral, hot set): sequences that have computed nothing yet are
        re-rooted under the new fingerprint; those part-way keep their KV but stop registering prefix-cache
        blocks, whose KV would mix the two settings."""
        for seq in self._seqs.values():
            if seq.mode == Mode.EXECUTION or seq.cache_root is None or self.prefix_cache is None:
                continue
            seq.block_hashes.clear()
            fresh = not seq.block_table and seq.num_computed == 0
            seq.cache_root = self.prefix_cache.salt_root(seq.cache_salt, self.numerics_fingerprint(Mode.EXPLORATION),
                                                         seq.cache_exact) if fresh else None

    def set_mode(self, request_id: str, mode: Mode, resync: str = "keep") -> None:
        """Switches a sequence's mode at the next token boundary.

        resync="recompute" on a switch to execution drops the sequence's KV so it is recomputed
        strictly: the execution segment then equals an all-strict run. "keep" reuses the KV.
        """
        mode = Mode.parse(mode)
        if resync not in ("keep", "recompute"):
            raise ValueError(f"resync must be keep or recompute, got {resync!r}")
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._switch(seq, mode, resync)

    def _switch(self, seq: Sequence, mode: Mode, resync: str) -> bool:
        """`seq` runs in `mode` from its next token; False when it already did."""
        if seq.mode == mode:
            return False
        seq.mode = mode
        seq.mode_switches.append((len(seq.output_token_ids), mode))
        recompute = mode == Mode.EXECUTION and resync == "recompute" and seq.num_computed
        if recompute and seq.status is SeqStatus.RUNNING:
            self.scheduler.drop_kv(seq)
        if self.prefix_cache is not None:
            # Recomputed KV is all in the new mode: it is cached under that mode's chain. Kept KV mixes
            # both modes: its later blocks are not cached at all.
            seq.block_hashes.clear()
            seq.cache_exact = mode == Mode.EXECUTION
            seq.cache_root = self.prefix_cache.salt_root(seq.cache_salt, self.numerics_fingerprint(mode),
                                                         seq.cache_exact) if recompute else None
        return True

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, mode: Mode = Mode.EXPLORATION,
        *, cache_salt: str = "",
    ) -> None:
        """Queues a request. `cache_salt` is set by the server (the tenant), never by a client: prefix-cache
        blocks are only reused between requests with the same salt and the same `numerics_fingerprint(mode)`.
        Execution requests reuse whole prefill chunks only, so a hit is bit-identical to a miss; on the chunk-
        invariant fused execution path, any full block (a token's KV there does not depend on its chunk).
        """
        if request_id in self._seqs:
            raise RequestError(f"request id {request_id!r} is already in flight")
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        total = len(prompt_token_ids) + params.max_tokens
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt of {len(prompt_token_ids)} tokens does not fit the model's context "
                f"({self.max_model_len} tokens)"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}")
        if total > self.max_model_len:
            params = replace(params, max_tokens=max(1, self.max_model_len - len(prompt_token_ids)))
        try:
            mode = Mode.parse(mode)
        except ValueError as e:
            raise RequestError(str(e)) from None
        seq = Sequence(request_id, list(prompt_token_ids), params, mode=mode)
        if self.prefix_cache is not None:
            seq.cache_salt, seq.cache_exact = cache_salt, mode == Mode.EXECUTION
            seq.cache_root = self.prefix_cache.salt_root(cache_salt, self.numerics_fingerprint(mode), seq.cache_exact)
        if self.tokenizer is not None:
            seq.detokenizer = self.tokenizer.stream()
        if params.segments is not None:  # its constraint masks after the request's own processors
            seq.segments = SegmentTracker(params.segments)
            seq.params = replace(params, logits_processors=[*params.logits_processors, seq.segments])
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def _fail(self, seq: Sequence, message: str) -> None:
        log.warning("request %s failed: %s", seq.request_id, message)
        seq.error = message
        self.scheduler.finish(seq, "error")
        self._seqs.pop(seq.request_id, None)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self._seqs.pop(request_id, None)
        if seq is None or seq.is_finished:
            return None
        self.scheduler.finish(seq, "abort")
        return make_output(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def active_request_ids(self) -> list[str]:
        return list(self._seqs)

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        # No inference mode around the step (~50 us after the kernels): the batch forward has its own, the fused step
        # writes through numpy, the sampler enters one where it edits logits in place; plain greedy rows use no tensor
        if self.hot_set is not None and self.scheduler.has_work():
            with torch.inference_mode():
                if self.hot_set.between_steps():
                    if self.runner.experts.layerwise is not None:
                        self.runner.experts.layerwise.reset()  # resident copies hold the old hot set
                    self._exploration_numerics_changed()
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        logits = self.runner.run(chunks, self.blocks)  # [S, V]: 1 + drafts rows per sampling chunk
        seqs: list[Sequence] = []
        for c in chunks:
            (seq := c.seq).num_computed = c.start + c.num_tokens
            if c.samples:
                seqs.append(seq)
        sampling = chunks if len(seqs) == len(chunks) else [c for c in chunks if c.samples]
        picks = self.decoder.choose(logits, seqs, self.vocab_limit, self.runner.first_max)  # drafts verified
        cache, alone, reasons, going = self.prefix_cache, len(chunks) == 1, {}, []  # reasons: request id -> why
        if cache is not None and sampling is not chunks:
            for c in chunks:
                if not c.samples:
                    self._register(c, alone)
        for c, pick in zip(sampling, picks, strict=True):
            seq, reason = c.seq, None
            if isinstance(pick, SamplingError):
                self._fail(seq, str(pick))
                continue
            for token in pick:
                seq.output_token_ids.append(token)
                if (reason := self._advance(seq, token)) is not None:
                    break
            if cache is not None:
                self._register(c, alone)  # accepted drafts are in the output now: the blocks hash them
            if reason is None:
                going.append(seq)
            else:
                reasons[seq.request_id] = reason
        if self.decoder.extends:
            self.decoder.observe(chunks, self.runner.hidden, going)  # MTP drafts: its layer over the kept positions
            reasons.update(self.decoder.extend(going, self._advance))  # forced tokens (all masks together) or drafts
        if reasons:
            for seq in seqs:
                if (reason := reasons.get(seq.request_id)) is not None:
                    self.scheduler.finish(seq, reason)
                    self._seqs.pop(seq.request_id, None)
        return [make_output(seq) for seq in seqs]

    def _register(self, c: ScheduledChunk, alone: bool) -> None:
        """Names the prefix-cache blocks the chunk completed (up to what the sequence kept of it); with a cache only."""
        n = min(c.seq.num_computed, c.seq.num_tokens) - c.start
        self.prefix_cache.register(c.seq, c.start, n, alone=alone or c.seq.mode == Mode.EXECUTION)

    def _advance(self, seq: Sequence, token: int) -> str | None:
        """Text, stop conditions and mode switches after `seq` sampled `token`; the finish reason, if any.
        A switch applies before the sequence's next forward, so the next token is computed in the new mode."""
        p = seq.params
        is_end = (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        stopped, switch = push_token(seq, token, is_end)
        if stopped or is_end:
            reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        else:
            reason = None
        if reason is not None and not stopped:
            finish_text(seq)  # an unfinished character at the end becomes U+FFFD, as in a full decode
        if switch is not None:
            record_switch(seq, switch, reason is None and self._switch(seq, switch.mode, p.resync), self.tokenizer)
        elif reason is None and token in p.mode_triggers:
            self._switch(seq, p.mode_triggers[token], p.resync)
        return reason


class LLM:
    """Synchronous offline API: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | Path, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        params_list = list(params) if isinstance(params, Seq) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        ids = []
        for prompt, p in zip(prompts, params_list, strict=True):
            rid = uuid.uuid4().hex
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise RequestError("this checkpoint has no tokenizer: pass token ids")
                prompt = self.tokenizer.encode(prompt)
            self.engine.add_request(rid, prompt, p)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not progress)
        while self.engine.has_work():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [final[i] for i in ids]


__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams", "SeqStatus"]
