"""The fused graph: attention, RoPE and the residual RMSNorms as onnxruntime's contrib
operators (com.microsoft `GroupQueryAttention` with rotary inside, `SkipSimplifiedLayerNormalization`),
the layout of contract "shared" KV (see contract/onnx_io.py).

Each operator is a `torch.autograd.Function` whose `symbolic` emits the contrib node when the
TorchScript exporter traces it and whose `forward` computes the same thing eagerly (so the
modules run in torch too). What the CPU execution provider of onnxruntime 1.32 does, measured
with standalone graphs against a numpy reference (max error <= 3e-7):
- `GroupQueryAttention` with `past_key` and `present_key` bound to the same
  [batch, kv_heads, capacity, head_dim] buffer writes the new rows at [past, past + S) in place
  and leaves every other row untouched; `attention_bias` must be [.., S, total_sequence_length]
  (a capacity-wide bias is refused) and is added on top of its own causal mask;
- with `do_rotary` it rotates q and k by `position_ids`, also for a tree (depth positions that
  repeat), at batch 1 with a past;
- with an empty past it treats the call as a first prompt and uses only the first position
  id (positions assumed consecutive): a tree with an empty past came out wrong, unless
  `query_seqlens` is given, which is why it always is here;
- `cos_cache` must have at least total_sequence_length rows and a row for every position id
  (it refuses others with an error naming the position); the graphs carry one constant table
  of `rotary_rows` positions (`fused_inputs`). Computing the rows per forward for the call's
  positions instead (earlier exports) took ~22 small nodes, and every small node costs a
  one-token forward time (docs/decisions.md, 'measurements moved out of source comments',
  'The fused graph');
- bfloat16 has no CPU kernel (float16 has).
One-row queries (target graphs of quantised exports, manifest `target.extra.repeats_one_row`):
a one-row query runs GroupQueryAttention's probs x V through onnxruntime's one-row sgemm
kernel, which rounds differently from the multi-row one (tests/exporter/test_batch_invariance.py),
and a quantised graph turns that last bit into different logits. Runtimes used to run every
one-token forward as two rows for that (row-exact decoding), doubling every matmul and norm.
These graphs repeat the row inside attention only: per graph (`_RepeatOneRow`, 19 small nodes),
n = max(2 - S, 0) extra rows for the positions (the next position), the bias (a copy of row 0,
one more masked column), seqlens_k, total_sequence_length and query_seqlens; per layer, one
Gather repeating the packed q/k/v row before GroupQueryAttention and one Slice keeping its
first S output rows before o_proj. The extra KV row lands at past + 1 (the KV buffer needs one
spare row; from layer 1 on it holds row 0's repeated k/v, not what a second real row would
have) and is overwritten by the next forward, as the second row of a two-row forward was;
row 0's logits, features and KV are the two-row forward's bit for bit, and calls of
S >= 2 rows compute exactly what they did (every added node copies them unchanged).
Faster than the standard-op graph at fp32 and int4, on par with onnxruntime-genai's graph
(docs/decisions.md, "Graph design: fused attention on onnxruntime").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from eagle_deploy.contract.onnx_io import MASK_VALUE

from .layers import GatedMLP, Rotary, gather_positions, rms_norm

MS_DOMAIN = "com.microsoft"


def _none(g):
    """A missing optional input of an ONNX node (exported as the empty name)."""
    n = g.op("prim::Constant")
    n.setType(torch._C.OptionalType.ofTensor())
    return n


def _like(value, rank: int):
    """`value`'s tensor type with `rank` unknown dimensions (the exporter's shape inference
    knows nothing about contrib operators; wrong static sizes would be worse than none)."""
    return value.type().with_sizes([None] * rank)


class _SkipRmsNorm(torch.autograd.Function):
    """(x + skip) -> (rms_norm(x + skip) * weight, x + skip): onnxruntime's
    SkipSimplifiedLayerNormalization (the mean of squares in fp32 for fp16 inputs too)."""

    @staticmethod
    def forward(ctx, x, skip, weight, eps: float):
        s = x + skip
        return rms_norm(s, weight, eps), s

    @staticmethod
    def symbolic(g, x, skip, weight, eps: float):
        y, _, _, s = g.op(f"{MS_DOMAIN}::SkipSimplifiedLayerNormalization", x, skip, weight, epsilon_f=eps, outputs=4)
        y.setType(_like(x, 3))
        s.setType(_like(x, 3))
        return y, s


def drop_unused_norm_statistics(model) -> int:
    """Leave the optional mean and inverse-std outputs (1 and 2) of every
    SkipSimplifiedLayerNormalization node of an onnx ModelProto empty when nothing reads them
    (the TorchScript exporter names all four), so onnxruntime does not compute and allocate them
    on each call; returns how many were dropped. Outputs are bit-identical, forwards faster
    (docs/decisions.md, 'Unread norm statistics, measured')."""
    read = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
    dropped = 0
    for node in model.graph.node:
        if node.op_type == "SkipSimplifiedLayerNormalization" and node.domain == MS_DOMAIN:
            for i in (1, 2):
                if i < len(node.output) and node.output[i] and node.output[i] not in read:
                    node.output[i] = ""
                    dropped += 1
    return dropped


def skip_rms_norm(x: torch.Tensor, skip: torch.Tensor, weight: torch.Tensor, eps: float):
    """x, skip [B, S, H] -> (RMSNorm(x + skip) * weight, x + skip), one fused node."""
    return _SkipRmsNorm.apply(x, skip, weight, float(eps))


ROTARY_SLACK = 1024  # table rows past max_position_embeddings: the KV rows runtimes add (trees, row-exact)


def rotary_rows(max_position_embeddings: int) -> int:
    """Positions a fused graph's rotary table holds (contract "shared" KV: position ids and
    total_seq must stay below it)."""
    return int(max_position_embeddings) + ROTARY_SLACK


class _GatherRows(torch.autograd.Function):
    """x [B, S, H], indices [B, N] -> x[b, indices[b, n]] [B, N, H] as one GatherND (batch_dims 1)."""

    @staticmethod
    def forward(ctx, x, indices):
        return gather_positions(x, indices)

    @staticmethod
    def symbolic(g, x, indices):
        axes = g.op("Constant", value_t=torch.tensor([-1], dtype=torch.int64))
        out = g.op("GatherND", x, g.op("Unsqueeze", indices, axes), batch_dims_i=1)
        out.setType(_like(x, 3))
        return out


def gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [B, S, H], indices [B, N] int64 -> [B, N, H] (the rows of each batch entry), one node
    in the graph (layers.gather_positions traces as ten with dynamic shapes)."""
    return _GatherRows.apply(x, indices)


def as_float32(logits: torch.Tensor) -> torch.Tensor:
    """`logits` in float32, with no Cast node when they already are (a graph output's Cast is
    a copy onnxruntime cannot remove)."""
    return logits if logits.dtype == torch.float32 else logits.float()


INT32 = 6  # onnx.TensorProto.INT32 (no onnx import at module load)


def _const(g, value, dtype=torch.int64):
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


class _RepeatOneRow(torch.autograd.Function):
    """Once per graph ("One-row queries" in the module doc): a call of S new tokens gets
    n = max(2 - S, 0) more attention rows. positions [B, S] -> [B, S + n] (the extra row one
    position on), bias [B, 1, S, T] -> [B, 1, S + n, T + n] (the extra row a copy of row 0; the
    extra column masked for every row: the operator's own causal mask hides it from row 0
    anyway), seqlens_k, total and query_lens + n; also the rows the layers gather q/k/v with
    (index [S + n] int64: 0 .. S - 1, then 0) and the rows they keep (keep [1] int64 = S).
    S >= 2: every tensor as it was (n = 0)."""

    @staticmethod
    def forward(ctx, positions, bias, seqlens_k, total, query_lens, masked):
        # tensor ops only on n: the tracer records this body too, and its peephole pass fails on
        # a size-derived Python int used as a value
        S = positions.shape[1]
        first = positions[:, :max(2 - S, 0)]  # (B, n): the rows repeated
        n = first.shape[1]
        extra = torch.ones_like(first[0]).sum().to(torch.int32)  # n, as a tensor
        positions = torch.cat([positions, first + 1], dim=1)  # (B, S + n)
        bias = torch.cat([bias, bias[:, :, :n]], dim=2)  # (B, 1, S + n, T)
        bias = torch.cat([bias, masked.expand(*bias.shape[:3], n)], dim=3)  # (B, 1, S + n, T + n)
        index = torch.cat([torch.ones_like(positions[0, :S]).cumsum(0) - 1, torch.zeros_like(first[0])])
        keep = torch.tensor([S], dtype=torch.int64)
        return positions, bias, seqlens_k + extra, total + extra, query_lens + extra, index, keep

    @staticmethod
    def symbolic(g, positions, bias, seqlens_k, total, query_lens, masked):
        keep = g.op("Shape", positions, start_i=1, end_i=2)  # [1]: S
        S = g.op("Squeeze", keep, _const(g, [0]))  # scalar
        n = g.op("Max", g.op("Sub", _const(g, 2), S), _const(g, 0))  # scalar: max(2 - S, 0)
        n1 = g.op("Unsqueeze", n, _const(g, [0]))  # [1]
        zero, one, two = _const(g, [0]), _const(g, [1]), _const(g, [2])
        extra = g.op("Add", g.op("Slice", positions, zero, n1, one), _const(g, 1))
        positions = g.op("Concat", positions, extra, axis_i=1)
        bias = g.op("Concat", bias, g.op("Slice", bias, zero, n1, two), axis_i=2)
        bias = g.op("Pad", bias, g.op("Concat", _const(g, [0] * 7), n1, axis_i=0), masked)  # T + n columns
        n32 = g.op("Cast", n, to_i=INT32)
        index = g.op("Mod", g.op("Range", _const(g, 0), g.op("Add", S, n), _const(g, 1)), S)
        outs = (positions, bias, g.op("Add", seqlens_k, n32), g.op("Add", total, n32), g.op("Add", query_lens, n32),
                index, keep)
        for out, like, rank in zip(outs, (positions, bias, seqlens_k, total, query_lens, keep, keep),
                                   (2, 4, 1, 0, 1, 1, 1)):
            out.setType(_like(like, rank))
        return outs


class _RepeatRows(torch.autograd.Function):
    """x [B, S, W], index [S + n] -> x[:, index] [B, S + n, W], one Gather (per layer: q/k/v)."""

    @staticmethod
    def forward(ctx, x, index):
        return x.index_select(1, index)

    @staticmethod
    def symbolic(g, x, index):
        out = g.op("Gather", x, index, axis_i=1)
        out.setType(_like(x, 3))
        return out


class _KeepRows(torch.autograd.Function):
    """x [B, S + n, W], keep [1] = S -> x[:, :S], one Slice (per layer: the attention output)."""

    @staticmethod
    def forward(ctx, x, keep):
        return x[:, :int(keep[0])]

    @staticmethod
    def symbolic(g, x, keep):
        out = g.op("Slice", x, _const(g, [0]), keep, _const(g, [1]))
        out.setType(_like(x, 3))
        return out


@dataclass
class FusedInputs:
    """What every layer's GroupQueryAttention takes besides its own q/k/v and KV, built once per
    forward from `position_ids` and `attention_mask`.

    cos / sin [R, hd/2]: the rotary table for positions 0 .. R - 1 (R = rotary_rows, a constant
    of the graph; the operator requires R >= total_sequence_length); positions [B, S] int64 =
    position_ids (row indices into cos / sin); bias [B, 1, S, T]
    (0 or MASK_VALUE, activation dtype); seqlens_k [B] int32 = past_b + S - 1: T - 1 for a lone
    row, and for each row of a batch of several its last new token's last visible column (rows
    may have different pasts, contract "Batched forwards"); total scalar int32 = T; query_lens
    [B] int32 = S.

    A graph that repeats one-row queries (`fused_inputs(repeat_one_row=True)`, module doc):
    positions, bias, seqlens_k, total and query_lens are those of S + n rows
    (n = max(2 - S, 0)); rows_index [S + n] int64: the rows each layer's q/k/v are gathered
    with; rows_kept [1] int64 = S: the attention output rows each layer keeps. None otherwise."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    bias: torch.Tensor
    seqlens_k: torch.Tensor
    total: torch.Tensor
    query_lens: torch.Tensor
    rows_index: torch.Tensor | None = None
    rows_kept: torch.Tensor | None = None


def fused_inputs(position_ids: torch.Tensor, attention_mask: torch.Tensor, rotary: Rotary,
                 dtype: torch.dtype, rows: int, repeat_one_row: bool = False) -> FusedInputs:
    """position_ids [B, S] int64, attention_mask [B, S, T] bool -> FusedInputs. The rotary table
    has `rows` positions (rotary_rows) computed exactly as `Rotary` computes them (fp32 position
    x inverse frequency, cos/sin, attention scaling, then `dtype`) from constants only, so the
    exporter folds it into two initializers. repeat_one_row: the layers' attention runs a
    one-token call as two rows (module doc, "One-row queries")."""
    shape = torch._shape_as_tensor(attention_mask)  # (B, S, T), traced as Shape
    freqs = torch.arange(rows, dtype=torch.float32).unsqueeze(-1) * rotary.inv_freq.to(position_ids.device)
    cos = (freqs.cos() * rotary.attention_scaling).to(dtype)  # (rows, hd/2)
    sin = (freqs.sin() * rotary.attention_scaling).to(dtype)
    zero = torch.zeros((), dtype=torch.float32)
    masked = torch.full((), MASK_VALUE, dtype=torch.float32)
    bias = torch.where(attention_mask, zero, masked).to(dtype)[:, None]  # (B, 1, S, T)
    ones = torch.ones_like(position_ids[:, 0], dtype=torch.int32)  # (B,)
    total = shape[2].to(torch.int32)
    T = attention_mask.shape[-1]
    columns = torch.arange(T, device=attention_mask.device, dtype=torch.int32)
    last_seen = (attention_mask[:, -1, :].to(torch.int32) * columns).amax(-1)  # (B,): past_b + S - 1
    # a lone row: past = T - S whatever its mask (rows may see nothing); several: each its own
    seqlens = torch.where(shape[0] > 1, last_seen, ones * (total - 1))
    query_lens = ones * shape[1].to(torch.int32)
    if not repeat_one_row:
        return FusedInputs(cos, sin, position_ids, bias, seqlens, total, query_lens)
    return FusedInputs(cos, sin, *_RepeatOneRow.apply(position_ids, bias, seqlens, total, query_lens, masked.to(dtype)))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, hd], cos/sin [B, 1, S, hd/2]: rotate-half RoPE."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _GroupQueryAttention(torch.autograd.Function):
    """com.microsoft GroupQueryAttention with do_rotary, attention_bias, query_seqlens and a
    past/present buffer shared in place (contract "shared" KV)."""

    @staticmethod
    def forward(ctx, q, k, v, past_k, past_v, seqlens_k, total, cos, sin, positions, bias, query_lens,
                num_heads: int, kv_heads: int, scale: float):
        """q [B, S, nh*hd] and k, v [B, S, kvh*hd], or q packed [B, S, (nh + 2 kvh)*hd] with k, v None.
        Row b's past is seqlens_k[b] + 1 - S (`total`, the widest row, sizes only the graph's inputs)."""
        B, S, _ = q.shape
        hd = past_k.shape[-1]
        if k is None:  # packed [q; k; v]
            q, k, v = q.split([num_heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        c = cos[positions].unsqueeze(1)  # (B, 1, S, hd/2)
        s = sin[positions].unsqueeze(1)
        q = _rotate(q.view(B, S, num_heads, hd).transpose(1, 2), c, s)  # (B, nh, S, hd)
        k = _rotate(k.view(B, S, kv_heads, hd).transpose(1, 2), c, s)  # (B, kvh, S, hd)
        v = v.view(B, S, kv_heads, hd).transpose(1, 2)
        present_k, present_v = past_k.clone(), past_v.clone()  # the graph writes in place; eagerly: a copy
        g = num_heads // kv_heads
        outs = []
        for b in range(B):  # row b's past: its own length (seqlens_k[b] + 1 - S), its new rows written after it
            P = int(seqlens_k[b]) + 1 - S
            present_k[b, :, P:P + S] = k[b]
            present_v[b, :, P:P + S] = v[b]
            keys = present_k[b, :, :P + S].repeat_interleave(g, dim=0)  # (nh, P + S, hd)
            values = present_v[b, :, :P + S].repeat_interleave(g, dim=0)
            scores = torch.matmul(q[b], keys.transpose(-1, -2)).float() * scale + bias[b, :, :, :P + S].float()
            causal = torch.arange(P + S, device=q.device)[None, :] > (P + torch.arange(S, device=q.device))[:, None]
            probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1).to(q.dtype)
            outs.append(torch.matmul(probs, values))  # (nh, S, hd)
        out = torch.stack(outs).transpose(1, 2).reshape(B, S, num_heads * hd)
        return out, present_k, present_v

    @staticmethod
    def symbolic(g, q, k, v, past_k, past_v, seqlens_k, total, cos, sin, positions, bias, query_lens,
                 num_heads: int, kv_heads: int, scale: float):
        none = _none(g)
        k, v = (none, none) if k is None else (k, v)
        out, pk, pv = g.op(f"{MS_DOMAIN}::GroupQueryAttention", q, k, v, past_k, past_v, seqlens_k, total, cos, sin,
                           positions, bias, none, none, none, none, none, query_lens,
                           num_heads_i=num_heads, kv_num_heads_i=kv_heads, do_rotary_i=1, scale_f=scale, outputs=3)
        out.setType(_like(q, 3))
        pk.setType(_like(past_k, 4))
        pv.setType(_like(past_v, 4))
        return out, pk, pv


class FusedAttention(nn.Module):
    """Grouped-query self-attention as one GroupQueryAttention node (RoPE inside, KV written in
    place into the shared [B, kvh, capacity, hd] buffers), reusing a transformers attention's
    projections; q, k and v come from one packed MatMul, as onnxruntime-genai's graphs have
    them (one node instead of three: fewer thread-pool dispatches per forward)."""

    def __init__(self, hf_attn: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.q_proj, self.k_proj = hf_attn.q_proj, hf_attn.k_proj
        self.v_proj, self.o_proj = hf_attn.v_proj, hf_attn.o_proj
        self.nh, self.kvh = num_heads, num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, x, f: FusedInputs, past_k, past_v):
        """x [B, S, H]; past_k/v [B, kvh, C, hd] -> (out [B, S, H], present_k/v [B, kvh, C, hd])."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        # one MatMul over [W_q; W_k; W_v] (constant-folded at export), fed to the operator packed
        w = torch.cat([p.weight for p in projs])
        b = None if self.q_proj.bias is None else torch.cat([p.bias for p in projs])
        qkv = nn.functional.linear(x, w, b)  # (B, S, (nh + 2 kvh) * hd)
        if f.rows_index is not None:  # a one-token call's row repeated (module doc, "One-row queries")
            qkv = _RepeatRows.apply(qkv, f.rows_index)  # (B, S + n, ..)
        out, k, v = _GroupQueryAttention.apply(qkv, None, None, past_k, past_v,
                                               f.seqlens_k, f.total, f.cos, f.sin, f.positions, f.bias, f.query_lens,
                                               self.nh, self.kvh, self.scale)
        if f.rows_kept is not None:
            out = _KeepRows.apply(out, f.rows_kept)  # (B, S, nh * hd)
        return self.o_proj(out), k, v


class FusedDecoderLayer(nn.Module):
    """Pre-norm decoder layer on fused operators. The residual stream is carried as
    (pending, residual) with stream = residual + pending, so the addition of one layer's MLP
    output is fused into the next layer's input norm (SkipSimplifiedLayerNormalization).
    `input_norm=False`: the EAGLE head's layer (no input norm)."""

    def __init__(self, hf_layer: nn.Module, dims, input_norm: bool = True):
        super().__init__()
        self.attn = FusedAttention(hf_layer.self_attn, dims.num_heads, dims.num_kv_heads, dims.head_dim)
        self.mlp = GatedMLP(hf_layer.mlp)
        self.input_norm = hf_layer.input_layernorm.weight if input_norm else None
        self.post_norm = hf_layer.post_attention_layernorm.weight
        self.eps = dims.rms_norm_eps

    def forward(self, pending, residual, f: FusedInputs, past_k, past_v):
        """(pending or None, residual [B, S, H]) -> (pending, residual, present_k, present_v)."""
        if self.input_norm is None:
            h = residual = residual if pending is None else residual + pending
        elif pending is None:
            h = rms_norm(residual, self.input_norm, self.eps)  # onnxruntime fuses this one at load
        else:
            h, residual = skip_rms_norm(pending, residual, self.input_norm, self.eps)
        attn, k, v = self.attn(h, f, past_k, past_v)
        h, residual = skip_rms_norm(attn, residual, self.post_norm, self.eps)
        return self.mlp(h), residual, k, v
