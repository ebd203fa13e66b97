"""Typed calls into the compiled kernel library for code outside kernels/ (kernels/build.py declares every
entry point): the logits mask of constrained decoding (`moegate_apply_bitmask`, csrc/logits_mask.h), the
one-call decoder layer (`moegate_decode_layer`, csrc/decode_layer.h) and the whole stack of them in one call
(`moegate_decode_stack`); `DecodeStackCall` and `LinearCall`: the stack and a packed projection over buffers kept
between calls, their arguments checked and converted once (a decode step passes its row count); `DecodeStepCall`:
both in one call (`moegate_decode_step`, the lm_head's greedy picks or races included); `HeadRaceCall`: the lm_head
with each row's temperature pick in the same call (`moegate_linear_race`)."""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.build import DecodeLayerParams as DecodeLayerParams
from kernels.fused_moe import kernel_library


@functools.cache
def _library():
    """The compiled kernel library, looked up once (None: MOEGATE_DISABLE_CPP set, or no compiler)."""
    return kernel_library()


def apply_bitmask_kernel(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """Set the logits whose bit is clear to -inf in place (bit j of word w allows id 32*w + j) with the compiled
    kernel. logits [B, V] fp32, bitmask [B, ceil(V/32)] int32, both on the CPU with contiguous rows. False, and
    nothing done, where the kernel does not take these tensors or is not available: the caller falls back."""
    if not (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1
            and bitmask.device.type == "cpu" and bitmask.dtype == torch.int32 and bitmask.stride(-1) == 1):
        return False
    lib = _library()
    if lib is None:
        return False
    batch, vocab = logits.shape
    lib.moegate_apply_bitmask(logits.data_ptr(), bitmask.data_ptr(), batch, vocab, logits.stride(0),
                              bitmask.stride(0))
    return True


def decode_layer_library():
    """The compiled kernel library for `run_decode_layer`, or None (MOEGATE_DISABLE_CPP set, or no compiler):
    the caller stays on its torch modules. Looked up at each build, so MOEGATE_DISABLE_CPP set later counts."""
    return kernel_library()


class DecodeSlotsError(IndexError):
    """A decode kernel call's slot ids or context ranges lie outside its KV cache or context buffer (a bad block
    table): the kernel checked them and wrote nothing."""


def _decode_rc(name: str, rc: int, cache_slots: int, ctx_total: int) -> None:
    if rc == -4:
        raise DecodeSlotsError(f"{name}: a token's slot or context lies outside the KV cache's {cache_slots} slots or "
                               f"the {ctx_total} context slots given (a bad block table); nothing was computed")
    if rc != 0:
        raise RuntimeError(f"{name} failed with code {rc}")


def cache_slots(params, caches) -> int:
    """The slots every layer's KV cache holds (the fewest): params (DecodeLayerParams, or a sequence of them) and
    caches ((K, V) per layer) in the same order."""
    params = [params] if isinstance(params, DecodeLayerParams) else params
    return min(min(k.numel(), v.numel()) // (p.KV * p.D) for p, (k, v) in zip(params, caches, strict=True))


def run_decode_layer(lib, params: DecodeLayerParams, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     slots: torch.Tensor, start: torch.Tensor, length: torch.Tensor, ids: torch.Tensor,
                     num_threads: int) -> None:
    """x [T, H] fp32 contiguous, updated in place; writes the tokens' K/V at `slot_mapping` [T] and each
    token's top-k expert ids to `ids` [T, K] int64. Token i attends to slots[start[i] : start[i] + length[i]].
    A slot or context outside the cache or `slots`: DecodeSlotsError, nothing written."""
    n, total = cache_slots(params, [(k_cache, v_cache)]), slots.numel()
    rc = lib.moegate_decode_layer(
        ctypes.byref(params), x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), slot_mapping.data_ptr(), slots.data_ptr(), start.data_ptr(), length.data_ptr(),
        ids.data_ptr(), ctypes.c_int(num_threads), n, total)
    _decode_rc("moegate_decode_layer", rc, n, total)


def run_decode_stack(lib, layers: ctypes.Array, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_caches: ctypes.Array, v_caches: ctypes.Array, slot_mapping: torch.Tensor, slots: torch.Tensor,
                     start: torch.Tensor, length: torch.Tensor, ids: torch.Tensor, counts: ctypes.Array,
                     num_threads: int, norm: tuple[torch.Tensor, float, torch.Tensor] | None = None, *,
                     slots_per_cache: int) -> None:
    """`run_decode_layer` for every layer in order, in one call: layers (DecodeLayerParams * L), layer l's
    KV caches at k_caches[l] / v_caches[l] (c_void_p * L); counts[l] (c_void_p * L, None for none): layer
    l's routing counts [E] int64, each top-k expert id of its tokens added once. ids [>= T, K] int64: scratch.
    norm (weight [H] fp32, eps, out [T, H] fp32): the final RMSNorm of each row of x into out, as
    `kernels.norm.rms_norm_rows`; None: x is left un-normed. slots_per_cache: the slots each layer's cache holds
    (`cache_slots`); a slot or context outside them or `slots`: DecodeSlotsError, nothing written."""
    if ids.dtype != torch.int64 or not ids.is_contiguous() or ids.shape[0] < x.shape[0]:
        raise ValueError(f"ids must be contiguous int64 with >= {x.shape[0]} rows, got {ids.dtype} {tuple(ids.shape)}")
    weight, eps, out = norm if norm is not None else (None, 0.0, None)
    if norm is not None and not (weight.dtype == out.dtype == torch.float32 and weight.is_contiguous()
                                 and out.is_contiguous() and weight.shape == x.shape[1:] and out.shape == x.shape):
        raise ValueError("norm: weight [H] and out [T, H] must be contiguous fp32")
    rc = lib.moegate_decode_stack(
        layers, len(layers), x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(), k_caches, v_caches,
        slot_mapping.data_ptr(), slots.data_ptr(), start.data_ptr(), length.data_ptr(), ids.data_ptr(), counts,
        None if weight is None else weight.data_ptr(), float(eps), None if out is None else out.data_ptr(),
        ctypes.c_int(num_threads), slots_per_cache, slots.numel())
    _decode_rc("moegate_decode_stack", rc, slots_per_cache, slots.numel())


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


class DecodeStackCall:
    """`run_decode_stack` over buffers kept between calls: x [R, H], cos / sin [R, D], slot_mapping, start, length
    [R] int64, slots [>= the contexts' total] int64, ids [R, K] int64 and the norm's out [R, H] are checked and
    their pointers converted to ctypes once, so a call passes only its row count T <= R (rows [0, T) of each).
    slots_per_cache: the slots each layer's cache holds (`cache_slots`); the kernel checks every slot id and context
    range against it and `slots` (DecodeSlotsError, nothing written).
    The entry point is looked up on the library at each call (a timer wrapped around it sees every call)."""

    def __init__(self, lib, layers: ctypes.Array, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_caches: ctypes.Array, v_caches: ctypes.Array, slot_mapping: torch.Tensor, slots: torch.Tensor,
                 start: torch.Tensor, length: torch.Tensor, ids: torch.Tensor, counts: ctypes.Array, num_threads: int,
                 norm: tuple[torch.Tensor, float, torch.Tensor], slots_per_cache: int) -> None:
        rows, weight, (eps, out) = x.shape[0], norm[0], norm[1:]
        floats, ints = (x, cos, sin, weight, out), (slot_mapping, slots, start, length, ids)
        if not all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in floats):
            raise ValueError("x, cos, sin and the norm's weight and out must be contiguous fp32 on the CPU")
        if not all(t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu" for t in ints):
            raise ValueError("slot_mapping, slots, start, length and ids must be contiguous int64 on the CPU")
        if min(cos.shape[0], sin.shape[0], slot_mapping.shape[0], start.shape[0], length.shape[0], ids.shape[0],
               out.shape[0]) < rows or weight.shape != x.shape[1:] or out.shape[1:] != x.shape[1:]:
            raise ValueError(f"every buffer needs the {rows} rows of x; the norm weight [H] and out [R, H]")
        self.lib, self.rows = lib, rows
        self._keep = (layers, *floats, k_caches, v_caches, *ints, counts)
        self._head = (layers, ctypes.c_int64(len(layers)), _ptr(x))
        self._tail = (_ptr(cos), _ptr(sin), k_caches, v_caches, _ptr(slot_mapping), _ptr(slots), _ptr(start),
                      _ptr(length), _ptr(ids), counts, _ptr(weight), ctypes.c_double(eps), _ptr(out),
                      ctypes.c_int(num_threads), ctypes.c_int64(slots_per_cache), ctypes.c_int64(slots.numel()))
        self.slots_per_cache, self.ctx_total = slots_per_cache, slots.numel()

    def __call__(self, rows: int) -> None:
        if not 0 < rows <= self.rows:
            raise ValueError(f"rows must be in [1, {self.rows}], got {rows}")
        rc = self.lib.moegate_decode_stack(*self._head, rows, *self._tail)
        if rc != 0:
            _decode_rc("moegate_decode_stack", rc, self.slots_per_cache, self.ctx_total)


class LinearCall:
    """`PackedLinear.__call__`'s kernel call (kernels/linear.py) from the first rows of a kept input x [R, K] into
    a kept output out [R, N rounded up to 8] fp32, the arguments checked and converted once."""

    def __init__(self, lib, linear, x: torch.Tensor, out: torch.Tensor, num_threads: int,
                 first_max: torch.Tensor | None = None) -> None:
        rows = x.shape[0]
        if not all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" and t.dim() == 2
                   for t in (x, out)) or x.shape[1] != linear.in_features or out.shape != (rows, linear.padded_out):
            raise ValueError(f"x [R, {linear.in_features}] and out [R, {linear.padded_out}] must be contiguous fp32 "
                             f"on the CPU, got {tuple(x.shape)} and {tuple(out.shape)}")
        if first_max is not None:
            _check_first_max(first_max, rows)
        self.lib, self.rows, self.linear = lib, rows, linear
        self._keep = (x, out, first_max)
        self._head = (_ptr(x), _ptr(out))
        self._tail = linear.kernel_args(num_threads)
        self._first_max = _ptr(first_max)  # a kept first_max [R] int64 (`picking`)

    def picking(self, rows: int) -> None:
        """`self(rows, first_max=the kept first_max)`, its checks made once at construction (a decode step's
        lm_head with its greedy picks: each torch check of a tensor costs ~10 us right after the kernels)."""
        if not 0 < rows <= self.rows or not self._first_max.value:
            raise ValueError(f"rows must be in [1, {self.rows}] and a first_max buffer kept, got {rows}")
        rc = self.lib.moegate_linear_first_max(*self._head, rows, *self._tail, self._first_max)
        if rc != 0:
            raise RuntimeError(f"moegate_linear failed with code {rc} for format {self.linear.fmt}")

    def head_into(self, out: torch.Tensor | None, rows: int) -> tuple:
        """The call's leading arguments (input, output), the output `out` where given ([>= rows, N8*8] contiguous
        fp32 on the CPU, checked) instead of the kept one."""
        if out is None:
            return self._head
        if not (out.dtype == torch.float32 and out.is_contiguous() and out.device.type == "cpu"
                and out.dim() == 2 and out.shape[0] >= rows and out.shape[1] == self.linear.padded_out):
            raise ValueError(f"out must be contiguous fp32 [>= {rows}, {self.linear.padded_out}] on the CPU")
        return (self._head[0], out.data_ptr())

    def __call__(self, rows: int, out: torch.Tensor | None = None, first_max: torch.Tensor | None = None) -> None:
        """out[:rows] = x[:rows] W^T (padded columns past N included); `out` [>= rows, N8*8] contiguous fp32
        given: into it instead of the kept one. `first_max` [>= rows] contiguous int64 given: first_max[m] = the
        index of row m's first largest of its N outputs (numpy's argmax: a NaN counts as the largest, the first
        wins), found in the same call by each thread over the columns it wrote."""
        if not 0 < rows <= self.rows:
            raise ValueError(f"rows must be in [1, {self.rows}], got {rows}")
        head = self.head_into(out, rows)
        if first_max is None:
            rc = self.lib.moegate_linear(*head, rows, *self._tail)
        else:
            _check_first_max(first_max, rows)
            rc = self.lib.moegate_linear_first_max(*head, rows, *self._tail, first_max.data_ptr())
        if rc != 0:
            raise RuntimeError(f"moegate_linear failed with code {rc} for format {self.linear.fmt}")


class DecodeStepCall:
    """A decode step's two kernel calls, the stack (`DecodeStackCall`) and the lm_head over its first rows of the
    stack's norm output (`LinearCall`, the greedy pick where asked; `HeadRaceCall`'s races with `racing`), as one
    `moegate_decode_step` call, which also lets the pool's helpers rest: both calls' checked and converted arguments
    sit in one kept struct (kernels/build.py `DecodeStepArgs`), so a step passes its rows, the lm_head's rows and
    whether it picks or races. The entry point is looked up on the library at each call (a timer wrapped around it
    sees every call)."""

    def __init__(self, stack: DecodeStackCall, head: LinearCall, race: HeadRaceCall | None = None) -> None:
        from kernels.build import DecodeStepArgs

        if stack.lib is not head.lib or head._head[0].value != stack._tail[12].value:
            raise ValueError("the lm_head must read the stack's norm output, in the same kernel library")
        if race is not None and race.call is not head:
            raise ValueError("the races must be the lm_head's own (HeadRaceCall over the same LinearCall)")
        values = [a.value if isinstance(a, ctypes._SimpleCData) else ctypes.addressof(a)
                  for a in (*stack._head, *stack._tail, head._head[1], *head._tail, head._first_max,
                            *(race._race if race is not None else ()))]
        self.lib, self.stack, self.head, self.race = stack.lib, stack, head, race
        self.rows, self.logit_rows = stack.rows, head.rows
        self._vocab = head.linear.out_features if race is not None else -1  # a race's limit at most (-1: no race)
        self._args = ctypes.pointer(DecodeStepArgs(*values))

    def __call__(self, rows: int, logit_rows: int, pick: bool) -> None:
        """The stack over rows [0, rows), then the lm_head over its first `logit_rows` rows of the norm output into
        the head's kept output (and its kept first_max where `pick`), then the pool rests."""
        if not (0 < logit_rows <= self.logit_rows and 0 < rows <= self.rows) or (pick and not self.head._first_max.value):
            raise ValueError(f"rows must be in [1, {self.rows}], logit rows in [1, {self.logit_rows}] (a first_max "
                             f"buffer kept to pick), got {rows}, {logit_rows}")
        if rc := self.lib.moegate_decode_step(self._args, rows, logit_rows, 1 if pick else 0, 0):
            self._failed(rc)

    def racing(self, rows: int, logit_rows: int, limit: int) -> None:
        """As the call, the lm_head's rows picked as `HeadRaceCall(logit_rows, limit)` picks them: each row whose
        kept temperature is > 0 races over its first `limit` logits, any other takes its first largest there (the
        race's kept picks and best)."""
        if not (0 < logit_rows <= self.logit_rows and 0 < rows <= self.rows and 0 <= limit <= self._vocab):
            raise ValueError(f"a HeadRaceCall kept, rows in [1, {self.rows}], logit rows in [1, {self.logit_rows}] "
                             f"and limit in [0, {self.head.linear.out_features}]: got {rows}, {logit_rows}, {limit}")
        if rc := self.lib.moegate_decode_step(self._args, rows, logit_rows, 2, limit):
            self._failed(rc)

    def _failed(self, rc: int) -> None:
        if rc <= -100:
            raise RuntimeError(f"the lm_head's kernel failed with code {rc + 100} for format {self.head.linear.fmt}")
        _decode_rc("moegate_decode_stack", rc, self.stack.slots_per_cache, self.stack.ctx_total)


class HeadRaceCall:
    """A LinearCall's lm_head with each row's pick in the same call (`moegate_linear_race`, csrc/race_noise.h): a row
    whose `temps` entry is > 0 races at that temperature over the draw `counters` of the stream `keys`
    (kernels/race_noise.py `race_sample`'s id and score over the row's first `limit` logits, bit for bit), scored by
    the threads that wrote its columns; any other row takes its first largest logit there (`best`: that logit). The
    logits are written as by the LinearCall. Kept numpy buffers [R]: temps fp32, keys and counters uint64 (the
    caller's inputs), picks int64 and best fp32 (the outputs)."""

    def __init__(self, call: LinearCall) -> None:
        import numpy as np

        rows = call.rows
        self.call = call
        self.temps, self.keys, self.counters = np.zeros(rows, np.float32), np.zeros(rows, np.uint64), np.zeros(
            rows, np.uint64)
        self.picks, self.best = np.zeros(rows, np.int64), np.zeros(rows, np.float32)
        self._race = tuple(ctypes.c_void_p(a.ctypes.data) for a in (self.temps, self.keys, self.counters, self.picks,
                                                                     self.best))

    def __call__(self, rows: int, limit: int, out: torch.Tensor | None = None) -> None:
        """The first `rows` rows into the LinearCall's kept output (`out` given: into it, [>= rows, N8*8] contiguous
        fp32), and their picks among the first `limit` (<= N) columns into picks[:rows], best[:rows]."""
        call = self.call
        if not 0 < rows <= call.rows or not 0 <= limit <= call.linear.out_features:
            raise ValueError(f"rows must be in [1, {call.rows}] and limit in [0, {call.linear.out_features}], got "
                             f"{rows} and {limit}")
        head = call.head_into(out, rows)
        rc = call.lib.moegate_linear_race(*head, rows, *call._tail, limit, *self._race)
        if rc != 0:
            raise RuntimeError(f"moegate_linear_race failed with code {rc} for format {call.linear.fmt}")


def _check_first_max(first_max: torch.Tensor, rows: int) -> None:
    if not (first_max.dtype == torch.int64 and first_max.is_contiguous() and first_max.device.type == "cpu"
            and first_max.dim() == 1 and first_max.shape[0] >= rows):
        raise ValueError(f"first_max must be contiguous int64 [>= {rows}] on the CPU")
