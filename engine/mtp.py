"""Multi-token prediction (MTP) drafts: DeepSeek-V3's next-n layer as a draft source beside prompt lookup.

The checkpoint stores `num_nextn_predict_layers` layers past the decoder stack (`model.layers.{L}.*`, L =
num_hidden_layers). The first one drafts here. At position i it reads the main model's last hidden state h_i
(after the final norm, as vLLM's and SGLang's proposers take it) and the next token t_{i+1}:

    x_i = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))     (the embedding is zero at position 0, as vLLM)
    y_i = decoder_layer(x_i)                                    (MLA attention over its own cache, then the MoE)
    logits for t_{i+2} = shared_head.head(shared_head.norm(y_i))

Its cache is one more latent tensor indexed by the sequence's own KV slots, so rollback is the main model's:
after a step the layer runs over the positions the sequence kept (the accepted drafts' rows of the step's
forward; a rejected draft's slot is overwritten when that position is computed again). More than one draft
chains the layer on its own output y as the next h. Drafts are verified like any other
(engine/multi_token.py), so output is the same with or without them.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.model_runner import SMALL_FORWARD_TOKENS
from engine.models.causal_lm import DecoderLayer
from engine.models.layers import RMSNorm


def mtp_config(hf: dict, cfg: ModelConfig) -> ModelConfig:
    """The model's config seen with its first MTP layer as layer L (its family's rules say whether it is MoE)."""
    return dataclasses.replace(ModelConfig.from_hf({**hf, "num_hidden_layers": cfg.num_layers + 1}),
                               eos_token_ids=cfg.eos_token_ids)


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class MtpLayer(DecoderLayer):
    """`model.layers.{L}`: the decoder layer's modules under their checkpoint names, plus the MTP's own."""

    def __init__(self, ext: ModelConfig) -> None:
        layer = ext.num_layers - 1
        super().__init__(ext, layer)
        h = ext.hidden_size
        self.layer_idx = layer
        self.embed_tokens = nn.Embedding(ext.vocab_size, h)
        self.enorm = RMSNorm(h, ext.rms_norm_eps)
        self.hnorm = RMSNorm(h, ext.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(ext)
        self.main_logits = None  # the main model's compute_logits where shared_head.head is its lm_head

    def hidden(self, ids: torch.Tensor, prev: torch.Tensor, batch: ForwardBatch, cache: tuple) -> torch.Tensor:
        """ids [T] (each position's next token), prev [T, H] (the main model's hidden there, or the layer's own
        output one position back) -> the layer's output y [T, H]; writes its cache at the batch's slots."""
        e = self.embed_tokens(ids).to(prev.dtype)  # [T, H]
        e = e.masked_fill((batch.positions == 0)[:, None], 0.0)
        x = self.eh_proj(torch.cat((self.enorm(e), self.hnorm(prev)), dim=-1))  # [T, H]
        out, residual, _ = self(x, batch, cache, None)
        return out + residual

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """y [S, H] -> fp32 logits [S, V]."""
        normed = self.shared_head.norm(y)
        if self.main_logits is not None:  # exploration's lm_head (quantized where the engine packs one)
            return self.main_logits(normed)
        return self.shared_head.head(normed).float()


def share_main_tensors(mtp: MtpLayer, model: nn.Module) -> None:
    """The MTP's embedding and head are the main model's where the checkpoint stores equal copies (DeepSeek-V3)."""
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        if mtp.embed_tokens.weight.shape == embed.shape and torch.equal(mtp.embed_tokens.weight, embed):
            mtp.embed_tokens.weight = embed
        head = model.lm_head.weight
        if mtp.shared_head.head.weight.shape == head.shape and torch.equal(mtp.shared_head.head.weight, head):
            mtp.shared_head.head.weight = head
            mtp.main_logits = model.compute_logits


class MtpDrafter:
    """Runs the model's MTP layer after each step over the positions sequences kept, and drafts from it.

    `observe` (after the step's tokens are appended, before the decoder's `extend`) runs one forward of the
    layer over every observed chunk's kept positions and chains it for the drafts; `propose` hands them out.
    A sequence's layer cache covers the positions from the first chunk it saw on (a prefix-cache hit's cached
    positions had no hidden states here, so its attention starts after them)."""

    def __init__(self, model: nn.Module, blocks, num_slots: int, dtype: torch.dtype, device: torch.device,
                 pipeline, tokens: int) -> None:
        self.layer: MtpLayer = model.mtp
        self.blocks = blocks
        self.pipeline = pipeline
        self.tokens = tokens
        self.max_threads = torch.get_num_threads()
        if getattr(model.mtp.mlp, "experts", None) is not None and model.mtp.mlp.experts.packed is not None:
            model.mtp.mlp.experts.packed.num_threads = self.max_threads  # the kernel's own pool, as every layer's
        tensors, heads, width = model.config.kv_cache_layout
        self.cache = tuple(torch.zeros(num_slots, heads, width, dtype=dtype, device=device) for _ in range(tensors))
        self._seen: dict[str, tuple] = {}  # request id -> (sequence, first position in the layer's cache, end)
        self._drafts: dict[str, list[int]] = {}

    @classmethod
    def build(cls, config, runner, blocks) -> MtpDrafter | None:
        """The engine's drafter where `config` (MultiTokenConfig) asks for MTP drafts, its runner keeping hidden
        states for it; else None."""
        if not config.mtp:
            return None
        runner.keep_hidden = True
        cache = runner.kv_caches[0][0]
        return cls(runner.model, blocks, cache.shape[0], cache.dtype, cache.device, runner.strict_experts,
                   config.speculative_tokens)

    def propose(self, seq, k: int) -> list[int]:
        return self._drafts.pop(seq.request_id, [])[:k]

    @torch.inference_mode()
    def observe(self, chunks: list, hidden: list[torch.Tensor], drafting: set[int]) -> None:
        """chunks: the step's ScheduledChunks; hidden: each chunk's [num_tokens, H] final hidden states (the
        runner's); drafting: ids of the sequences that draft (a sampling chunk's: next step)."""
        self._drafts.clear()
        rows, todo = [], []
        for c, h in zip(chunks, hidden, strict=True):
            seq = c.seq
            end = min(c.start + c.num_tokens, seq.num_computed, seq.num_tokens - 1)  # positions with a next token
            if end <= c.start or id(seq) not in drafting:
                continue
            _, first, seen = self._seen.get(seq.request_id, (seq, c.start, c.start))
            if seen != c.start:  # recomputed (preemption) or started past a cached prefix
                first = c.start
            self._seen[seq.request_id] = (seq, first, end)
            todo.append((seq, first, c.start, end, c.samples))
            rows.append(h[:end - c.start])
        if not todo:
            self._prune()
            return
        ids = [t for seq, _, start, end, _ in todo for t in seq.tokens(start + 1, end + 1)]
        prev = torch.cat(rows)  # [T, H]
        want = 1 if prev.shape[0] <= SMALL_FORWARD_TOKENS else self.max_threads  # the runner's rule for a forward
        if prev.device.type == "cpu" and torch.get_num_threads() != want:
            torch.set_num_threads(want)
        spans = [(seq, first, start, end) for seq, first, start, end, _ in todo]
        y = self.layer.hidden(torch.tensor(ids, device=prev.device), prev, self._batch(spans), self.cache)
        last = list(itertools.accumulate(end - start for _, _, start, end, _ in todo))  # each chunk's end row + 1
        keep = [i for i, t in enumerate(todo) if t[4]]
        if keep:
            self._draft([todo[i] for i in keep], y[[last[i] - 1 for i in keep]])
        self._prune()

    def _draft(self, todo: list, y: torch.Tensor) -> None:
        """y [S, H]: the layer's output at each drafting sequence's last kept position -> up to `tokens` drafts
        each, the layer chained on its own output while the sequence's blocks hold the positions it writes."""
        drafts = [[] for _ in todo]
        live = list(range(len(todo)))
        for j in range(self.tokens):
            picks = self.layer.logits(y).argmax(-1).tolist()  # [S]
            for i, token in zip(live, picks, strict=True):
                drafts[i].append(token)
            if j + 1 == self.tokens:
                break
            bs = self.blocks.block_size
            go = [n for n, i in enumerate(live) if len(todo[i][0].block_table) * bs > todo[i][3] + j]
            if not go:
                break
            live = [live[n] for n in go]
            spans = [(todo[i][0], todo[i][1], todo[i][3] + j, todo[i][3] + j + 1) for i in live]
            ids = torch.tensor([drafts[i][-1] for i in live], device=y.device)
            y = self.layer.hidden(ids, y[go], self._batch(spans), self.cache)
        for (seq, *_), d in zip(todo, drafts, strict=True):
            self._drafts[seq.request_id] = d

    def _batch(self, spans: list) -> ForwardBatch:
        """spans [(sequence, first cached position, start, end)] -> the layer's batch over positions [start, end)."""
        bs = self.blocks.block_size
        positions, slots = [], []
        for seq, _, start, end in spans:
            positions.extend(range(start, end))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
        device = self.cache[0].device
        return ForwardBatch(
            input_ids=torch.empty(0, dtype=torch.long),
            positions=torch.tensor(positions, device=device),
            slot_mapping=torch.tensor(slots, device=device),
            query_lens=[end - start for _, _, start, end in spans],
            context_lens=[end for *_, end in spans],
            context_slots=[self.blocks.slots(seq.block_table, first, end).to(device) for seq, first, _, end in spans],
            logits_rows=torch.empty(0, dtype=torch.long),
            expert_pipeline=self.pipeline,
        )

    def _prune(self) -> None:
        for rid in [rid for rid, (seq, *_) in self._seen.items() if seq.is_finished]:
            del self._seen[rid]

