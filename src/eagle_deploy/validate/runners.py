"""The Polygraphy runners eagle-validate compares: the PyTorch reference (`torch_runner`, the
exporter's own torch modules) and each graph's onnxruntime runners (`graph_runners`: as
shipped, a quantised graph's fp32-activation copy, a TensorRT engine when one is listed and
tensorrt imports). Polygraphy is imported by the functions that build runners, so
`eagle-validate --help` loads none of it."""
from __future__ import annotations

import importlib.util
import time
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import numpy as np

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.profiles import ProfileSpec
from eagle_deploy.exporter.external_data import load_model
from eagle_deploy.exporter.prefill import PER_TOKEN
from eagle_deploy.exporter.quantize import save_graph_in_place, with_fp32_activations

from .compare import to_numpy
from .feeds import reference_forward

REFERENCE = "torch-reference"
FP32_ACTIVATIONS = "onnxrt-fp32act"  # a quantised graph with accuracy_level 0: same weights, fp32 activations


def torch_runner(backend, graph, name: str = REFERENCE):
    """A Polygraphy runner over a TorchBackend (the exporter's torch module, fp32)."""
    from polygraphy.backend.base import BaseRunner
    from polygraphy.common import TensorMetadata
    from polygraphy.datatype import DataType

    class TorchRunner(BaseRunner):
        def __init__(self):
            super().__init__(name=name, prefix="torch-runner")

        def activate_impl(self):
            self.forward = reference_forward(backend)

        def get_input_metadata_impl(self):
            meta = TensorMetadata()
            for spec in graph.inputs:
                meta.add(spec.name, dtype=DataType.from_dtype(np.dtype(spec.dtype)),
                         shape=[d if isinstance(d, int) else None for d in spec.shape])
            return meta

        def infer_impl(self, feed_dict):
            t0 = time.perf_counter()
            feeds = {k: to_numpy(v) for k, v in feed_dict.items()}
            shared = graph.kv_layout == c.KV_SHARED  # past [1, kvh, P, hd] in, present [1, kvh, P + S, hd] out
            past = {p: feeds[p] for p, _ in backend.kv_names}
            if shared:
                feeds.update({p: a.transpose(2, 0, 1, 3) for p, a in past.items()})
            outs, presents = self.forward(feeds)
            if shared:
                presents = [np.concatenate([past[p], new.transpose(1, 2, 0, 3)], axis=2)
                            for (p, _), new in zip(backend.kv_names, presents)]
            result = OrderedDict(outs)
            result.update(zip([q for _, q in backend.kv_names], presents))
            self.inference_time = time.perf_counter() - t0  # Comparator.run sums it (must be set)
            return result

        def deactivate_impl(self):
            del self.forward

    return TorchRunner()


def has_fp32_copy(graph) -> bool:
    """Whether a quantised graph is also run with fp32 activations (FP32_ACTIVATIONS): yes but
    for the prefill graph, whose int8 x int8 matmuls have no such setting."""
    return bool(graph.quant) and (graph.quant_info is None or graph.quant_info.method != PER_TOKEN)


def graph_runners(folder: Path, manifest, which: str, work: Path | None = None) -> tuple[list, list[str]]:
    """([OnnxrtRunner, (OnnxrtRunner with fp32 activations: has_fp32_copy), (TrtRunner)], notes)
    for graph `which` of the export. A quantised graph's fp32-activation copy is written to `work`
    (`<which>_fp32act.onnx`) when given."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    graph = getattr(manifest, which)
    runners = [OnnxrtRunner(SessionFromOnnx(str(folder / graph.path)), name="onnxrt")]
    if has_fp32_copy(graph):
        runners.append(OnnxrtRunner(SessionFromOnnx(fp32_activation_graph(folder / graph.path, work, which)),
                                    name=FP32_ACTIVATIONS))
    notes = []
    record = manifest.engines.trt
    if record is not None and which in record.files:
        if importlib.util.find_spec("tensorrt") is None:
            notes.append(f"{which}: TensorRT engine listed but tensorrt is not importable: not compared")
        else:
            runners.append(trt_runner(folder / record.files[which], record.profiles.get(which, ())))
    return runners, notes


def fp32_activation_graph(path: Path, work: Path | None, which: str):
    """The quantised graph at `path` with fp32 activations (exporter.quantize.with_fp32_activations):
    saved as `work/<which>_fp32act.onnx` (path returned) or, without `work`, serialised bytes."""
    model = with_fp32_activations(load_model(path))
    if work is None:
        return model.SerializeToString()
    out = Path(work) / f"{which}_fp32act.onnx"
    save_graph_in_place(model, out)
    return str(out)


def trt_runner(engine_path: Path, profiles: Sequence[ProfileSpec]):
    """Polygraphy's TrtRunner, switching to the first optimization profile that fits each feed."""
    from polygraphy.backend.common import BytesFromPath
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    def fits(shapes: dict, feed: dict) -> bool:
        return all(all(lo <= d <= hi for lo, d, hi in zip(mom[0], feed[n].shape, mom[2]))
                   for n, mom in shapes.items() if n in feed)

    class ProfileTrtRunner(TrtRunner):
        def infer_impl(self, feed_dict, *args, **kwargs):
            index = next((i for i, p in enumerate(profiles) if fits(p.shapes, feed_dict)), 0)
            self.set_profile(index)
            return super().infer_impl(feed_dict, *args, **kwargs)

    return ProfileTrtRunner(EngineFromBytes(BytesFromPath(str(engine_path))), name="trt")
