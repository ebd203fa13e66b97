"""The demo trainer's loss: assistant tokens weigh 1, the prompt's tokens `prompt_weight`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from evals.demo.train import IGNORE, TrainConfig, build_model, lm_loss

transformers = pytest.importorskip("transformers")


def _tiny():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[2] / "engine/assets/demo-moe"))
    cfg = TrainConfig(hidden_size=32, num_layers=1, num_experts=4, top_k=2, moe_intermediate_size=16, num_heads=2,
                      num_kv_heads=1, head_dim=16, seq_len=24)
    model = build_model(cfg, tokenizer).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, len(tokenizer), (2, 24), generator=gen)  # [B, S]
    labels = torch.full_like(ids, IGNORE)
    labels[:, 10:18] = ids[:, 10:18]  # the "assistant" span
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0  # padding at the end of the second row
    values = torch.zeros_like(ids)
    values[:, 12:14] = 1  # a JSON value inside the answer
    return model, torch.stack([ids, labels, mask, values], 1)  # [B, 4, S]


def test_prompt_weight_zero_is_the_assistant_loss_and_one_is_the_all_token_loss():
    model, batch = _tiny()
    with torch.no_grad():
        logits = model(input_ids=batch[:, 0], attention_mask=batch[:, 2]).logits[:, :-1]  # [B, S-1, V]
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 0, 1:].flatten(),
                                                reduction="none").view(2, -1)  # [B, S-1]
        answer = batch[:, 1, 1:] != IGNORE
        real = batch[:, 2, 1:] == 1
        assistant, _ = lm_loss(model, batch, prompt_weight=0.0)
        everything, _ = lm_loss(model, batch, prompt_weight=1.0)
        half, _ = lm_loss(model, batch, prompt_weight=0.5)
    torch.testing.assert_close(assistant, nll[answer].mean())
    torch.testing.assert_close(everything, nll[real].mean())
    prompt = real & ~answer
    expected = (nll[answer].sum() + 0.5 * nll[prompt].sum()) / (answer.sum() + 0.5 * prompt.sum())
    torch.testing.assert_close(half, expected)
    assert not torch.isclose(half, everything) and not torch.isclose(half, assistant)
    with torch.no_grad():
        weighted, _ = lm_loss(model, batch, prompt_weight=0.0, value_weight=4.0)
    value = batch[:, 3, 1:] == 1
    expected = (nll[answer & ~value].sum() + 4.0 * nll[value].sum()) / ((answer & ~value).sum() + 4.0 * value.sum())
    torch.testing.assert_close(weighted, expected)


def test_value_flags_mark_the_json_values_of_answers_only():
    from transformers import AutoTokenizer

    from evals.demo.corpus import conversation
    from evals.demo.train import tokenize_with_mask

    tokenizer = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[2] / "engine/assets/demo-moe"))
    conv = conversation("heldout", 1, family="order")
    ids, labels, flags = tokenize_with_mask(tokenizer, conv.render())
    call = conv.messages[conv.answer_index]["tool_calls"][0]["function"]
    flagged = tokenizer.decode([i for i, f in zip(ids, flags, strict=True) if f])
    expected = call["name"] + "".join(str(v) if not isinstance(v, float) else f"{v}" for v in call["arguments"].values())
    assert flagged == expected
    assert all(label != IGNORE for label, f in zip(labels, flags, strict=True) if f)  # answers only


def test_prompt_weight_outside_zero_to_one_is_rejected():
    with pytest.raises(ValueError, match="prompt_loss_weight"):
        TrainConfig(prompt_loss_weight=1.5)


def test_packed_rows_pad_only_at_their_end():
    """`lm_loss` runs the model without an attention mask: causal attention keeps real tokens off end padding only."""
    from evals.demo.train import pack

    examples = [([5] * n, [IGNORE] * n, [0] * n) for n in (7, 3, 9, 4, 12, 1)]
    rows = pack(examples, seq_len=16, pad_id=0)  # [N, 5, S]
    mask = rows[:, 2]
    lengths = mask.sum(1)
    assert int(lengths.sum()) == sum(len(e[0]) for e in examples)
    assert torch.equal(mask, (torch.arange(16) < lengths[:, None]).long())


def test_document_mask_runs_each_packed_conversation_as_if_alone():
    """With `document_mask`, a conversation packed after others gets the logits it gets alone from position 0 (as when
    served); without it, it attends to the conversations before it in the row."""
    from transformers import AutoTokenizer

    from evals.demo.corpus import conversations
    from evals.demo.train import pack, packed_causal_attention, tokenize_with_mask

    tokenizer = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[2] / "engine/assets/demo-moe"))
    cfg = TrainConfig(hidden_size=64, num_layers=2, num_experts=4, top_k=2, moe_intermediate_size=32, num_heads=4,
                      num_kv_heads=2, head_dim=16, seq_len=1024)
    model = build_model(cfg, tokenizer).eval()
    examples = [tokenize_with_mask(tokenizer, c.render()) for c in conversations("train", 3, 0)]
    row = pack(examples, seq_len=1024, pad_id=0)  # [1, 5, S]
    assert row.shape[0] == 1
    lengths = [len(e[0]) for e in examples]
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    assert row[0, 4, starts].tolist() == [0, 0, 0] and row[0, 4, sum(lengths)] == 0  # restarts, padding too
    captured = {}

    def capture(module, *args, **kwargs):
        captured["logits"] = args[1].logits

    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([e[0]]), use_cache=False).logits[0] for e in examples]
        handle = model.register_forward_hook(capture, with_kwargs=False)
        try:
            lm_loss(model, row, document_mask=True)
            packed = captured["logits"][0]
            lm_loss(model, row, document_mask=False)
            causal = captured["logits"][0]
        finally:
            handle.remove()
    assert model.config._attn_implementation == "sdpa"  # restored after the packed forward
    for start, n, ref in zip(starts, lengths, alone, strict=True):
        torch.testing.assert_close(packed[start:start + n], ref, atol=2e-5, rtol=1e-4)
    assert (causal[starts[2]:starts[2] + lengths[2]] - alone[2]).abs().max() > 1e-2
    # the attention function itself: one causal SDPA per conversation, padding included as its own segment
    q, k = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2], list(range(10))])
    out, _ = packed_causal_attention(None, q, k, k, None, scaling=0.5, position_ids=positions)  # [B, S, H, D]
    ref = torch.nn.functional.scaled_dot_product_attention(q[:1, :, 3:7], k[:1, :, 3:7], k[:1, :, 3:7], is_causal=True,
                                                           scale=0.5, enable_gqa=True)
    torch.testing.assert_close(out[0, 3:7], ref[0].transpose(0, 1))
