"""The PyTorch reference backend: the exporter's own torch modules run eagerly behind the
same `Backend` protocol (for tests, `eagle-validate` and training-time evaluation). Unlike
the other backends it imports torch and the model code."""
from __future__ import annotations

import numpy as np

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import Dims
from eagle_deploy.runtime.backends.base import StepInputs, StepOutputs, outputs_from_named
from eagle_deploy.runtime.kv import KVBuffer


class TorchBackend:
    """Runs an `ExportableTarget` or `ExportableDraft` (fp32, CPU unless moved); `num_layers`:
    the layers whose KV the module takes (a draft head's own, for a draft)."""

    def __init__(self, module, num_layers: int, dims: Dims, dtype=np.float32, name: str = "torch"):
        import torch

        self.torch = torch
        self.module = module.eval()
        self.name = name
        self.is_draft = hasattr(module, "head")  # ExportableDraft(3), Eagle3Reference: the head's layers
        self.is_eagle3 = self.is_draft and hasattr(module, "draft_ids")
        self.kv_names = c.kv_names(num_layers)
        self.dims = dims
        self.dtype = dtype
        self.device = next(module.parameters()).device

    @classmethod
    def target(cls, hf_model, feature_layers=None) -> "TorchBackend":
        """The target graph's forward (with `tapped_features` for an EAGLE-3 export's layers)."""
        from eagle_deploy.exporter.target import ExportableTarget

        module = ExportableTarget(hf_model, feature_layers=feature_layers)
        return cls(module, module.dims.num_layers, module.dims, name="torch-target")

    @classmethod
    def draft(cls, head, top_k: int = 10) -> "TorchBackend":
        """The draft graph's forward of an EagleHead or an Eagle3Head (exporter modules)."""
        from eagle_deploy.exporter.draft import ExportableDraft, ExportableDraft3
        from eagle_deploy.heads.eagle3 import Eagle3Head

        module = ExportableDraft3(head, top_k) if isinstance(head, Eagle3Head) else ExportableDraft(head, top_k)
        return cls(module, head.dims.num_layers, head.dims, name="torch-draft")

    def allocate_kv(self, capacity: int) -> KVBuffer:
        return KVBuffer.allocate(self.kv_names, capacity, 1, self.dims.num_kv_heads, self.dims.head_dim, self.dtype)

    def forward(self, feeds: dict[str, np.ndarray],
                past: list[np.ndarray]) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
        """Stateless forward: contract feeds + past arrays -> (outputs by name, present arrays)."""
        t = lambda a: self.torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        heads = [c.TAPPED_FEATURES, c.FEATURES] if self.is_eagle3 else [c.FEATURES] if self.is_draft else []
        args = [t(feeds[n]) for n in heads] + [
            t(feeds[n]) for n in (c.INPUT_IDS, c.POSITION_IDS, c.ATTENTION_MASK, c.LOGITS_INDICES)]
        with self.torch.no_grad():
            outs = self.module(*args, *[t(p) for p in past])
        outs = [o.detach().cpu().numpy() for o in outs]
        names = [c.NEXT_FEATURES, c.TOPK_LOGPROBS, c.TOPK_IDS] if self.is_draft else [c.LOGITS, c.FEATURES]
        if getattr(self.module, "feature_layers", ()):
            names.append(c.TAPPED_FEATURES)
        return dict(zip(names, outs)), outs[len(names):]

    def run(self, inputs: StepInputs, kv: KVBuffer, past: int) -> StepOutputs:
        S = inputs.input_ids.shape[1]
        kv.check(past, S)
        inputs.check(past)
        inputs.check_single(self.name)
        results, presents = self.forward(inputs.feeds(), [a[:past] for a in kv.arrays])
        for a, new in zip(kv.arrays, presents):
            a[past:past + S] = new
        return outputs_from_named(results)
