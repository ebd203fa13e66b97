"""Top-k router kernel (kernels.router): the torch reference per compiled variant and kind, bitwise row
invariance over calls of M = 1..16 rows, ties, the engine's Router on the kernel, and the fallbacks."""

from __future__ import annotations

import pytest
import torch

from kernels import kernel_available
from kernels.cpu_features import detect, vnni_capable
from kernels.router import route, router_reference

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="C++ kernel could not be built here")
VARIANTS = ["generic", "avx2", *(["avx512"] if vnni_capable(detect()) else [])]


def _case(t: int, h: int, e: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(t, h, generator=gen),
        torch.randn(e, h, generator=gen) * h**-0.5,
        torch.randn(e, generator=gen),
    )


def assert_routes_close(got, ref) -> None:
    """Logits and weights within fp32 rounding; ids equal wherever the reference's choice is not a near-tie."""
    (logits, weights, ids), (rlogits, rweights, rids) = got, ref
    assert logits.dtype == weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert (logits - rlogits).abs().max().item() <= 1e-5 * rlogits.abs().max().item()
    assert (weights - rweights).abs().max().item() <= 1e-5
    assert torch.equal(ids, rids)


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("h", "e", "k"), [(64, 8, 2), (200, 60, 4), (1024, 64, 8), (13, 5, 5)])
@pytest.mark.parametrize(("kind", "norm"), [("softmax", True), ("softmax", False), ("topk_softmax", False)])
def test_router_matches_reference(variant: str, h: int, e: int, k: int, kind: str, norm: bool) -> None:
    x, w, b = _case(37, h, e, seed=h + e)
    bias = b if kind == "topk_softmax" else None
    assert_routes_close(
        route(x, w, bias, k, kind, norm, variant=variant), router_reference(x, w, bias, k, kind, norm)
    )


@needs_kernel
@pytest.mark.parametrize("kind", ["softmax", "topk_softmax"])
def test_router_rows_are_bitwise_batch_invariant(kind: str) -> None:
    x, w, b = _case(48, 256, 32, seed=1)
    bias = b if kind == "topk_softmax" else None
    full = route(x, w, bias, 4, kind, True)
    for m in range(1, 17):
        for lo in range(0, 48, m):
            part = route(x[lo : lo + m], w, bias, 4, kind, True)
            assert all(torch.equal(p, f[lo : lo + m]) for p, f in zip(part, full, strict=True)), (m, lo)


@needs_kernel
def test_router_ties_go_to_the_lower_expert() -> None:
    x = torch.ones(3, 16)
    w = torch.zeros(6, 16)
    w[[1, 4]] = 0.5  # experts 1 and 4 tie on top, the rest tie below
    _, weights, ids = route(x, w, None, 3, "softmax", False)
    assert ids.tolist() == [[1, 4, 0]] * 3
    assert torch.equal(weights[:, 0], weights[:, 1])


def test_router_fallbacks_and_errors() -> None:
    x, w, b = _case(5, 32, 8, seed=2)
    for got in (
        route(x.bfloat16(), w.bfloat16(), None, 2, "softmax", True),
        route(x, w.clone().requires_grad_(), None, 2, "softmax", True),
    ):
        assert got[1].shape == (5, 2)  # the reference: bf16, or autograd
    with pytest.raises(ValueError, match="unknown router kind"):
        router_reference(x, w, None, 2, "sigmoid", True)


@needs_kernel
@pytest.mark.parametrize("kind", ["softmax", "topk_softmax"])
def test_engine_router_runs_the_kernel(tiny_checkpoint, monkeypatch, kind: str) -> None:
    """The model's Router in fp32 inference on CPU: the kernel's bits, and its torch path (MOEGATE_DISABLE_CPP)
    within rounding."""
    from engine.config import ModelConfig, read_hf_config
    from engine.models.moe import Router

    cfg = ModelConfig.from_hf(read_hf_config(tiny_checkpoint()))
    router = Router(cfg)
    router.kind = kind
    x, w, b = _case(9, cfg.hidden_size, cfg.num_experts, seed=3)
    with torch.no_grad():
        router.weight.copy_(w)
        router.bias = torch.nn.Parameter(b)
        got = router(x)
        bias = b if kind == "topk_softmax" else None
        assert all(
            torch.equal(g, r)
            for g, r in zip(got, route(x, w, bias, cfg.top_k, kind, cfg.norm_topk_prob), strict=True)
        )
        monkeypatch.setenv("MOEGATE_DISABLE_CPP", "1")
        assert_routes_close(got, router(x))
