"""The draft graphs' forwards: a draft head (`eagle_deploy.heads`) wrapped as the contract's
draft graph (`contract/onnx_io.py`), with its top-k computed in-graph; beside the target's
(`target.ExportableTarget`).

    ExportableDraft     EAGLE-1/2 head (`heads.eagle12.EagleHead`)
    ExportableDraft3    EAGLE-3 head (`heads.eagle3.Eagle3Head`): fc fusion of the target's
                        taps, the head's norm and LM head, d2t, all in-graph
"""
from __future__ import annotations

import torch
from torch import nn

from eagle_deploy.contract.onnx_io import KV_SEQ_MAJOR, KV_SHARED
from eagle_deploy.heads.eagle3 import Eagle3Head
from eagle_deploy.heads.eagle12 import EagleHead

from .fused import FusedAttention, FusedDecoderLayer, as_float32, fused_inputs, gather_rows, rotary_rows, skip_rms_norm
from .layers import GatedMLP, gather_positions


class ExportableDraft(nn.Module):
    """Draft graph forward following `contract.py`: the head, then the top-k of its
    log-softmax computed in-graph at `logits_indices`.

    forward(features, input_ids, position_ids, attention_mask, logits_indices, *past (2 per
    head layer)) -> (next_features [B,S,H], topk_logprobs [B,N,K] f32, topk_ids [B,N,K] int64,
    *present (2 per head layer)); one layer: past_k, past_v in, present_k, present_v out.
    `draft_vocab` (optional [V'] int64 ids) restricts the head's LM head to those target
    tokens (a reduced draft vocabulary, as in FR-Spec); ids come back in the full vocabulary.
    kv_layout "shared": the head's layers on fused operators (exporter/fused.py), KV as for
    ExportableTarget.
    """

    def __init__(self, head: EagleHead, top_k: int, draft_vocab: torch.Tensor | None = None,
                 kv_layout: str = KV_SEQ_MAJOR):
        super().__init__()
        self.head = head
        self.top_k = top_k
        self.kv_layout = kv_layout
        # the head's layers on fused operators, outside the module tree (the head owns the
        # weights); the first without input norm, as in the head
        self.__dict__["_fused_layers"] = ([FusedDecoderLayer(layer, head.dims, input_norm=i > 0)
                                           for i, layer in enumerate(head.layers)] if kv_layout == KV_SHARED else None)
        self.embed = head.embed  # registered here so the tracer sees the shared weights as parameters
        W = head.lm_head.weight
        if draft_vocab is not None:
            self.register_buffer("draft_vocab", draft_vocab.long().clone())
            self.lm_weight = nn.Parameter(W.detach()[draft_vocab].clone(), requires_grad=False)
        else:
            self.draft_vocab = None
            self.lm_weight = W

    def forward(self, features, input_ids, position_ids, attention_mask, logits_indices, *past):
        if self._fused_layers is None:
            x, *presents = self.head(features, input_ids, position_ids, attention_mask, *past)
            rows = gather_positions(x, logits_indices)
        else:
            pairs = self.head.kv_pairs(past)
            x = self.head.fc_input(features, input_ids)
            f = fused_inputs(position_ids, attention_mask, self.head.rotary, x.dtype,
                             rotary_rows(self.head.dims.max_position_embeddings))
            pending, presents = None, []
            for layer, (past_k, past_v) in zip(self._fused_layers, pairs):  # each residual add fused into the next norm
                pending, x, k, v = layer(pending, x, f, past_k, past_v)
                presents += [k, v]
            x = x + pending
            rows = gather_rows(x, logits_indices)
        logits = as_float32(torch.matmul(rows, self.lm_weight.t()))  # (B, N, V')
        logprobs, ids = torch.topk(torch.log_softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.draft_vocab is not None:
            ids = self.draft_vocab[ids]
        return (x, logprobs, ids, *presents)


class _FusedEagle3Layer(nn.Module):
    """Eagle3Head.layer on onnxruntime's fused operators (GroupQueryAttention with rotary,
    SkipSimplifiedLayerNormalization), KV layout "shared" (exporter/fused.py)."""

    def __init__(self, head: Eagle3Head):
        super().__init__()
        self.__dict__["head"] = head
        cfg = head.cfg
        self.attn = FusedAttention(head.midlayer.self_attn, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.mlp = GatedMLP(head.midlayer.mlp)

    def forward(self, h, input_ids, position_ids, attention_mask, past_k, past_v):
        head = self.head
        x, residual = head.attention_input(h, input_ids)
        f = fused_inputs(position_ids, attention_mask, head.rotary, h.dtype,
                         rotary_rows(head.cfg.max_position_embeddings))
        attn, k, v = self.attn(x, f, past_k, past_v)
        normed, x = skip_rms_norm(attn, residual, head.midlayer.post_attention_layernorm.weight, head.cfg.rms_norm_eps)
        return x + self.mlp(normed), k, v


class ExportableDraft3(nn.Module):
    """The EAGLE-3 draft graph (contract: onnx_io, "EAGLE-3 exports"): the head, its norm and
    LM head over the draft vocabulary, top-k of the log-softmax at `logits_indices`, and the
    draft -> target id mapping, all in-graph.

    forward(tapped_features [B,T,n*H_t], features [B,S-T,H], input_ids, position_ids,
    attention_mask, logits_indices, past_k, past_v) -> (next_features [B,S,H], topk_logprobs
    [B,N,K] f32, topk_ids [B,N,K] int64 target ids, present_k, present_v).
    """

    def __init__(self, head: Eagle3Head, top_k: int, kv_layout: str = KV_SEQ_MAJOR):
        super().__init__()
        self.head = head
        self.top_k = top_k
        self.kv_layout = kv_layout
        self.__dict__["_fused_layer"] = _FusedEagle3Layer(head) if kv_layout == KV_SHARED else None
        self.embed = head.embed  # registered here so the tracer sees shared weights as parameters
        self.register_buffer("draft_ids", head.draft_to_target.clone())

    def forward(self, tapped_features, features, input_ids, position_ids, attention_mask, logits_indices, past_k,
                past_v):
        h = torch.cat((self.head.fuse(tapped_features), features), dim=1)
        layer = self.head.layer if self._fused_layer is None else self._fused_layer
        x, k, v = layer(h, input_ids, position_ids, attention_mask, past_k, past_v)
        gather = gather_positions if self._fused_layer is None else gather_rows
        logits = self.head.logits(gather(x, logits_indices))  # (B, N, draft_vocab)
        logprobs, idx = torch.topk(torch.log_softmax(logits, dim=-1), self.top_k, dim=-1)
        return x, logprobs, self.draft_ids[idx], k, v
