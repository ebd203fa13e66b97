"""LLMEngine: one step = schedule, forward, sample, detokenize, finish; and the synchronous `LLM` API."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from engine.config import ModelConfig
from engine.errors import RequestError
from engine.kv_cache import BlockManager, KVCacheSpec
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence, SeqStatus

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "auto"  # auto | cpu | cuda
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: from kv_cache_gib
    kv_cache_gib: float = 1.0
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    mask_unused_vocab: bool = True  # never sample embedding rows the tokenizer has no token for
    progress: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text released so far
    new_token_ids: list[int]  # since the previous output of this request
    new_text: str
    finished: bool
    finish_reason: str | None  # stop | length | abort


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.resolve_device()
        model_dir = Path(config.model)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = _load_tokenizer(model_dir)
        model = load_model(model_dir, dtype=config.torch_dtype, device=self.device, progress=config.progress)
        cfg = self.model_config
        spec = (
            KVCacheSpec(config.num_kv_blocks, config.block_size)
            if config.num_kv_blocks
            else KVCacheSpec.from_budget(cfg, config.kv_cache_gib, config.block_size, config.torch_dtype)
        )
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, spec.num_blocks * spec.block_size)
        self.runner = ModelRunner(model, spec, self.device, config.torch_dtype)
        self.blocks = BlockManager(spec.num_blocks, spec.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.blocks
        )
        self.eos_token_ids = set(cfg.eos_token_ids) | set(getattr(self.tokenizer, "eos_token_ids", ()) or ())
        self.vocab_limit = (
            self.tokenizer.vocab_size if self.tokenizer is not None and config.mask_unused_vocab else None
        )
        self._seqs: dict[str, Sequence] = {}
        log.info(
            "engine ready: %s (%s) on %s, dtype %s, %d KV blocks x %d tokens, max_model_len %d",
            model_dir, cfg.arch, self.device, config.dtype, spec.num_blocks, spec.block_size, self.max_model_len,
        )

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
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
            params = _with_max_tokens(params, self.max_model_len - len(prompt_token_ids))
        seq = Sequence(request_id, list(prompt_token_ids), params)
        if self.tokenizer is not None:
            seq.detokenizer = self.tokenizer.stream()
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self._seqs.pop(request_id, None)
        if seq is None or seq.is_finished:
            return None
        self.scheduler.finish(seq, "abort")
        return self._output(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def active_request_ids(self) -> list[str]:
        return list(self._seqs)

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()  # logits processors and the vocab mask edit the (inference-mode) logits in place
    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        batch = self.runner.build_batch(chunks, self.blocks)
        logits = self.runner.forward(batch)  # [S, V]
        for c in chunks:
            c.seq.num_computed = c.start + c.num_tokens
        sampling = [c.seq for c in chunks if c.samples]
        tokens = sample(logits, sampling, self.vocab_limit) if sampling else []
        outputs = []
        for seq, token in zip(sampling, tokens, strict=True):
            seq.output_token_ids.append(token)
            reason = self._check_stop(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._seqs.pop(seq.request_id, None)
            outputs.append(self._output(seq))
        return outputs

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        is_eos = token in self.eos_token_ids and not p.ignore_eos
        if seq.detokenizer is not None and not is_eos and token not in p.stop_token_ids:
            seq.text += seq.detokenizer.push(token)
            for stop in p.stop:
                at = seq.text.find(stop, max(0, seq.emitted - len(stop)))
                if at >= 0:
                    seq.text = seq.text[:at]
                    return "stop"
        if is_eos or token in p.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            if seq.detokenizer is not None:
                seq.text += seq.detokenizer.flush()
            return "length"
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.is_finished
        release = len(seq.text) if finished else len(seq.text) - _stop_holdback(seq.text, seq.params.stop)
        new_text = seq.text[seq.emitted : release] if release > seq.emitted else ""
        seq.emitted = max(seq.emitted, release)
        prev = getattr(seq, "_reported_tokens", 0)
        seq._reported_tokens = len(seq.output_token_ids)  # type: ignore[attr-defined]
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=seq.text[: seq.emitted],
            new_token_ids=seq.output_token_ids[prev:],
            new_text=new_text,
            finished=finished,
            finish_reason=seq.finish_reason,
        )


def _stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that could still grow into a stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if stop.startswith(text[-n:]):
                hold = n
                break
    return hold


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, max_tokens=max(1, max_tokens))


def _load_tokenizer(model_dir: Path):
    if not (model_dir / "tokenizer.json").is_file():
        log.warning("%s has no tokenizer.json: prompts must be token ids and no text is produced", model_dir)
        return None
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


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
