"""The exported target graph (onnxruntime, IO binding into a KVBuffer) against transformers'
own LlamaForCausalLM: prefill, per-node tree verification, and the graph faults: rotary
table frozen at trace length, tree-mask input ignored, mask/positions taken from the wrong
dimension, NaN from fully masked (padded) rows."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.exporter.layers import rotate_half_matrix
from eagle_deploy.runtime.tree import DraftTree
from tests.helpers import causal_mask, hf_features, hf_logits, kv_rows, poison, prefill, run_step, run_tree

ATOL = 1e-4


@pytest.fixture(scope="module", params=["mha", "gqa", "gqa_standard"])
def model(request):
    """Both tiny targets as the default fp32 graph (fused operators, shared KV), and the GQA one
    as the standard-op graph (sequence-major KV)."""
    return request.getfixturevalue(request.param)


def _rng_tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 256, size=n).tolist()


def _assert_nodes_match_hf(model, prefix, tree: DraftTree, logits: np.ndarray):
    """Row i of `logits` equals HF's last logits over prefix + the root-to-i path."""
    for node in range(tree.size):
        path = [int(tree.tokens[i]) for i in tree.path_to(node)]
        want = hf_logits(model.hf, list(prefix) + path)[-1]
        np.testing.assert_allclose(logits[node], want, rtol=0, atol=ATOL, err_msg=f"node {node} path {path}")


def _graph(model, which="target") -> onnx.ModelProto:
    return onnx.load(str(model.export_dir / getattr(model.manifest, which).path))


def test_graph_io_follows_contract(model):
    g = _graph(model).graph
    layout = c.KV_SEQ_MAJOR if model.name.endswith("standard") else c.KV_SHARED  # fp32 default: fused
    assert model.manifest.target.kv_layout == model.manifest.draft.kv_layout == layout
    inputs, outputs = c.target_io(model.manifest.dims.num_layers, "float32", layout)
    assert [i.name for i in g.input] == [s.name for s in inputs]
    assert [o.name for o in g.output] == [s.name for s in outputs]
    assert list(model.manifest.target.inputs) == inputs
    elem = {i.name: i.type.tensor_type.elem_type for i in g.input}
    assert elem[c.POSITION_IDS] == onnx.TensorProto.INT64
    assert elem[c.ATTENTION_MASK] == onnx.TensorProto.BOOL


def test_prefill_from_empty_past_matches_hf(model):
    """First prefill with past length 0 through the IO-binding path: logits and features at
    every position equal transformers."""
    be = model.backend()
    kv = be.allocate_kv(64)
    prompt = _rng_tokens(13, seed=1)
    out = prefill(be, kv, prompt)
    np.testing.assert_allclose(out[c.LOGITS][0], hf_logits(model.hf, prompt), rtol=0, atol=ATOL)
    np.testing.assert_allclose(out[c.FEATURES][0], hf_features(model.hf, prompt), rtol=0, atol=ATOL)


def test_prefill_kv_matches_hf_cache(model):
    """The KV rows written into the buffer are transformers' own (post-RoPE) cache."""
    import torch

    be = model.backend()
    kv = be.allocate_kv(32)
    prompt = _rng_tokens(9, seed=2)
    prefill(be, kv, prompt)
    with torch.no_grad():
        cache = model.hf(torch.tensor([prompt]), use_cache=True).past_key_values
    for layer in range(model.manifest.dims.num_layers):
        for kind, ours in (("keys", kv.rows(2 * layer)), ("values", kv.rows(2 * layer + 1))):
            theirs = getattr(cache.layers[layer], kind)[0].permute(1, 0, 2).numpy()  # (T, kvh, hd)
            np.testing.assert_allclose(ours[:9, 0], theirs, rtol=0, atol=ATOL, err_msg=f"layer {layer} {kind}")


def test_verify_logits_per_node_match_hf_path(model):
    """A hand-built tree with branches: each node's logits equal an HF forward over that
    node's own root-to-node path appended to the prefix."""
    prefix = _rng_tokens(11, seed=3)
    tree = DraftTree.from_paths(40, [[7, 8, 9], [7, 10], [11, 12, 13, 14], [15], [11, 16]])
    assert tree.size == 11 and sorted(set(tree.depths.tolist())) == [0, 1, 2, 3, 4]
    be = model.backend()
    kv = be.allocate_kv(64)
    prefill(be, kv, prefix)
    out = run_tree(be, kv, tree, len(prefix))
    _assert_nodes_match_hf(model, prefix, tree, out[c.LOGITS][0])


# ---------------------------------------------------------------- rotary table frozen at trace length


def test_tree_at_positions_beyond_trace_length(model):
    """Traced at seq 3 / past 2; run with past 200 and a 10-node tree (positions ~200-204):
    per-node logits equal eager transformers."""
    prefix = _rng_tokens(200, seed=4)
    tree = DraftTree.from_paths(33, [[1, 2, 3, 4], [1, 5], [6, 7, 8], [9]])
    assert tree.size == 10
    be = model.backend()
    kv = be.allocate_kv(model.manifest.max_length)
    prefill(be, kv, prefix)
    out = run_tree(be, kv, tree, 200)
    assert out[c.LOGITS].shape == (1, 10, 256)
    _assert_nodes_match_hf(model, prefix, tree, out[c.LOGITS][0])


def test_last_position_of_the_export(model):
    """A single token at position max_length - 1 (the last KV row) still matches eager."""
    n = model.manifest.max_length
    tokens = _rng_tokens(n, seed=5)
    be = model.backend()
    kv = be.allocate_kv(n)
    prefill(be, kv, tokens[:-1])
    out = run_step(be, kv, tokens[-1:], [n - 1], causal_mask(n - 1, 1), n - 1)
    np.testing.assert_allclose(out[c.LOGITS][0, 0], hf_logits(model.hf, tokens)[-1], rtol=0, atol=ATOL)


def test_no_rotary_table_sized_to_a_length(model):
    """No rotary table frozen at the trace length. The standard graph computes RoPE from
    positions in-graph (its only rotary constants: inv_freq [head_dim/2] and the rotate-half
    permutation); the fused graphs carry one cos and one sin table covering every position the
    model has, max_position_embeddings + ROTARY_SLACK rows, equal to transformers' own values."""
    from eagle_deploy.exporter.fused import ROTARY_SLACK

    hd = model.manifest.dims.head_dim
    g = _graph(model).graph
    tensors = [numpy_helper.to_array(t) for t in g.initializer]
    tensors += [numpy_helper.to_array(a.t) for n in g.node if n.op_type == "Constant"
                for a in n.attribute if a.type == onnx.AttributeProto.TENSOR]
    rotate = rotate_half_matrix(hd).numpy()  # the constant [hd, hd] rotate-half permutation, not a table
    tables = [t for t in tensors if t.dtype.kind == "f" and t.ndim >= 1 and t.shape[-1] in (hd, hd // 2)
              and t.size > hd and not (t.shape == rotate.shape and np.array_equal(t, rotate))]
    if model.manifest.target.kv_layout == c.KV_SEQ_MAJOR:
        assert tables == []
    else:
        rows = model.manifest.dims.max_position_embeddings + ROTARY_SLACK
        assert [t.shape for t in tables] == [(rows, hd // 2)] * 2
        rotary = model.hf.model.rotary_emb
        positions = torch.arange(rows)[None]
        cos, sin = (x[0, :, : hd // 2].numpy() for x in rotary(torch.zeros(1, rows, hd), positions))
        for table in tables:
            want = cos if np.allclose(table[1], cos[1], atol=1e-6) else sin
            np.testing.assert_allclose(table, want, rtol=0, atol=2e-6)
    consumers = [n for n in g.node if c.POSITION_IDS in n.input]
    assert consumers, "position_ids has no consumer"


# ---------------------------------------------------------------- tree-mask input ignored


def _e2_setup(model):
    prefix = _rng_tokens(10, seed=6)
    tree = DraftTree(np.array([50, 60, 61, 70, 71]), np.array([-1, 0, 0, 1, 2]), np.zeros(5))  # 0->1->3, 0->2->4
    be = model.backend()
    kv = be.allocate_kv(32)
    prefill(be, kv, prefix)
    return prefix, tree, be, kv


def test_per_node_logits_follow_own_path(model):
    prefix, tree, be, kv = _e2_setup(model)
    out = run_tree(be, kv, tree, 10)
    _assert_nodes_match_hf(model, prefix, tree, out[c.LOGITS][0])


def test_clearing_an_ancestor_bit_changes_the_node(model):
    prefix, tree, be, kv = _e2_setup(model)
    base = run_tree(be, kv, tree, 10)[c.LOGITS][0]
    mask = tree.attention_mask(10)
    mask[0, 3, 10 + 1] = False  # node 3 no longer sees its parent (node 1)
    cut = run_step(be, kv, tree.tokens, tree.positions(10), mask, 10)[c.LOGITS][0]
    assert np.abs(cut[3] - base[3]).max() > 1e-3
    np.testing.assert_array_equal(np.delete(cut, 3, axis=0), np.delete(base, 3, axis=0))


def test_branches_never_see_each_other(model):
    """Changing every token of branch 0->2->4 leaves branch 0->1->3 bit-identical."""
    prefix, tree, be, kv = _e2_setup(model)
    base = run_tree(be, kv, tree, 10)
    other = DraftTree(np.array([50, 60, 99, 70, 98]), tree.parents, tree.scores)
    changed = run_tree(be, kv, other, 10)
    for node in (0, 1, 3):
        np.testing.assert_array_equal(changed[c.LOGITS][0, node], base[c.LOGITS][0, node])
        np.testing.assert_array_equal(changed[c.FEATURES][0, node], base[c.FEATURES][0, node])
    assert np.abs(changed[c.LOGITS][0, 4] - base[c.LOGITS][0, 4]).max() > 1e-3


def test_mask_input_has_a_consumer(model):
    for which in ("target", "draft"):
        g = _graph(model, which).graph
        assert any(c.ATTENTION_MASK in n.input for n in g.node), f"{which}: attention_mask is unused"


# ---------------------------------------------------------------- mask/positions taken from the wrong dimension


def test_one_call_vs_chunks_vs_single_tokens(model):
    prompt = _rng_tokens(12, seed=7)
    runs = {}
    for name, chunks in (("one", [12]), ("7+5", [7, 5]), ("singles", [1] * 12)):
        be = model.backend()
        kv = be.allocate_kv(16)
        poison(kv)
        past = 0
        for n in chunks:
            out = prefill(be, kv, prompt[past:past + n], past=past)
            past += n
        runs[name] = (out[c.LOGITS][0, -1], kv_rows(kv, 12))
    want = hf_logits(model.hf, prompt)[-1]
    for name, (logits, rows) in runs.items():
        np.testing.assert_allclose(logits, want, rtol=0, atol=ATOL, err_msg=name)
        for a, b in zip(rows, runs["one"][1]):
            np.testing.assert_allclose(a, b, rtol=0, atol=ATOL, err_msg=name)


def test_positions_are_an_explicit_input(model):
    """position_ids is a graph input, and the graph uses it rather than the sequence index:
    moving one token's position changes its logits, and HF given the same positions agrees."""
    import torch

    prompt = _rng_tokens(12, seed=8)
    be = model.backend()
    kv = be.allocate_kv(16)
    base = run_step(be, kv, prompt, np.arange(12), causal_mask(0, 12), 0)[c.LOGITS][0, -1]
    moved_pos = np.r_[np.arange(11), 17]
    moved = run_step(be, kv, prompt, moved_pos, causal_mask(0, 12), 0)[c.LOGITS][0, -1]
    assert np.abs(moved - base).max() > 1e-3
    with torch.no_grad():
        want = model.hf(torch.tensor([prompt]), position_ids=torch.from_numpy(moved_pos[None])).logits[0, -1].numpy()
    np.testing.assert_allclose(moved, want, rtol=0, atol=ATOL)


# ---------------------------------------------------------------- NaN from fully masked (padded) rows


def test_mask_value_is_finite_in_fp16_and_in_the_graph(model):
    assert np.isfinite(np.float16(c.MASK_VALUE)) and float(np.float16(c.MASK_VALUE)) == c.MASK_VALUE
    g = _graph(model).graph
    consts = [numpy_helper.to_array(a.t) for n in g.node if n.op_type == "Constant"
              for a in n.attribute if a.type == onnx.AttributeProto.TENSOR]
    consts += [numpy_helper.to_array(t) for t in g.initializer]
    values = {float(v) for t in consts if t.dtype.kind == "f" and t.size == 1 for v in t.ravel()}
    assert c.MASK_VALUE in values
    assert not any(np.isinf(v) for v in values)


def test_padded_tree_equals_unpadded_and_pads_are_never_attended(model):
    prefix, tree, be, kv = _e2_setup(model)
    P = len(prefix)
    plain = run_tree(be, kv, tree, P)
    plain_kv = kv_rows(kv, P + 5)
    # the same 5-node tree padded to 8: pad rows see nothing (fully masked), nobody sees them
    tokens = np.r_[tree.tokens, [0, 0, 0]]
    positions = np.r_[tree.positions(P), [P, P, P]]
    mask = np.zeros((1, 8, P + 8), dtype=bool)
    mask[0, :5, :P] = True
    mask[0, :5, P:P + 5] = tree.tree_mask
    kv2 = be.allocate_kv(32)
    prefill(be, kv2, prefix)
    padded = run_step(be, kv2, tokens, positions, mask, P)
    assert np.all(np.isfinite(padded[c.LOGITS])) and np.all(np.isfinite(padded[c.FEATURES]))
    np.testing.assert_allclose(padded[c.LOGITS][0, :5], plain[c.LOGITS][0], rtol=0, atol=1e-5)
    for a, b in zip(kv_rows(kv2, P + 5), plain_kv):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    # next step after accepting 0->1->3 (uncompacted): pad rows stay masked out
    seen = [0, 1, 3]
    m_plain = np.zeros((1, 1, P + 6), dtype=bool)
    m_plain[0, 0, :P] = True
    m_plain[0, 0, [P + s for s in seen] + [P + 5]] = True
    nxt_plain = run_step(be, kv, [123], [P + 3], m_plain, P + 5)[c.LOGITS][0, 0]
    m_pad = np.zeros((1, 1, P + 9), dtype=bool)
    m_pad[0, 0, :P] = True
    m_pad[0, 0, [P + s for s in seen] + [P + 8]] = True
    nxt_pad = run_step(be, kv2, [123], [P + 3], m_pad, P + 8)[c.LOGITS][0, 0]
    np.testing.assert_allclose(nxt_pad, nxt_plain, rtol=0, atol=1e-5)
    path = [int(t) for t in tree.tokens[seen]] + [123]
    np.testing.assert_allclose(nxt_plain, hf_logits(model.hf, prefix + path)[-1], rtol=0, atol=ATOL)


@pytest.mark.parametrize("rows", [0, 1])
def test_fully_masked_row_is_finite(model, rows):
    """A row that may attend to nothing at all (past 0 or 1) gives finite logits."""
    be = model.backend()
    kv = be.allocate_kv(8)
    if rows:
        prefill(be, kv, [3])
    mask = np.zeros((1, 2, rows + 2), dtype=bool)
    mask[0, 1, :] = True
    out = run_step(be, kv, [4, 5], [rows, rows], mask, rows)
    assert np.all(np.isfinite(out[c.LOGITS])) and np.all(np.isfinite(out[c.FEATURES]))


def test_rotate_half_matrix_is_exact():
    """x @ R equals the slice/negate/concat rotate-half bit for bit (fp32 and fp16)."""
    import torch

    for dtype in (torch.float32, torch.float16):
        x = torch.randn(3, 5, 64).to(dtype)
        expected = torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
        assert torch.equal(torch.matmul(x, rotate_half_matrix(64).to(dtype)), expected)


# ---------------------------------------------------------------- fused vs standard graph


def test_graph_kind_follows_the_kv_layout(model):
    """The fused graph has one GroupQueryAttention per layer (RoPE inside: no Sin/Cos per layer,
    no Softmax) and fused residual norms; the standard graph has no onnxruntime contrib op."""
    layers = model.manifest.dims.num_layers
    for which, n in (("target", layers), ("draft", 1)):
        g = _graph(model, which).graph
        ops = [node.op_type for node in g.node]
        contrib = {node.op_type for node in g.node if node.domain == "com.microsoft"}
        if model.manifest.target.kv_layout == c.KV_SHARED:
            assert ops.count("GroupQueryAttention") == n and "Softmax" not in ops
            assert contrib == {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"}
            # target: post-attention norm of each layer, input norm of layers 1.., final norm; draft: post norm
            assert ops.count("SkipSimplifiedLayerNormalization") == (2 * n if which == "target" else 1)
            assert ops.count("Cos") == ops.count("Sin") == 0  # a constant rotary table (test below)
        else:
            assert contrib == set() and ops.count("Softmax") == n


def test_fused_graph_refuses_a_mask_that_looks_ahead(model):
    """The fused operator is causal over the new tokens: a mask letting a node see a later
    node is refused by the backend instead of being silently cut; a KV buffer of the other
    layout is refused too."""
    from eagle_deploy.runtime.kv import KVBuffer

    be = model.backend()
    kv = be.allocate_kv(32)
    prefill(be, kv, [3, 4, 5])
    mask = causal_mask(3, 2)
    mask[0, 0, 4] = True  # new token 0 sees new token 1
    if model.manifest.target.kv_layout != c.KV_SHARED:
        run_step(be, kv, [6, 7], [3, 4], mask, 3)  # the standard graph follows the mask as given
        return
    with pytest.raises(ValueError, match="later new token"):
        run_step(be, kv, [6, 7], [3, 4], mask, 3)
    other = KVBuffer.allocate(be.kv_names, 32, 1, model.manifest.dims.num_kv_heads, model.manifest.dims.head_dim,
                              np.float32)
    with pytest.raises(ValueError, match="layout"):
        prefill(be, other, [3, 4, 5])


def test_fused_rotary_rows_cover_positions_far_from_the_rows(gqa):
    """The fused graph builds its rotary rows for this call's positions only (base = the
    smallest): positions far above the KV rows (a draft's scratch rows run ahead of positions
    the other way round) and spread wider than the call still match transformers."""
    import torch

    be = gqa.backend()
    kv = be.allocate_kv(16)
    prompt = _rng_tokens(6, seed=9)
    pos = np.array([100, 101, 102, 103, 104, 140])  # rows 0..5, positions 100.. and one far out
    out = run_step(be, kv, prompt, pos, causal_mask(0, 6), 0)[c.LOGITS][0]
    with torch.no_grad():
        want = gqa.hf(torch.tensor([prompt]), position_ids=torch.from_numpy(pos[None])).logits[0].numpy()
    np.testing.assert_allclose(out, want, rtol=0, atol=ATOL)


def test_fused_torch_module_equals_the_standard_one(gqa):
    """ExportableTarget with the shared KV layout, run eagerly (the operators' torch forwards,
    which tracing runs), equals the standard module on a tree over a past: logits, features and
    the KV rows it writes; rows past the call stay untouched."""
    import torch

    from eagle_deploy.exporter.target import ExportableTarget

    std, fused = ExportableTarget(gqa.hf).eval(), ExportableTarget(gqa.hf, c.KV_SHARED).eval()
    L, kvh, hd = gqa.manifest.dims.num_layers, gqa.manifest.dims.num_kv_heads, gqa.manifest.dims.head_dim
    rng = np.random.default_rng(0)
    past = [torch.from_numpy(rng.normal(0, 1, (7, 1, kvh, hd)).astype(np.float32)) for _ in range(2 * L)]
    shared = [torch.cat((p, torch.full((5, 1, kvh, hd), 7.0))).permute(1, 2, 0, 3).contiguous() for p in past]
    tree = DraftTree.from_paths(9, [[1, 2], [3]])
    args = (torch.from_numpy(tree.tokens[None]), torch.from_numpy(tree.positions(7)[None]),
            torch.from_numpy(tree.attention_mask(7)), torch.arange(tree.size)[None])
    with torch.no_grad():
        want, got = std(*args, *past), fused(*args, *shared)
    for a, b in zip(want[:2], got[:2]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    for new, buf in zip(want[2:], got[2:]):
        torch.testing.assert_close(buf[:, :, 7:7 + tree.size].permute(2, 0, 1, 3), new, rtol=0, atol=1e-5)
        assert bool((buf[:, :, 7 + tree.size:] == 7.0).all())


def test_fused_norms_do_not_compute_unread_statistics(gqa, tmp_path):
    """Every SkipSimplifiedLayerNormalization of the fused target and draft graphs leaves its
    mean / inverse-std outputs empty (nothing reads them; onnxruntime then skips them), and the
    graph with them named again gives bit-identical logits, features and KV."""
    from eagle_deploy.exporter.fused import drop_unused_norm_statistics
    from eagle_deploy.runtime.backends.ort import OrtBackend

    for which in ("target", "draft"):
        norms = [n for n in _graph(gqa, which).graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
        assert norms and all(list(n.output[1:3]) == ["", ""] and n.output[0] and n.output[3] for n in norms), which
    model = _graph(gqa)
    for i, node in enumerate(n for n in model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"):
        node.output[1], node.output[2] = f"mean_{i}", f"inv_std_{i}"  # as the TorchScript exporter names them
    kept = tmp_path / "target.onnx"
    onnx.save(model, str(kept))
    m = gqa.manifest
    named = OrtBackend(tmp_path, m.target, m.dims, threads=1)
    lean = gqa.backend("target")
    prompt, tree = _rng_tokens(20, 5), DraftTree.from_paths(9, [[4, 7], [5], [4, 8, 2]])
    outs = []
    for be in (named, lean):
        kv = be.allocate_kv(64)
        first = prefill(be, kv, prompt)
        outs.append([first[c.LOGITS], first[c.FEATURES], *run_tree(be, kv, tree, len(prompt)).values(),
                     *kv_rows(kv, len(prompt) + tree.size)])
    assert all(np.array_equal(a, b) for a, b in zip(*outs))
    # an output something reads is kept
    model.graph.output.append(onnx.helper.make_tensor_value_info("mean_0", onnx.TensorProto.FLOAT, None))
    norms = [n for n in model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert drop_unused_norm_statistics(model) == 2 * len(norms) - 1 and norms[0].output[1] == "mean_0"
