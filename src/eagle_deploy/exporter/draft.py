"""The draft graphs' forwards: a draft head (`eagle_deploy.heads`) wrapped as the contract's
draft graph (`contract/onnx_io.py`), with its top-k computed in-graph; beside the target's
(`target.ExportableTarget`).

    ExportableDraft     EAGLE-1/2 head (`heads.eagle12.EagleHead`)
"""
from __future__ import annotations

import torch
from torch import nn

from eagle_deploy.contract.onnx_io import KV_SEQ_MAJOR, KV_SHARED
from eagle_deploy.heads.eagle12 import EagleHead

from .fused import FusedDecoderLayer, as_float32, fused_inputs, gather_rows, rotary_rows
from .layers import gather_positions


class ExportableDraft(nn.Module):
    """Draft graph forward following `contract.py`: the head, then the top-k of its
    log-softmax computed in-graph at `logits_indices`.

    forward(features, input_ids, position_ids, attention_mask, logits_indices, past_k, past_v)
    -> (next_features [B,S,H], topk_logprobs [B,N,K] f32, topk_ids [B,N,K] int64, present_k, present_v).
    `draft_vocab` (optional [V'] int64 ids) restricts the head's LM head to those target
    tokens (a reduced draft vocabulary, as in FR-Spec); ids come back in the full vocabulary.
    kv_layout "shared": the head's layer on fused operators (exporter/fused.py), KV as for
    ExportableTarget.
    """

    def __init__(self, head: EagleHead, top_k: int, draft_vocab: torch.Tensor | None = None,
                 kv_layout: str = KV_SEQ_MAJOR):
        super().__init__()
        self.head = head
        self.top_k = top_k
        self.kv_layout = kv_layout
        # the head's layer on fused operators, outside the module tree (the head owns the weights)
        self.__dict__["_fused_layer"] = (FusedDecoderLayer(head.layers[0], head.dims, input_norm=False)
                                         if kv_layout == KV_SHARED else None)
        self.embed = head.embed  # registered here so the tracer sees the shared weights as parameters
        W = head.lm_head.weight
        if draft_vocab is not None:
            self.register_buffer("draft_vocab", draft_vocab.long().clone())
            self.lm_weight = nn.Parameter(W.detach()[draft_vocab].clone(), requires_grad=False)
        else:
            self.draft_vocab = None
            self.lm_weight = W

    def forward(self, features, input_ids, position_ids, attention_mask, logits_indices, past_k, past_v):
        if self._fused_layer is None:
            x, k, v = self.head(features, input_ids, position_ids, attention_mask, past_k, past_v)
            rows = gather_positions(x, logits_indices)
        else:
            x = self.head.fc_input(features, input_ids)
            f = fused_inputs(position_ids, attention_mask, self.head.rotary, x.dtype,
                             rotary_rows(self.head.dims.max_position_embeddings))
            pending, x, k, v = self._fused_layer(None, x, f, past_k, past_v)
            x = x + pending
            rows = gather_rows(x, logits_indices)
        logits = as_float32(torch.matmul(rows, self.lm_weight.t()))  # (B, N, V')
        logprobs, ids = torch.topk(torch.log_softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.draft_vocab is not None:
            ids = self.draft_vocab[ids]
        return x, logprobs, ids, k, v
