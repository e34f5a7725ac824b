"""Export steps, each named for what it builds from what (as Polygraphy's loaders are).

    OnnxFromModule      torch module + contract       -> .onnx (+ external data when large)
    TargetOnnxFromHF    transformers model (or its    -> target.onnx   (GraphEntry), weights
                        skeleton + checkpoint reader)    written one tensor at a time
    DraftOnnxFromHead   EAGLE head (+ target weights) -> draft.onnx    (DraftEntry)
    TokenizerFromHF     transformers folder           -> tokenizer/
"""
from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.dtypes import FLOAT_NAMES
from eagle_deploy.contract.manifest import DraftEntry, GraphEntry, HeadRecord
from eagle_deploy.heads.eagle3 import Eagle3Head
from eagle_deploy.heads.eagle12 import EagleHead

from .draft import ExportableDraft, ExportableDraft3
from .external_data import TensorFile, data_file_of, place_graph, use_external_data
from .fused import drop_unused_norm_statistics
from .streamed import fill_weights, onnx_with_weight_inputs
from .target import ExportableTarget

OPSET = 17
TORCH_DTYPES = {name: getattr(torch, name) for name in FLOAT_NAMES}  # export precision -> torch dtype


def _dynamic_axes(specs) -> dict[str, dict[int, str]]:
    return {s.name: {i: d for i, d in enumerate(s.shape) if isinstance(d, str)} for s in specs}


def trace_inputs(dims, dtype: torch.dtype, layers: int, hidden_input: bool, seq: int = 3, past: int = 2,
                 kv_layout: str = c.KV_SEQ_MAJOR, tapped_width: int | None = None) -> tuple:
    """Small dummy inputs for tracing (seq 3, past 2; a shared KV buffer has 2 spare rows); no
    size is baked into the graph. tapped_width (an EAGLE-3 draft): 2 rows of
    `tapped_features` then 1 row of own `features`."""
    ids = torch.arange(seq, dtype=torch.int64)[None] % dims.vocab
    pos = torch.arange(past, past + seq, dtype=torch.int64)[None]
    mask = torch.ones(1, seq, past + seq, dtype=torch.bool)
    mask[0, :, past:] = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
    idx = torch.tensor([[seq - 2, seq - 1]], dtype=torch.int64)
    shape = ((1, dims.num_kv_heads, past + seq + 2, dims.head_dim) if kv_layout == c.KV_SHARED
             else (past, 1, dims.num_kv_heads, dims.head_dim))
    kv = [torch.zeros(shape, dtype=dtype) for _ in range(2 * layers)]
    head = (torch.zeros(1, seq, dims.hidden, dtype=dtype),) if hidden_input else ()
    if tapped_width:
        head = (torch.zeros(1, seq - 1, tapped_width, dtype=dtype), torch.zeros(1, 1, dims.hidden, dtype=dtype))
    return (*head, ids, pos, mask, idx, *kv)


@dataclass
class OnnxFromModule:
    """Trace `module` with the TorchScript exporter into `path` following (inputs, outputs).

    external_data: "auto" (external data above 2 GiB of weights), "always" or "never".
    Writes `<file>.data` beside the graph when external."""

    external_data: str = "auto"

    def __call__(self, module: torch.nn.Module, args: tuple, inputs, outputs, path: Path) -> None:
        import onnx

        path = Path(path)
        weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        external = use_external_data(self.external_data, weight_bytes, path.name)
        with tempfile.TemporaryDirectory(dir=path.parent) as scratch:  # whatever torch spills stays here
            raw = Path(scratch) / path.name
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(module, args, str(raw), input_names=[s.name for s in inputs],
                                  output_names=[s.name for s in outputs], dynamic_axes=_dynamic_axes(inputs + outputs),
                                  opset_version=OPSET, do_constant_folding=True, dynamo=False,
                                  custom_opsets={"com.microsoft": 1})  # fused graphs: onnxruntime contrib ops
            model = onnx.load(str(raw), load_external_data=True)
        drop_unused_norm_statistics(model)  # fused graphs: the norms' unread optional outputs
        if external:
            onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=path.name + ".data", size_threshold=1024)
        else:
            onnx.save_model(model, str(path))


@dataclass
class TargetOnnxFromHF:
    """transformers model (a supported family) -> target.onnx; returns its GraphEntry.
    kv_layout: contract KV_SHARED (fused onnxruntime operators) or KV_SEQ_MAJOR (standard ops).

    The model's parameters may be on the meta device (exporter/weights.py `skeleton_target`):
    the graph is traced with its weights as inputs and `read(parameter)` gives each weight its
    value, one tensor at a time, as it is written (exporter/streamed.py); without `read` the
    parameters' own values are used. Either way the graph equals a constant-folded trace with
    the real weights."""

    dtype: str = "float32"
    external_data: str = "auto"
    kv_layout: str = c.KV_SEQ_MAJOR
    feature_layers: tuple[int, ...] | None = None  # an EAGLE-3 export: the layers whose input is tapped
    repeat_one_row: bool = False  # fused only: attention repeats a one-row query itself (GraphEntry.repeats_one_row)

    def __call__(self, hf_model: torch.nn.Module, folder: Path,
                 read: Callable[[torch.nn.Parameter], torch.Tensor] | None = None) -> GraphEntry:
        dtype = TORCH_DTYPES[self.dtype]
        module = ExportableTarget(hf_model, self.kv_layout, self.feature_layers, self.repeat_one_row).eval()
        taps = len(self.feature_layers) * module.dims.hidden if self.feature_layers else None
        inputs, outputs = c.target_io(module.dims.num_layers, self.dtype, self.kv_layout, taps)
        args = trace_inputs(module.dims, dtype, module.dims.num_layers, hidden_input=False, kv_layout=self.kv_layout)
        model, params = onnx_with_weight_inputs(module, args, [s.name for s in inputs], [s.name for s in outputs],
                                                _dynamic_axes(inputs + outputs), OPSET)
        drop_unused_norm_statistics(model)  # fused graphs: the norms' unread optional outputs
        path = Path(folder) / c.TARGET_FILE
        with TensorFile(path.parent / data_file_of(path)) as out:
            fill_weights(model, params, read or (lambda p: p.detach().to(dtype=dtype, copy=True)), out,
                         last_dim=module.dims.vocab)
        place_graph(model, path, path.parent, self.external_data)  # weights in <graph>.data, or inline if small
        return GraphEntry(path=c.TARGET_FILE, dtype=self.dtype, inputs=inputs, outputs=outputs,
                          feature_layers=tuple(self.feature_layers) if self.feature_layers else None,
                          ragged_batch=self.kv_layout == c.KV_SHARED, repeats_one_row=self.repeat_one_row)


@dataclass
class DraftOnnxFromHead:
    """EAGLE-1/2 head (EagleHead) or EAGLE-3 head (Eagle3Head) bound to its target ->
    draft.onnx with in-graph top-k; returns its DraftEntry with the head's HeadRecord and
    decoder layer count (trained=True: the caller records a random head). An EAGLE-3 head
    brings its own draft vocabulary (`draft_vocab` must be None)."""

    dtype: str = "float32"
    top_k: int = 10
    draft_vocab: torch.Tensor | None = None
    external_data: str = "auto"
    kv_layout: str = c.KV_SEQ_MAJOR

    def __call__(self, head: EagleHead | Eagle3Head, folder: Path) -> DraftEntry:
        if isinstance(head, Eagle3Head):
            if self.draft_vocab is not None:
                raise ValueError("an EAGLE-3 head has its own draft vocabulary (d2t); no reduced vocabulary applies")
            module = ExportableDraft3(head, self.top_k, self.kv_layout).eval()
            record, vocab_size = head.record, head.cfg.draft_vocab
            tapped = record.tapped_width(head.cfg.target_hidden)
        else:
            module = ExportableDraft(head, self.top_k, self.draft_vocab, self.kv_layout).eval()
            record = HeadRecord(kind="eagle")
            vocab_size = int(len(self.draft_vocab)) if self.draft_vocab is not None else head.dims.vocab
            tapped = None
        layers = head.dims.num_layers  # the head's decoder layers (EAGLE-3: 1)
        inputs, outputs = c.draft_io(self.dtype, self.top_k, self.kv_layout, tapped, layers)
        args = trace_inputs(head.dims, TORCH_DTYPES[self.dtype], layers, hidden_input=True, kv_layout=self.kv_layout,
                            tapped_width=tapped)
        OnnxFromModule(self.external_data)(module, args, inputs, outputs, Path(folder) / c.DRAFT_FILE)
        return DraftEntry(path=c.DRAFT_FILE, dtype=self.dtype, inputs=inputs, outputs=outputs,
                          graph_top_k=self.top_k, trained=True, draft_vocab_size=vocab_size,
                          max_position_embeddings=head.dims.max_position_embeddings, head=record,
                          ragged_batch=self.kv_layout == c.KV_SHARED, num_layers=layers)


@dataclass
class TokenizerFromHF:
    """transformers folder -> `tokenizer/` in the export (None when the folder has none)."""

    def __call__(self, hf_dir: Path, folder: Path):
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(hf_dir), trust_remote_code=False)
        except (OSError, ValueError, TypeError):
            return None
        tok.save_pretrained(str(Path(folder) / c.TOKENIZER_DIR))
        return tok
