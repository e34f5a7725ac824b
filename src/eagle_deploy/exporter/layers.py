"""Export-friendly building blocks shared by the target forward and the EAGLE draft head.

Everything here takes explicit positions, an explicit boolean mask and an explicit past KV,
so nothing is decided at trace time (no mask or cache logic is traced from transformers).
Shapes: B = batch, S = new tokens, P = past rows, T = P + S, H = hidden, nh = query heads,
kvh = KV heads, g = nh // kvh, hd = head dim.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from eagle_deploy.contract.onnx_io import MASK_VALUE

# RoPE variants whose inverse frequencies do not depend on the sequence length, so that one
# graph is exact at every position.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the square-mean-rsqrt chain in fp32 whatever the activation dtype (a
    fp16 sum of squares overflows above 65504). x: [..., H] -> [..., H], x.dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """Rotary embedding computed from positions inside the graph (no cos/sin table sized to
    the trace length, which would freeze the rotary table there). Uses the checkpoint's own
    inverse frequencies and attention scaling as transformers computes them (default, linear,
    llama3 and yarn rope types)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        super().__init__()
        # a plain fp32 tensor, not a buffer: module-wide casts to fp16/bf16 must not round it
        self.inv_freq = inv_freq.detach().float().cpu().clone()  # [hd/2]
        self.attention_scaling = float(attention_scaling)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, S] int64 -> (cos, sin), each [B, S, 1, hd] in `dtype`."""
        inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids.float().unsqueeze(-1) * inv_freq  # (B, S, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, S, hd)
        cos = (emb.cos() * self.attention_scaling).to(dtype).unsqueeze(2)
        sin = (emb.sin() * self.attention_scaling).to(dtype).unsqueeze(2)
        return cos, sin


def rotate_half_matrix(head_dim: int) -> torch.Tensor:
    """R [hd, hd] with x @ R == cat(-x[..., hd/2:], x[..., :hd/2]) exactly (entries 0 and +-1):
    one MatMul in the graph instead of two slices, a negation and a concat."""
    half = head_dim // 2
    r = torch.zeros(head_dim, head_dim)
    r[torch.arange(half) + half, torch.arange(half)] = -1.0  # out[j] = -x[j + half] for j < half
    r[torch.arange(half), torch.arange(half) + half] = 1.0  # out[j + half] = x[j]
    return r


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: torch.Tensor) -> torch.Tensor:
    """x [..., hd] rotated by (cos, sin) broadcastable to x (rotate-half convention);
    `rotate` = rotate_half_matrix(hd) in x's dtype."""
    return x * cos + torch.matmul(x, rotate) * sin


def mask_bias(attention_mask: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Boolean mask [B, S, T] -> additive fp32 bias [B, 1, groups * S, T] (0 or MASK_VALUE),
    repeated for the `groups` query heads that share a KV head (row r = group * S + s, the
    row order of `Attention`'s grouped scores). Built once per forward, shared by all layers."""
    zero = torch.zeros((), dtype=torch.float32)
    masked = torch.full((), MASK_VALUE, dtype=torch.float32)
    bias = torch.where(attention_mask, zero, masked)[:, None]  # (B, 1, S, T)
    return bias if groups == 1 else torch.cat([bias] * groups, dim=2)


class Attention(nn.Module):
    """Grouped-query self-attention over a sequence-major past cache plus the new tokens.

    The past cache is never concatenated with the new keys: scores against the past and
    against the new tokens are computed separately and joined after the matmul (S x T, small).
    Softmax runs in fp32. Every reshape names at most the batch dimension (the rest are
    constants or -1) and RoPE's rotate-half is a constant matmul, which keeps the exported
    graph's per-layer glue small (fewer nodes, faster forwards, outputs bit-identical:
    docs/decisions.md, 'graph glue (the leaner unfused graph)').
    """

    def __init__(self, hf_attn: nn.Module, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.q_proj, self.k_proj = hf_attn.q_proj, hf_attn.k_proj
        self.v_proj, self.o_proj = hf_attn.v_proj, hf_attn.o_proj
        self.nh, self.kvh, self.hd = num_heads, num_kv_heads, head_dim
        self.g = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)
        # a plain tensor, not a buffer (no checkpoint key); cast to the activation dtype in forward
        self.rotate = rotate_half_matrix(head_dim)

    def forward(self, x, cos, sin, bias, past_k, past_v):
        """x [B, S, H]; cos/sin [B, S, 1, hd]; bias [B, 1, g*S, T] (mask_bias with groups=g);
        past_k/v [P, B, kvh, hd]. Returns (out [B, S, H], present_k/v [S, B, kvh, hd])."""
        B, P = x.shape[0], past_k.shape[0]
        kvh, g, hd = self.kvh, self.g, self.hd
        rotate = self.rotate.to(device=x.device, dtype=x.dtype)
        q = self.q_proj(x).view(B, -1, kvh, g, hd)  # (B, S, kvh, g, hd): query head h uses KV head h // g
        q = apply_rotary(q, cos.unsqueeze(2), sin.unsqueeze(2), rotate)
        k = apply_rotary(self.k_proj(x).view(B, -1, kvh, hd), cos, sin, rotate)  # (B, S, kvh, hd)
        v = self.v_proj(x).view(B, -1, kvh, hd)
        qg = q.permute(0, 2, 3, 1, 4).reshape(B, kvh, -1, hd)  # (B, kvh, g*S, hd)
        s_past = torch.matmul(qg, past_k.permute(1, 2, 3, 0))  # (B, kvh, g*S, P)
        s_new = torch.matmul(qg, k.permute(0, 2, 3, 1))  # (B, kvh, g*S, S)
        scores = torch.cat((s_past, s_new), dim=-1).float() * self.scale + bias  # (B, kvh, g*S, T)
        probs = torch.softmax(scores, dim=-1).to(x.dtype)
        out = torch.matmul(probs[..., :P], past_v.permute(1, 2, 0, 3))  # (B, kvh, g*S, hd)
        out = out + torch.matmul(probs[..., P:], v.permute(0, 2, 1, 3))
        out = out.view(B, kvh, g, -1, hd).permute(0, 3, 1, 2, 4).reshape(B, -1, self.nh * hd)  # (B, S, nh*hd)
        return self.o_proj(out), k.transpose(0, 1), v.transpose(0, 1)


class GatedMLP(nn.Module):
    """SwiGLU MLP reusing a transformers LlamaMLP's projections: down(silu(gate(x)) * up(x))."""

    def __init__(self, hf_mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = hf_mlp.gate_proj, hf_mlp.up_proj, hf_mlp.down_proj

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def gather_positions(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [B, S, H], indices [B, N] int64 -> [B, N, H]."""
    return torch.gather(x, 1, indices.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
