"""One copy of the weights the draft graph takes from the target (exporter/share.py): the
token embedding (and, with a full draft vocabulary, the LM head) lives once in `shared.data`,
referenced by both graphs and recorded in the manifest; a reduced draft vocabulary keeps its
own LM-head rows; quantised exports share the target's quantised form; greedy EAGLE still
equals the reference."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import Manifest
from eagle_deploy.exporter.share import matching_tensors
from tests import tiny
from tests.conftest import PROMPTS


def _external(folder, graph_file: str) -> dict[str, ExternalDataInfo]:
    """{initializer name: its external-data info} of a graph, data not loaded."""
    model = onnx.load(str(folder / graph_file), load_external_data=False)
    return {t.name: ExternalDataInfo(t) for t in model.graph.initializer if uses_external_data(t)}


def _shared_array(folder, t) -> np.ndarray:
    raw = (folder / c.SHARED_WEIGHTS_FILE).read_bytes()[t.offset:t.offset + t.length]
    return np.frombuffer(raw, dtype=t.dtype).reshape(t.shape)


@pytest.fixture(scope="module")
def exports(mha, tmp_path_factory) -> dict:
    """{"reduced": --draft-vocab 48 (random head: ranked by the tokenizer), "int4": --quant int4
    (full draft vocabulary)} of the tiny MHA target."""
    from eagle_deploy.exporter.export import ExportOptions, export

    root = tmp_path_factory.mktemp("shared")
    return {"reduced": export(str(mha.target_dir), "random", root, ExportOptions(max_length=128, draft_vocab=48,
                                                                                  name="reduced", draft_quant="none"),
                              progress=None),
            "int4": export(str(mha.target_dir), str(mha.head_dir), root,
                           ExportOptions(max_length=128, quant="int4", name="int4"), progress=None)}


def test_full_vocabulary_export_shares_the_embedding_and_the_lm_head_once(mha):
    folder, m = mha.export_dir, mha.manifest
    shared = m.shared_weights
    assert shared.file == c.SHARED_WEIGHTS_FILE == "shared.data" and m.draft.draft_vocab_size == m.dims.vocab
    assert [t.role for t in shared.tensors] == ["embedding", "lm_head"]
    assert (folder / shared.file).stat().st_size == shared.size
    target_ext, draft_ext = _external(folder, c.TARGET_FILE), _external(folder, c.DRAFT_FILE)
    for t in shared.tensors:
        assert t.offset % c.SHARED_ALIGNMENT == 0
        for ext, name in ((target_ext, t.target_name), (draft_ext, t.draft_name)):  # both graphs point at one copy
            assert ext[name].location == shared.file and (ext[name].offset, ext[name].length) == (t.offset, t.length)
    embed = _shared_array(folder, shared.tensors[0])
    np.testing.assert_array_equal(embed, mha.hf.model.embed_tokens.weight.detach().numpy())
    lm_head = _shared_array(folder, shared.tensors[1])  # the MatMul weight, [hidden, vocab]
    np.testing.assert_array_equal(lm_head, mha.hf.lm_head.weight.detach().numpy().T)
    # nothing vocabulary-sized is left inside draft.onnx itself
    draft = onnx.load(str(folder / c.DRAFT_FILE), load_external_data=False)
    inline = [t.name for t in draft.graph.initializer if not uses_external_data(t) and m.dims.vocab in t.dims]
    assert inline == []


def test_reduced_draft_vocabulary_shares_only_the_embedding(exports, mha):
    folder = exports["reduced"]
    m = Manifest.load(folder)
    assert m.draft.draft_vocab_size == 48 and m.draft.draft_vocab_source == "token_id"  # byte tokenizer: no merges
    assert [t.role for t in m.shared_weights.tensors] == ["embedding"]
    assert (folder / "draft_vocab.npy").exists()
    # the 48 LM-head rows (a [hidden, 48] MatMul weight) are the draft graph's own, inline
    draft = onnx.load(str(folder / c.DRAFT_FILE), load_external_data=False)
    rows = [t for t in draft.graph.initializer if list(t.dims) == [m.dims.hidden, 48]]
    assert rows and not any(uses_external_data(t) for t in rows)


def test_reduced_vocabulary_export_stays_lossless(exports, mha):
    from eagle_deploy.runtime.api import EagleRuntime

    rt = EagleRuntime.load(exports["reduced"], threads=1)
    for prompt in PROMPTS:
        got = rt.generate(prompt, max_new_tokens=40).token_ids
        assert got == mha.expected(prompt, 40)
        assert got == rt.generate(prompt, max_new_tokens=40, mode="vanilla").token_ids


def test_quantised_export_shares_the_target_quantised_lm_head(exports):
    folder = exports["int4"]
    m = Manifest.load(folder)
    roles = {(t.role, t.dtype) for t in m.shared_weights.tensors}
    # the embedding stays fp32 (not quantised in the target either); the LM head is shared as the
    # target's own MatMulNBits blobs (uint8) and scales
    assert ("embedding", "float32") in roles and ("lm_head", "uint8") in roles and ("lm_head", "float32") in roles
    target = onnx.load(str(folder / c.TARGET_FILE), load_external_data=False)
    nbits_inputs = {i for n in target.graph.node if n.op_type == "MatMulNBits" for i in n.input}
    assert {t.target_name for t in m.shared_weights.tensors if t.role == "lm_head"} <= nbits_inputs
    from eagle_deploy.runtime.api import EagleRuntime

    rt = EagleRuntime.load(folder, threads=1)
    for prompt in PROMPTS[:2]:
        assert (rt.generate(prompt, max_new_tokens=24).token_ids
                == rt.generate(prompt, max_new_tokens=24, mode="vanilla").token_ids)


def _model(initializers) -> onnx.ModelProto:
    graph = helper.make_graph([], "g", [], [], [numpy_helper.from_array(a, n) for n, a in initializers.items()])
    return helper.make_model(graph)


def test_only_identical_vocabulary_sized_tensors_are_shared():
    rng = np.random.default_rng(0)
    vocab = 32
    embed, rot = rng.standard_normal((vocab, 8)).astype(np.float32), np.eye(4, dtype=np.float32)
    other = rng.standard_normal((vocab, 8)).astype(np.float32)
    target = _model({"embed": embed, "rot": rot, "lm": other})
    draft = _model({"e": embed.copy(), "r": rot.copy(), "lm_rows": other[:16].copy(), "near": other + 1e-6})
    found = matching_tensors(target, draft, vocab)
    assert [(role, t.name, d.name) for role, t, d in found] == [("lm_head", "embed", "e")]  # no Gather here


def test_a_target_gather_table_is_the_embedding():
    vocab = 16
    embed = np.arange(vocab * 4, dtype=np.float32).reshape(vocab, 4)
    graph = helper.make_graph([helper.make_node("Gather", ["embed", "ids"], ["x"])], "t",
                              [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
                              [numpy_helper.from_array(embed, "embed")])
    found = matching_tensors(helper.make_model(graph), _model({"embed_copy": embed.copy()}), vocab)
    assert [(role, t.name, d.name) for role, t, d in found] == [("embedding", "embed", "embed_copy")]


def test_graphs_still_load_alone_with_plain_onnxruntime(mha):
    """Each graph references shared.data itself, so tools that open one graph (polygraphy,
    TensorRT's parser, a bare InferenceSession) still work."""
    import onnxruntime as ort

    for graph in (c.TARGET_FILE, c.DRAFT_FILE):
        sess = ort.InferenceSession(str(mha.export_dir / graph), providers=["CPUExecutionProvider"])
        assert sess.get_inputs()


def test_tiny_vocabulary_keeps_its_full_draft_vocabulary_by_default(mha):
    """The default draft vocabulary is reduced only for vocabularies above 8192 tokens."""
    assert tiny.VOCAB <= 8192 and mha.manifest.draft.draft_vocab_size == tiny.VOCAB
