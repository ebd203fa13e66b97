"""Layer-wise prefill: a long prefill burst runs its routed experts on the fast device, layer by layer.

Decode and short chunks compute routed experts where they live, in host memory, with the CPU kernels:
few tokens per expert, so the bytes of the weights dominate and the CPU reads them in place. A long
prompt turns that around: every expert sees many tokens, the work is compute-bound, and the fast
device (a GPU) does it far quicker than the CPU, even counting the copy of the weights. So above
`min_tokens` tokens in one exploration forward, each MoE layer's host-held experts are copied to the
fast device (the packed bytes, dequantized there to the model dtype), the burst is computed there, and
the copy of the next MoE layer runs on a background thread (on CUDA, its own stream) while this layer
computes (KTransformers' scheme). At most two layers' experts are resident on the fast device at once.

Exploration only: execution keeps the CPU kernels at every chunk size, so its bytes never depend on
how a prompt is chunked. The path does not depend on CUDA: with the CPU as the fast device the same
code runs (the tests use it), though there it buys nothing.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.errors import EngineError
from kernels.formats import SILU, Activation

log = logging.getLogger(__name__)


class LayerwisePrefillError(EngineError):
    """Copying a layer's experts to the fast device failed."""


@dataclass
class DeviceExperts:
    """One MoE layer's host-held experts of the fast profile, dequantized on the fast device."""

    lut: torch.Tensor  # [E] global id -> row in gate_up/down, -1: not host-held
    gate_up: torch.Tensor  # [n, 2I, H]
    down: torch.Tensor  # [n, H, I]
    ready: torch.cuda.Event | None  # recorded after the copy (CUDA)
    act: Activation = SILU  # the experts' gated activation (kernels.formats.Activation)
    gate_up_bias: torch.Tensor | None = None  # [n, 2I] (GPT-OSS), else None
    down_bias: torch.Tensor | None = None  # [n, H]


def copy_to_device(layer, device: torch.device, dtype: torch.dtype) -> DeviceExperts:
    """The layer's host shards (fast profile) -> dequantized weights on `device` (one copy of the packed bytes)."""
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    ctx = torch.cuda.stream(stream) if stream is not None else _nullcontext()
    n_total = layer.counts.numel()
    ids, gus, dns, b_gus, b_dns, act = [], [], [], [], [], SILU
    with ctx:
        for shard in layer.fast:
            if shard.device.type != "cpu":
                continue  # hot experts are on the fast device already and computed there
            packed = shard.packed.to(device)  # the packed (quantized) bytes cross the bus, not fp32
            act = packed.act
            for local, e in enumerate(packed.expert_ids):
                gu, dn = packed.dequantize(local)
                gus.append(gu.to(dtype))
                dns.append(dn.to(dtype))
                bias = packed.biases(local)
                if bias is not None:
                    b_gus.append(bias[0].float())
                    b_dns.append(bias[1].float())
                ids.append(e)
        lut = torch.full((n_total,), -1, dtype=torch.long, device=device)
        if ids:
            lut[torch.tensor(ids, device=device)] = torch.arange(len(ids), device=device)
        gate_up = torch.stack(gus) if gus else torch.empty(0, device=device, dtype=dtype)
        down = torch.stack(dns) if dns else torch.empty(0, device=device, dtype=dtype)
        ready = None
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record(stream)
    return DeviceExperts(lut, gate_up, down, ready, act, torch.stack(b_gus) if b_gus else None,
                         torch.stack(b_dns) if b_dns else None)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def compute_on_device(w: DeviceExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [T, H], ids [T, K] global (-1 skip), weights [T, K] -> [T, H] fp32: the host-held experts' sum."""
    if w.ready is not None:
        torch.cuda.current_stream(x.device).wait_event(w.ready)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = torch.where(ids >= 0, w.lut[ids.clamp(min=0)], -1)  # [T, K]
    for e in torch.unique(local[local >= 0]).tolist():
        tok, slot = torch.where(local == e)
        h = F.linear(x[tok].to(w.gate_up.dtype), w.gate_up[e]).float()  # [n, 2I]
        if w.gate_up_bias is not None:
            h = h + w.gate_up_bias[e]
        gate, up = h.chunk(2, dim=-1)
        y = F.linear(w.act(gate, up).to(w.down.dtype), w.down[e]).float()  # [n, H]
        if w.down_bias is not None:
            y = y + w.down_bias[e]
        out.index_add_(0, tok, y * weights[tok, slot, None].float())
    return out


class LayerwisePrefill:
    """Runs long exploration bursts' routed experts on the fast device, prefetching the next MoE layer."""

    def __init__(self, layers: list, device: torch.device | str, dtype: torch.dtype, min_tokens: int) -> None:
        if min_tokens < 1:
            raise ValueError(f"layer-wise prefill needs min_tokens >= 1, got {min_tokens}")
        self.layers = layers  # LayerExperts in forward order
        self.index = {id(le): k for k, le in enumerate(layers)}
        self.device, self.dtype, self.min_tokens = torch.device(device), dtype, min_tokens
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moegate-layerwise")
        self._copies: dict[int, Future] = {}  # layer position -> its DeviceExperts
        self.bursts = 0  # layer computations done on the fast device
        self.copies = 0  # layers copied

    @classmethod
    def build(cls, layers: dict, min_tokens: int | None, device: torch.device,
              dtype: torch.dtype) -> LayerwisePrefill | None:
        """The engine's layer-wise prefill over its MoE layers (`layers`: index -> LayerExperts); None when off."""
        if not min_tokens or not layers:
            return None
        log.info("layer-wise prefill: exploration forwards of >= %d tokens run routed experts on %s", min_tokens, device)
        return cls([layers[i] for i in sorted(layers)], device, dtype, min_tokens)

    def applies(self, layer, num_tokens: int, exact: bool) -> bool:
        return not exact and num_tokens >= self.min_tokens and id(layer) in self.index

    def _fetch(self, k: int) -> Future:
        if k not in self._copies:
            self.copies += 1
            self._copies[k] = self._pool.submit(copy_to_device, self.layers[k], self.device, self.dtype)
        return self._copies[k]

    def compute(self, layer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The layer's host-held experts for this burst, on the fast device -> [T, H] fp32."""
        k = self.index[id(layer)]
        current = self._fetch(k)
        self._fetch((k + 1) % len(self.layers))  # overlaps this layer's compute (a long prompt's next chunk wraps)
        try:
            w = current.result()
        except Exception as exc:
            self.reset()
            raise LayerwisePrefillError(f"copying MoE layer {k}'s experts to {self.device} failed: {exc}") from exc
        out = compute_on_device(w, x, ids, weights)
        self.bursts += 1
        del self._copies[k]  # at most this layer's successor stays resident
        return out

    def reset(self) -> None:
        """Drops resident copies (an aborted forward, a hot-set change, shutdown)."""
        for fut in self._copies.values():
            fut.cancel()
        self._copies.clear()

    def close(self) -> None:
        self.reset()
        self._pool.shutdown(wait=True, cancel_futures=True)
