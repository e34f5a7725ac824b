"""The scale benchmark (bench/scale.py) on its `tiny` shape: it writes a sharded random
checkpoint of the named shape, exports it in a child process, and reports each export stage
with sampled memory, the output files, and the tools run on the export."""
from __future__ import annotations

import json

import pytest

from eagle_deploy.bench import scale


def test_shapes_have_the_published_parameter_counts():
    def params(shape):
        return sum(a * (b[0] if b else 1) for a, *b in (dims for _, dims in scale.tensor_shapes(scale.SHAPES[shape])))

    assert round(params("llama2-7b") / 1e9, 2) == 6.74  # Llama-2-7B: 6,738,415,616
    assert round(params("llama2-13b") / 1e9, 2) == 13.02
    assert round(params("llama3-8b") / 1e9, 2) == 8.03  # Llama-3-8B: 8,030,261,248


@pytest.mark.slow  # a child-process export plus eagle-validate and a Triton repository: ~12 s
def test_the_tiny_shape_is_exported_with_its_stages_and_memory(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(scale, "SHARD_BYTES", 40_000)  # several shards even for the tiny shape
    assert scale.main(["--shape", "tiny", "--work", str(tmp_path), "--json", str(tmp_path / "r.json"), "--keep",
                       "--check-tools"]) == 0
    shards = list((tmp_path / "tiny-random-fp16").glob("model-*.safetensors"))
    assert len(shards) >= 3
    result = json.loads((tmp_path / "r.json").read_text())
    names = [s["stage"] for s in result["stages"]]
    assert any(n.startswith("exporting target graph (float16") for n in names)
    assert any(n.startswith("exporting draft graph") for n in names) and names[-1].startswith("done: ")
    assert 0 < result["peak_anon_gib"] < 8 and result["wall_s"] > 0
    assert sum(s["samples"] for s in result["stages"]) > 0
    assert {"target.onnx", "draft.onnx", "manifest.json"} <= set(result["output_bytes"])
    repo, validate = result["tools"]
    assert repo["rc"] == 0 and (tmp_path / "triton-repo").is_dir()
    assert validate["rc"] == 0, validate["first_line"]
    out = capsys.readouterr().out
    assert "tiny --dtype fp16" in out and "peak anonymous" in out
