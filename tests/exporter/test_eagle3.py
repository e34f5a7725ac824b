"""EAGLE-3 heads (heads/eagle3*.py, their draft graph in exporter/draft.py), tried against the
ways they break: the two checkpoint layouts read differently, d2t / t2d lost or ignored, the
target tapped one layer off, a tensor loaded but never applied, a buffer sized by the wrong
hidden width, unclear checkpoint errors, and a manifest whose two records of the tapped layers
disagree.

References: the exporter's own torch draft (`ExportableDraft3` through `TorchBackend`), and an
independent one written out here from the raw safetensors and the paper (`_raw_draft`), which
shares no code with the exporter."""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import Manifest, ManifestError
from eagle_deploy.exporter.export import DRAFT_VOCAB_FILE, ExportOptions, export
from eagle_deploy.heads.api import load_head
from eagle_deploy.heads.eagle3 import Eagle3Head, random_eagle3_head
from eagle_deploy.heads.eagle3_checkpoint import LAYOUTS, save_eagle3_head
from eagle_deploy.heads.eagle3_config import default_feature_layers
from eagle_deploy.heads.files import HeadCheckpointError
from eagle_deploy.runtime.backends.base import StepInputs
from eagle_deploy.runtime.backends.ort import OrtBackend
from eagle_deploy.validate.torch_backend import TorchBackend
from tests import tiny
from tests.conftest import EAGLE3_TAPS
from tests.helpers import causal_mask, hf_greedy, kv_rows, prefill, until_eos

ATOL = 1e-4
TOP_K = 10
WEIGHTS = "model.safetensors"


# --------------------------------------------------------------------------- draft calls


@dataclass
class Call:
    """One draft forward: rows of target taps (`tapped`) then rows of the head's own features."""

    tokens: np.ndarray
    positions: np.ndarray
    mask: np.ndarray  # [1, S, past + S]
    past: int
    tapped: np.ndarray  # [T, taps * target hidden]
    own: np.ndarray  # [S - T, head hidden]


def _calls(tapped_width: int, hidden: int, seed: int = 0) -> list[Call]:
    """An extension call (6 rows of target taps, causal from an empty past), then two tree
    expansions with the head's own rows, as the drafter makes them (drafter.expansion_mask):
    3 sibling frontier nodes at rows 6-8 (each sees the 6 committed rows and itself: siblings
    hidden), then children of nodes 6 and 8 at rows 9-10 (committed rows, their parent, themselves)."""
    rng = np.random.default_rng(seed)

    def feats(n, width):
        return rng.normal(0, 1, (n, width)).astype(np.float32)

    ext = Call(rng.integers(1, 256, 6), np.arange(6), causal_mask(0, 6), 0, feats(6, tapped_width), feats(0, hidden))
    m1 = np.zeros((1, 3, 9), bool)
    m1[0, :, :6] = True
    m1[0, [0, 1, 2], [6, 7, 8]] = True
    exp1 = Call(rng.integers(1, 256, 3), np.full(3, 6), m1, 6, feats(0, tapped_width), feats(3, hidden))
    m2 = np.zeros((1, 2, 11), bool)
    m2[0, :, :6] = True
    m2[0, [0, 1], [6, 8]] = True
    m2[0, [0, 1], [9, 10]] = True
    exp2 = Call(rng.integers(1, 256, 2), np.full(2, 7), m2, 9, feats(0, tapped_width), feats(2, hidden))
    return [ext, exp1, exp2]


def _calls_for(head_or_cfg) -> list[Call]:
    cfg = getattr(head_or_cfg, "cfg", head_or_cfg)
    return _calls(len(cfg.feature_layers) * cfg.target_hidden, cfg.hidden)


def _run(backend, calls: list[Call]) -> tuple[list[dict], list[np.ndarray]]:
    """(outputs by contract name per call, the KV rows written, sequence-major)."""
    kv = backend.allocate_kv(16)
    outs = []
    for call in calls:
        S = len(call.tokens)
        inputs = StepInputs(np.asarray(call.tokens, np.int64)[None], np.asarray(call.positions, np.int64)[None],
                            call.mask, np.arange(S, dtype=np.int64)[None],
                            np.ascontiguousarray(call.own[None], np.float32),
                            np.ascontiguousarray(call.tapped[None], np.float32))
        outs.append({k: v.copy() for k, v in backend.run(inputs, kv, call.past).named().items()})
    last = calls[-1]
    return outs, kv_rows(kv, last.past + len(last.tokens))


def _torch_run(head, calls):
    return _run(TorchBackend.draft(head, top_k=TOP_K), calls)


def _assert_same(got: list[dict], want: list[dict], atol: float = ATOL, what: str = ""):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g[c.NEXT_FEATURES], w[c.NEXT_FEATURES], rtol=0, atol=atol,
                                   err_msg=f"{what} call {i} next_features")
        np.testing.assert_allclose(g[c.TOPK_LOGPROBS], w[c.TOPK_LOGPROBS], rtol=0, atol=atol,
                                   err_msg=f"{what} call {i} topk_logprobs")
        np.testing.assert_array_equal(g[c.TOPK_IDS], w[c.TOPK_IDS], err_msg=f"{what} call {i} topk_ids")


def _delta(a: dict, b: dict) -> float:
    return float(max(np.abs(a[c.NEXT_FEATURES] - b[c.NEXT_FEATURES]).max(),
                     np.abs(a[c.TOPK_LOGPROBS] - b[c.TOPK_LOGPROBS]).max()))


# --------------------------------------------------------------------------- independent reference


def _raw_draft(head_dir: Path, hf, calls: list[Call], top_k: int = TOP_K):
    """The EAGLE-3 draft forward written out from the raw checkpoint (either layout) after the
    paper and the reference cnets.py, in float64, sharing no code with the exporter:
    h = [fc(taps); own]; x = [input_layernorm(embed(t)); hidden_norm(h)]; attention (Llama
    RoPE, GQA, the given mask) with h (hidden_norm(h) with norm_before_residual) as the
    residual; post-attention norm, SwiGLU; lm_head(norm(.)) over the draft vocabulary, index i
    -> target id i + d2t[i]. Returns (outputs per call, [keys, values] rows [n, kvh, hd])."""
    from safetensors.torch import load_file

    config = json.loads((head_dir / "config.json").read_text())
    llama = config.get("transformer_layer_config") or config
    raw = load_file(str(head_dir / WEIGHTS))
    prefix = "layers.0." if any(k.startswith("layers.0.") for k in raw) else "midlayer."
    w = {("L." + k[len(prefix):] if k.startswith(prefix) else k): v.double() for k, v in raw.items()
         if v.is_floating_point()}
    H, nh = llama["hidden_size"], llama["num_attention_heads"]
    kvh = llama.get("num_key_value_heads", nh)
    hd = llama.get("head_dim") or H // nh
    eps, theta = llama["rms_norm_eps"], llama.get("rope_theta", 10000.0)
    residual_normed = bool(config.get("norm_before_residual", False))
    embed = w.get("embed_tokens.weight", hf.model.embed_tokens.weight.detach().double())
    d2t = raw["d2t"].long() if "d2t" in raw else torch.zeros(w["lm_head.weight"].shape[0], dtype=torch.long)

    def norm(x, key):
        return w[key] * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    def lin(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)

    def rope(x, pos):  # x [S, heads, hd]; HF Llama rotate-half convention
        ang = pos.double()[:, None] * inv[None]
        ang = torch.cat([ang, ang], -1)[:, None]
        return x * ang.cos() + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * ang.sin()

    keys, values, outs = [], [], []
    for call in calls:
        assert call.past == sum(len(k) for k in keys)
        S = len(call.tokens)
        tokens, pos = torch.as_tensor(call.tokens).long(), torch.as_tensor(call.positions).long()
        h = torch.cat([lin(torch.from_numpy(call.tapped).double(), "fc"), torch.from_numpy(call.own).double()])
        hn = norm(h, "L.hidden_norm.weight")
        x = torch.cat([norm(embed[tokens], "L.input_layernorm.weight"), hn], -1)
        q = rope(lin(x, "L.self_attn.q_proj").view(S, nh, hd), pos)
        keys.append(rope(lin(x, "L.self_attn.k_proj").view(S, kvh, hd), pos))
        values.append(lin(x, "L.self_attn.v_proj").view(S, kvh, hd))
        K = torch.cat(keys).repeat_interleave(nh // kvh, dim=1)
        V = torch.cat(values).repeat_interleave(nh // kvh, dim=1)
        scores = torch.einsum("shd,thd->hst", q, K) / math.sqrt(hd)
        scores = scores.masked_fill(~torch.from_numpy(call.mask[0])[None], float("-inf"))
        attn = torch.einsum("hst,thd->shd", scores.softmax(-1), V).reshape(S, nh * hd)
        y = (hn if residual_normed else h) + lin(attn, "L.self_attn.o_proj")
        m = norm(y, "L.post_attention_layernorm.weight")
        y = y + lin(torch.nn.functional.silu(lin(m, "L.mlp.gate_proj")) * lin(m, "L.mlp.up_proj"), "L.mlp.down_proj")
        logp = torch.log_softmax(norm(y, "norm.weight") @ w["lm_head.weight"].T, -1)
        lp, idx = torch.topk(logp, top_k, -1)
        outs.append({c.NEXT_FEATURES: y.float().numpy()[None], c.TOPK_LOGPROBS: lp.float().numpy()[None],
                     c.TOPK_IDS: (idx + d2t[idx]).numpy()[None]})
    return outs, [torch.cat(keys).float().numpy(), torch.cat(values).float().numpy()]


# --------------------------------------------------------------------------- checkpoints


def _draft_ids(n: int, seed: int, vocab: int = tiny.VOCAB) -> torch.Tensor:
    """n sorted target ids including EOS, most of them far from their draft index (so an
    ignored d2t shows)."""
    gen = torch.Generator().manual_seed(seed)
    rest = torch.randperm(vocab - 1, generator=gen)[: n - 1] + 1
    return torch.sort(torch.cat([torch.tensor([tiny.EOS_ID]), rest])).values


def _edit_state(src: Path, dst: Path, change) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / WEIGHTS))
    change(state)
    save_file(state, str(dst / WEIGHTS))
    return dst


def _edit_config(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    change(cfg)  # edits in place
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _layer_key(layout: str, name: str) -> str:
    return ("midlayer." if layout == "eagle3" else "layers.0.") + name


@pytest.fixture(scope="module")
def layout_heads(gqa, tmp_path_factory):
    """One random 96-wide head (own embedding, GQA 6/3, 100-token draft vocabulary, taps (0, 1))
    on the GQA tiny target, saved in both layouts: (head, {layout: folder}, draft ids)."""
    root = tmp_path_factory.mktemp("eagle3-layouts")
    ids = _draft_ids(100, seed=5)
    head = random_eagle3_head(gqa.hf, seed=7, draft_ids=ids, feature_layers=EAGLE3_TAPS, **tiny.EAGLE3_GEOMETRY)
    dirs = {}
    for layout in LAYOUTS:
        dirs[layout] = root / layout
        save_eagle3_head(head, dirs[layout], layout=layout)
    return head, dirs, ids


@pytest.fixture(scope="module")
def biased_head(gqa, tmp_path_factory) -> Path:
    """A "speculators" checkpoint carrying every optional tensor (fc.bias, q/k/v biases, its own
    96-wide embedding), norm_before_residual true, a 100-token draft vocabulary."""
    root = tmp_path_factory.mktemp("eagle3-biased")
    head = random_eagle3_head(gqa.hf, seed=11, draft_ids=_draft_ids(100, seed=12), feature_layers=EAGLE3_TAPS,
                              norm_before_residual=True, **tiny.EAGLE3_GEOMETRY)
    save_eagle3_head(head, root / "src", layout="speculators")
    gen = torch.Generator().manual_seed(13)

    def add_biases(state):
        for key, n in (("fc.bias", 96), ("layers.0.self_attn.q_proj.bias", 96), ("layers.0.self_attn.k_proj.bias", 48),
                       ("layers.0.self_attn.v_proj.bias", 48)):
            state[key] = torch.randn(n, generator=gen) * 0.1

    return _edit_state(root / "src", root / "head", add_biases)


@pytest.fixture(scope="module")
def narrow_head(gqa, tmp_path_factory) -> Path:
    """A 64-wide ("eagle3" layout, full vocabulary) head that still carries its own
    embed_tokens (not the target's)."""
    root = tmp_path_factory.mktemp("eagle3-narrow")
    head = random_eagle3_head(gqa.hf, seed=17, feature_layers=EAGLE3_TAPS)
    save_eagle3_head(head, root / "src")
    gen = torch.Generator().manual_seed(18)
    return _edit_state(root / "src", root / "head",
                       lambda s: s.update({"embed_tokens.weight": torch.randn(tiny.VOCAB, 64, generator=gen) * 0.08}))


@dataclass
class Deep:
    """An 8-layer GQA tiny target with a 64-wide head on the default taps, exported twice."""

    target_dir: Path
    head_dir: Path
    hf: object
    exports: dict


@pytest.fixture(scope="module")
def deep(tmp_path_factory) -> Deep:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("eagle3-deep")
    target_dir = tiny.build_tiny_target(root / "target", gqa=True, seed=21, norm_noise=0.1, num_hidden_layers=8)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    head = random_eagle3_head(hf, seed=22)  # no taps named: the reference's default
    assert head.cfg.feature_layers == (2, 4, 5)
    head_dir = root / "head"
    save_eagle3_head(head, head_dir)
    cfg = json.loads((head_dir / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]  # as published heads trained on the default taps ship
    (head_dir / "config.json").write_text(json.dumps(cfg))
    exports = {graph: export(str(target_dir), str(head_dir), root / "exports",
                             ExportOptions(max_length=64, name=f"deep-{graph}", graph=graph, draft_quant="none"),
                             progress=None)
               for graph in ("fused", "standard")}
    return Deep(target_dir, head_dir, hf, exports)


@dataclass
class DraftCase:
    export_dir: Path
    head_dir: Path
    hf: object

    @property
    def manifest(self) -> Manifest:
        return Manifest.load(self.export_dir)

    def backend(self, which: str = "draft") -> OrtBackend:
        m = self.manifest
        return OrtBackend(self.export_dir, getattr(m, which), m.graph_dims(which), threads=1,
                          shared=m.shared_weights)


@pytest.fixture(scope="module")
def biased_export(biased_head, gqa, tmp_path_factory) -> DraftCase:
    out = export(str(gqa.target_dir), str(biased_head), tmp_path_factory.mktemp("eagle3-biased-export"),
                 ExportOptions(max_length=64, name="biased", draft_quant="none"), progress=None)
    return DraftCase(out, biased_head, gqa.hf)


@pytest.fixture(scope="module", params=["eagle3", "deep-fused", "deep-standard", "biased"])
def draft_case(request) -> DraftCase:
    """The conftest EAGLE-3 export (96 wide, 2 taps, reduced vocabulary, fused), the 8-layer
    target's (64 wide, shared embedding, 3 default taps, full vocabulary) as the fused and the
    standard graph, and a speculators head with every bias and norm_before_residual (fused)."""
    name = request.param
    if name == "eagle3":
        m = request.getfixturevalue("eagle3")
        return DraftCase(m.export_dir, m.head_dir, m.hf)
    if name == "biased":
        return request.getfixturevalue("biased_export")
    deep = request.getfixturevalue("deep")
    return DraftCase(deep.exports[name.split("-")[1]], deep.head_dir, deep.hf)


# =========================================================================== 1. layouts


def test_both_layouts_load_to_the_same_head(layout_heads, gqa):
    from safetensors.torch import load_file

    head, dirs, _ = layout_heads
    keys = {layout: set(load_file(str(d / WEIGHTS))) for layout, d in dirs.items()}
    assert any(k.startswith("midlayer.") for k in keys["eagle3"]) and not any(
        k.startswith("layers.") for k in keys["eagle3"])
    assert any(k.startswith("layers.0.") for k in keys["speculators"]) and not any(
        k.startswith("midlayer.") for k in keys["speculators"])
    spec_cfg = json.loads((dirs["speculators"] / "config.json").read_text())
    assert spec_cfg["speculators_model_type"] == "eagle3" and "hidden_size" not in spec_cfg
    assert spec_cfg["transformer_layer_config"]["hidden_size"] == 96

    loaded = {layout: load_head(d, gqa.hf) for layout, d in dirs.items()}
    a, b = loaded["eagle3"], loaded["speculators"]
    assert isinstance(a, Eagle3Head) and isinstance(b, Eagle3Head)
    assert (a.cfg.layout, b.cfg.layout) == ("eagle3", "speculators")
    assert a.record.replace(layout=None) == b.record.replace(layout=None) == head.record.replace(layout=None)
    assert a.record.feature_layers == EAGLE3_TAPS and (a.cfg.hidden, a.cfg.num_kv_heads) == (96, 3)
    want = head.head_state_dict()
    for got in (a.head_state_dict(), b.head_state_dict()):
        assert sorted(got) == sorted(want)
        for key in want:
            assert torch.equal(got[key], want[key]), key
    calls = _calls_for(a)
    out_a, kv_a = _torch_run(a, calls)
    out_b, kv_b = _torch_run(b, calls)
    _assert_same(out_a, out_b, atol=0)
    for x, y in zip(kv_a, kv_b):
        np.testing.assert_array_equal(x, y)
    _assert_same(out_a, _raw_draft(dirs["speculators"], gqa.hf, calls)[0], what="raw reference")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_norm_before_residual_is_honoured(layout_heads, gqa, tmp_path, layout):
    """norm_before_residual: true (speculators' flag, read in either layout) makes the residual
    hidden_norm(h): the outputs change, and equal the raw reference with the flag."""
    _, dirs, _ = layout_heads
    flagged = _edit_config(dirs[layout], tmp_path / "flagged", lambda cfg: cfg.update(norm_before_residual=True))
    base, head = load_head(dirs[layout], gqa.hf), load_head(flagged, gqa.hf)
    assert base.cfg.norm_before_residual is False and head.cfg.norm_before_residual is True
    calls = _calls_for(head)
    out_base, out = _torch_run(base, calls)[0], _torch_run(head, calls)[0]
    for i, (x, y) in enumerate(zip(out_base, out)):
        assert np.abs(x[c.NEXT_FEATURES] - y[c.NEXT_FEATURES]).max() > 1e-2, f"call {i}: the flag changed nothing"
    _assert_same(out, _raw_draft(flagged, gqa.hf, calls)[0], what="raw reference")
    _assert_same(out_base, _raw_draft(dirs[layout], gqa.hf, calls)[0], what="raw reference")


def test_taps_named_under_eagle_config_are_read(deep, tmp_path):
    """eagle_aux_hidden_state_layer_ids may sit under `eagle_config` (ModelOpt); a config
    without them gets (2, L // 2, L - 3)."""
    src = deep.head_dir
    assert "eagle_aux_hidden_state_layer_ids" not in json.loads((src / "config.json").read_text())
    assert load_head(src, deep.hf).cfg.feature_layers == (2, 4, 5)
    nested = _edit_config(src, tmp_path / "nested",
                          lambda cfg: cfg.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}))
    assert load_head(nested, deep.hf).cfg.feature_layers == (1, 3, 7)


# =========================================================================== 2. d2t / t2d


def test_reduced_draft_vocabulary_survives_save_and_reload(layout_heads, gqa, tmp_path):
    from safetensors.torch import load_file

    _, dirs, ids = layout_heads
    assert not torch.equal(ids, torch.arange(len(ids)))
    for layout, folder in dirs.items():
        raw = load_file(str(folder / WEIGHTS))
        torch.testing.assert_close(torch.arange(100) + raw["d2t"].long(), ids, rtol=0, atol=0)
        assert torch.equal(torch.nonzero(raw["t2d"].bool()).flatten(), ids), layout
        head = load_head(folder, gqa.hf)
        assert torch.equal(head.draft_to_target, ids), layout
        assert torch.equal(torch.nonzero(head.t2d).flatten(), ids), layout
        other = "speculators" if layout == "eagle3" else "eagle3"
        save_eagle3_head(head, tmp_path / f"{layout}-again", layout=other)  # a loaded head saved again
        again = load_head(tmp_path / f"{layout}-again", gqa.hf)
        assert again.cfg.layout == other and torch.equal(again.draft_to_target, ids)
        assert again.cfg.draft_vocab == 100 and again.lm_head.weight.shape == (100, 96)


def test_draft_graph_ids_are_the_heads_target_ids(eagle3):
    """The exported draft graph maps its top-k draft indices through d2t: every id is in the
    head's draft vocabulary, equals the torch reference's, and equals i + d2t[i] for the top
    indices recomputed from the graph's own next_features with the raw lm_head."""
    from safetensors.torch import load_file

    m = eagle3.manifest
    assert (m.draft.draft_vocab_size, m.draft.draft_vocab_file, m.draft.draft_vocab_source) == (
        128, DRAFT_VOCAB_FILE, "head_d2t")
    raw = load_file(str(eagle3.head_dir / WEIGHTS))
    d2t = raw["d2t"].long().numpy()
    ids = np.arange(128) + d2t
    np.testing.assert_array_equal(np.load(eagle3.export_dir / DRAFT_VOCAB_FILE), ids)
    head = eagle3.head()
    np.testing.assert_array_equal(head.draft_to_target.numpy(), ids)
    assert (d2t != 0).mean() > 0.5  # most draft indices are not their own target id
    calls = _calls_for(head)
    got = _run(eagle3.backend("draft"), calls)[0]
    want = _torch_run(head, calls)[0]
    norm_w, lm = raw["norm.weight"].double(), raw["lm_head.weight"].double()
    eps = head.cfg.rms_norm_eps
    shifted = 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert set(g[c.TOPK_IDS].ravel().tolist()) <= set(ids.tolist()), f"call {i}: an id outside the draft vocab"
        np.testing.assert_array_equal(g[c.TOPK_IDS], w[c.TOPK_IDS])
        x = torch.from_numpy(g[c.NEXT_FEATURES][0]).double()
        logits = (norm_w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)) @ lm.T
        idx = torch.topk(logits, TOP_K, -1).indices.numpy()
        np.testing.assert_array_equal(g[c.TOPK_IDS][0], ids[idx], err_msg=f"call {i}")
        shifted += int((d2t[idx] != 0).sum())
    assert shifted > 0


# case -> (change to the "eagle3"-layout tensors, words the error must contain)
VOCAB_BROKEN = {
    "d2t removed": (lambda s: s.pop("d2t"), ["'d2t'", "100"]),
    "d2t and t2d removed": (lambda s: (s.pop("d2t"), s.pop("t2d")), ["'d2t'"]),
    "t2d has an extra id": (lambda s: s["t2d"].__setitem__(int(torch.nonzero(~s["t2d"].bool())[0]), True),
                            ["'d2t'", "'t2d'", "disagree"]),
    "t2d lacks an id": (lambda s: s["t2d"].__setitem__(int(torch.nonzero(s["t2d"].bool())[3]), False),
                        ["'d2t'", "'t2d'", "disagree"]),
    "d2t past the vocabulary": (lambda s: s["d2t"].__setitem__(99, s["d2t"][99] + 1000), ["'d2t'", "outside"]),
    "d2t below zero": (lambda s: s["d2t"].__setitem__(0, -1), ["'d2t'", "outside"]),
    "two indices to one id": (lambda s: s["d2t"].__setitem__(1, s["d2t"][0] - 1), ["'d2t'", "two indices"]),
    "float d2t": (lambda s: s.update(d2t=s["d2t"].double()), ["'d2t'", "float64"]),
    "short d2t": (lambda s: s.update(d2t=s["d2t"][:-1].clone()), ["'d2t'", "[99]"]),
    "short t2d": (lambda s: s.update(t2d=s["t2d"][:-1].clone()), ["'t2d'", "[255]"]),
}


@pytest.mark.parametrize("case", list(VOCAB_BROKEN))
def test_broken_vocabulary_map_is_refused(layout_heads, gqa, tmp_path, case):
    _, dirs, _ = layout_heads
    change, words = VOCAB_BROKEN[case]
    folder = _edit_state(dirs["eagle3"], tmp_path / "head", change)
    with pytest.raises(HeadCheckpointError) as info:
        load_head(folder, gqa.hf)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_t2d_is_optional_when_d2t_is_there(layout_heads, gqa, tmp_path):
    _, dirs, ids = layout_heads
    folder = _edit_state(dirs["speculators"], tmp_path / "head", lambda s: s.pop("t2d"))
    head = load_head(folder, gqa.hf)
    assert torch.equal(head.draft_to_target, ids) and torch.equal(torch.nonzero(head.t2d).flatten(), ids)


@pytest.mark.parametrize("drop", [("d2t", "t2d"), ("d2t",)])
def test_full_vocabulary_head_without_d2t_maps_as_identity(narrow_head, gqa, tmp_path, drop):
    folder = _edit_state(narrow_head, tmp_path / "head", lambda s: [s.pop(k) for k in drop])
    head, full = load_head(folder, gqa.hf), load_head(narrow_head, gqa.hf)
    assert head.cfg.draft_vocab == 256
    assert torch.equal(head.draft_to_target, torch.arange(256)) and bool(head.t2d.all())
    calls = _calls_for(head)
    _assert_same(_torch_run(head, calls)[0], _torch_run(full, calls)[0], atol=0)


# =========================================================================== 3. tapped layers


def test_default_feature_layers():
    assert default_feature_layers(30) == (2, 15, 27)
    assert default_feature_layers(32) == (2, 16, 29)
    assert default_feature_layers(8) == (2, 4, 5)
    assert default_feature_layers(7) == (2, 3, 4)
    for n in (2, 5, 6):
        with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
            default_feature_layers(n)


@pytest.mark.parametrize("graph", ["fused", "standard"])
def test_target_graph_taps_the_inputs_of_the_default_layers(deep, graph):
    """Tapped layers off by one: the ONNX target's `tapped_features` over a prefill are
    transformers' hidden_states[2], [4], [5] (the inputs of those decoder layers), and each
    differs from its neighbours [i - 1] and [i + 1] by far more than the tolerance."""
    out = deep.exports[graph]
    m = Manifest.load(out)
    assert m.target.feature_layers == (2, 4, 5) and m.draft.head.feature_layers == (2, 4, 5)
    assert m.draft.head.kind == "eagle3" and m.draft.head.layout == "eagle3"
    assert m.target.kv_layout == (c.KV_SHARED if graph == "fused" else c.KV_SEQ_MAJOR)
    spec = next(s for s in m.target.outputs if s.name == c.TAPPED_FEATURES)
    assert spec.shape[2] == 3 * 64
    be = OrtBackend(out, m.target, m.graph_dims("target"), threads=1, shared=m.shared_weights)
    kv = be.allocate_kv(32)
    prompt = np.random.default_rng(8).integers(1, 256, 13).tolist()
    got = prefill(be, kv, prompt)[c.TAPPED_FEATURES][0]
    assert got.shape == (13, 192)
    with torch.no_grad():
        hs = [h[0].numpy() for h in deep.hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states]
    assert len(hs) == 9
    for j, layer in enumerate((2, 4, 5)):
        tap = got[:, 64 * j:64 * (j + 1)]
        np.testing.assert_allclose(tap, hs[layer], rtol=0, atol=ATOL, err_msg=f"tap {j} (layer {layer})")
        for other in (layer - 1, layer + 1):
            assert np.abs(tap - hs[other]).max() > 100 * ATOL, f"layer {layer} vs {other}: the test cannot tell"


def test_first_and_last_layer_taps(eagle3):
    """The conftest export taps layer 0 (the token embedding) and layer 1, the 2-layer
    target's last (its input: the output of layer 0, in the fused graph residual + pending)."""
    m = eagle3.manifest
    assert m.target.feature_layers == (0, 1)
    be = eagle3.backend("target")
    prompt = np.random.default_rng(9).integers(1, 256, 11).tolist()
    got = prefill(be, be.allocate_kv(16), prompt)
    with torch.no_grad():
        out = eagle3.hf(torch.tensor([prompt]), output_hidden_states=True)
    hs = [h[0].numpy() for h in out.hidden_states]
    np.testing.assert_allclose(got[c.TAPPED_FEATURES][0], np.concatenate([hs[0], hs[1]], -1), rtol=0, atol=ATOL)
    np.testing.assert_array_equal(got[c.TAPPED_FEATURES][0, :, :64],
                                  eagle3.hf.model.embed_tokens.weight.detach().numpy()[prompt])
    np.testing.assert_allclose(got[c.LOGITS][0], out.logits[0].numpy(), rtol=0, atol=ATOL)
    assert np.abs(hs[1] - hs[2]).max() > 100 * ATOL and np.abs(hs[0] - hs[1]).max() > 100 * ATOL


@pytest.mark.parametrize("graph", ["fused", "standard"])
def test_deep_export_decodes_losslessly(deep, graph):
    """The 3-tap export end to end (target taps -> draft -> verification): greedy output equals
    transformers' greedy loop."""
    from eagle_deploy.runtime.api import EagleRuntime

    rt = EagleRuntime.load(deep.exports[graph], threads=1)
    eos = list(Manifest.load(deep.exports[graph]).eos_token_ids)
    assert eos == [tiny.EOS_ID]
    for prompt in ([5, 6, 7, 8, 9], [100, 3, 77, 20, 21, 22, 23, 1, 2]):
        assert rt.generate(prompt, max_new_tokens=16).token_ids == until_eos(hf_greedy(deep.hf, prompt, 16), eos, 16)


# =========================================================================== 4. every tensor applied


def _bump(key: str, t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """norms + 0.5; anything else + noise of its own scale (a uniform scale would vanish
    behind an RMS norm, e.g. the embedding's)."""
    if key.endswith("norm.weight"):
        return t + 0.5
    return t + torch.randn(t.shape, generator=gen) * (0.5 * float(t.abs().mean()) + 0.05)


@pytest.mark.parametrize("which", ["biased", "narrow"])
def test_every_checkpoint_tensor_reaches_the_outputs(request, gqa, tmp_path, which):
    """A tensor loaded but never applied: perturbing any one tensor of the checkpoint changes
    the draft's outputs on the extension call (tapped rows) and on both expansion calls (own
    rows), for a 96-wide speculators head with every bias and its own embedding and a 64-wide
    head whose own embed_tokens must win over the target's."""
    from safetensors.torch import load_file, save_file

    src = request.getfixturevalue(f"{which}_head")
    state = load_file(str(src / WEIGHTS))
    expected = {"biased": {"fc.bias", "embed_tokens.weight", "layers.0.self_attn.q_proj.bias",
                           "layers.0.self_attn.k_proj.bias", "layers.0.self_attn.v_proj.bias",
                           "layers.0.hidden_norm.weight"},
                "narrow": {"embed_tokens.weight", "midlayer.hidden_norm.weight", "norm.weight"}}[which]
    assert expected <= set(state)
    head = load_head(src, gqa.hf)
    if which == "biased":
        assert head.fc.bias is not None and head.midlayer.self_attn.k_proj.bias is not None
    assert head.embed is not gqa.hf.get_input_embeddings()
    calls = _calls_for(head)
    base = _torch_run(head, calls)[0]
    _assert_same(base, _raw_draft(src, gqa.hf, calls)[0], what="raw reference")
    gen = torch.Generator().manual_seed(0)
    unchanged = []
    keys = sorted(k for k in state if k not in ("d2t", "t2d"))
    assert len(keys) == {"biased": 18, "narrow": 14}[which]  # 13 required + the optional ones above
    for key in keys:
        folder = tmp_path / key
        shutil.copytree(src, folder)
        save_file({**state, key: _bump(key, state[key], gen)}, str(folder / WEIGHTS))
        out = _torch_run(load_head(folder, gqa.hf), calls)[0]
        for i, (a, b) in enumerate(zip(base, out)):
            if _delta(a, b) < 1e-4:
                unchanged.append(f"{key} (call {i}: {_delta(a, b):.2e})")
    assert unchanged == [], f"tensors with no effect on the outputs: {unchanged}"


# =========================================================================== 5. head width vs target width


def test_eagle3_manifest_sizes_each_graph_by_its_own_width(eagle3):
    m = eagle3.manifest
    head = m.draft.head
    assert (head.kind, head.hidden, head.num_heads, head.num_kv_heads, head.head_dim) == ("eagle3", 96, 6, 3, 16)
    assert head.feature_layers == EAGLE3_TAPS == m.target.feature_layers
    t, d = m.graph_dims("target"), m.graph_dims("draft")
    assert (t.hidden, t.num_heads, t.num_kv_heads, t.head_dim) == (64, 4, 2, 16)
    assert (d.hidden, d.num_heads, d.num_kv_heads, d.head_dim) == (96, 6, 3, 16)
    assert d.num_layers == 1 and t.num_layers == 2  # the head's one layer, the target's two
    assert d.replace(hidden=64, num_heads=4, num_kv_heads=2, num_layers=2) == m.dims  # all else the target's
    assert m.dims == t
    tapped_in = next(s for s in m.draft.inputs if s.name == c.TAPPED_FEATURES)
    tapped_out = next(s for s in m.target.outputs if s.name == c.TAPPED_FEATURES)
    assert tapped_in.shape[2] == tapped_out.shape[2] == 128
    draft_kv = eagle3.backend("draft").allocate_kv(16)
    assert len(draft_kv.arrays) == 2
    assert all(a.shape == (1, 3, 16, 16) for a in draft_kv.arrays)  # shared layout [batch, kv heads, rows, hd]
    target_kv = eagle3.backend("target").allocate_kv(16)
    assert len(target_kv.arrays) == 4 and all(a.shape == (1, 2, 16, 16) for a in target_kv.arrays)


def test_draft_onnx_equals_torch_and_raw_reference(draft_case):
    """A buffer sized by the wrong width, a lost bias, a dropped d2t, a wrong tap count: the
    draft ONNX over an extension call (tapped rows, taps x target hidden) then two expansions
    (own rows, the head's width) equals the exporter's torch draft and the raw reference
    (1e-4), outputs and KV rows."""
    m = draft_case.manifest
    head = load_head(draft_case.head_dir, draft_case.hf)
    assert m.graph_dims("draft").hidden == head.cfg.hidden and m.draft.head.feature_layers == head.cfg.feature_layers
    calls = _calls_for(head)
    got, got_kv = _run(draft_case.backend(), calls)
    want, want_kv = _torch_run(head, calls)
    _assert_same(got, want, what="torch")
    for x, y in zip(got_kv, want_kv):
        np.testing.assert_allclose(x, y, rtol=0, atol=ATOL)
    raw, raw_kv = _raw_draft(draft_case.head_dir, draft_case.hf, calls)
    _assert_same(got, raw, what="raw reference")
    for x, y in zip(got_kv, raw_kv):
        np.testing.assert_allclose(x[:, 0], y, rtol=0, atol=ATOL)


def test_expansion_rows_never_see_their_siblings(eagle3):
    """Changing frontier node 6 (token and features) changes row 6 and its child (row 9) only:
    its siblings (rows 7, 8), hidden by the mask though the fused attention's own causal mask
    would show row 6 to them, and row 8's child (row 10) are unchanged."""
    be = eagle3.backend("draft")
    calls = _calls_for(eagle3.head())
    base = _run(be, calls)[0]
    changed = [calls[0], replace(calls[1], tokens=np.array([201, *calls[1].tokens[1:]]),
                                 own=np.concatenate([calls[1].own[:1] + 1.5, calls[1].own[1:]])), calls[2]]
    out = _run(be, changed)[0]
    for key in (c.NEXT_FEATURES, c.TOPK_LOGPROBS):
        assert np.abs(out[1][key][0, 0] - base[1][key][0, 0]).max() > 1e-2
        assert np.abs(out[2][key][0, 0] - base[2][key][0, 0]).max() > 1e-3
        np.testing.assert_allclose(out[1][key][0, 1:], base[1][key][0, 1:], rtol=0, atol=1e-6)
        np.testing.assert_allclose(out[2][key][0, 1], base[2][key][0, 1], rtol=0, atol=1e-6)


# =========================================================================== 6. clear errors


def _pop(key):
    return lambda s: s.pop(key)


def _put(key, value):
    return lambda s: s.update({key: value})


# case -> (layout, change to the tensors, words the error must contain)
STATE_BROKEN = {
    "missing down_proj": ("eagle3", _pop("midlayer.mlp.down_proj.weight"),
                          ["'midlayer.mlp.down_proj.weight'", "missing"]),
    "missing hidden_norm (speculators)": ("speculators", _pop("layers.0.hidden_norm.weight"),
                                          ["hidden_norm.weight", "missing"]),
    "missing fc.weight": ("eagle3", _pop("fc.weight"), ["'fc.weight'", "missing"]),
    "missing lm_head": ("speculators", _pop("lm_head.weight"), ["'lm_head.weight'", "missing"]),
    "missing norm": ("eagle3", _pop("norm.weight"), ["'norm.weight'", "missing"]),
    "missing own embedding of a wider head": ("eagle3", _pop("embed_tokens.weight"),
                                              ["'embed_tokens.weight'", "96"]),
    "q bias without k/v biases": ("eagle3", _put("midlayer.self_attn.q_proj.bias", torch.zeros(96)),
                                  ["'midlayer.self_attn.k_proj.bias'", "missing"]),
    "unexpected second layer": ("speculators", _put("layers.1.mlp.up_proj.weight", torch.zeros(2, 2)),
                                ["'layers.1.mlp.up_proj.weight'", "unexpected"]),
    "unexpected tensor (mixed layouts)": ("eagle3", _put("layers.0.mlp.up_proj.weight", torch.zeros(128, 96)),
                                          ["'layers.0.mlp.up_proj.weight'", "unexpected"]),
    "misshaped fc.weight": ("eagle3", _put("fc.weight", torch.zeros(96, 64)), ["'fc.weight'", "[96, 64]", "[96, 128]"]),
    "misshaped q_proj": ("speculators", _put("layers.0.self_attn.q_proj.weight", torch.zeros(96, 96)),
                         ["q_proj.weight", "[96, 96]", "[96, 192]"]),
    "lm_head over the full vocabulary": ("eagle3", _put("lm_head.weight", torch.zeros(256, 96)),
                                         ["'lm_head.weight'", "[256, 96]", "[100, 96]"]),
    "misshaped fc.bias": ("eagle3", _put("fc.bias", torch.zeros(64)), ["'fc.bias'", "[64]", "[96]"]),
    "misshaped embedding": ("eagle3", _put("embed_tokens.weight", torch.zeros(256, 64)),
                            ["'embed_tokens.weight'", "[256, 64]", "[256, 96]"]),
    "NaN weight": ("eagle3", lambda s: s["midlayer.mlp.up_proj.weight"].__setitem__((0, 0), float("nan")),
                   ["'midlayer.mlp.up_proj.weight'", "NaN"]),
    "infinite lm_head": ("speculators", lambda s: s["lm_head.weight"].__setitem__((3, 3), float("inf")),
                         ["'lm_head.weight'", "infinite"]),
    "int8 weights": ("eagle3", lambda s: s.update({"fc.weight": s["fc.weight"].to(torch.int8)}),
                     ["'fc.weight'", "int8"]),
}


@pytest.mark.parametrize("case", list(STATE_BROKEN))
def test_bad_tensor_is_one_clear_error(layout_heads, gqa, tmp_path, case):
    _, dirs, _ = layout_heads
    layout, change, words = STATE_BROKEN[case]
    folder = _edit_state(dirs[layout], tmp_path / "head", change)
    with pytest.raises(HeadCheckpointError) as info:
        load_head(folder, gqa.hf)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


def _llama(cfg: dict) -> dict:
    """The Llama part of a config in either layout (edited in place)."""
    return cfg.get("transformer_layer_config") or cfg


def _taps(value, nested: bool = False):
    def change(cfg):
        cfg.pop("eagle_aux_hidden_state_layer_ids", None)
        if nested:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": value}
        elif value is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = value
    return change


TAPS = "eagle_aux_hidden_state_layer_ids"
# case -> (change to config.json in either layout, words the error must contain)
CONFIG_BROKEN = {
    "vocab_size not the target's": (lambda cfg: _llama(cfg).update(vocab_size=300), ["vocab_size", "300", "256"]),
    "target_hidden_size not the target's": (lambda cfg: cfg.update(target_hidden_size=32),
                                            ["target_hidden_size", "32", "64"]),
    "no target_hidden_size on a wider head": (lambda cfg: cfg.pop("target_hidden_size"),
                                              ["target_hidden_size", "96", "64"]),
    "tap past the last layer": (_taps([0, 2]), [TAPS, "[0, 2]"]),
    "negative tap": (_taps([-1, 1]), [TAPS, "[-1, 1]"]),
    "taps descending": (_taps([1, 0]), [TAPS, "[1, 0]"]),
    "tap repeated": (_taps([1, 1]), [TAPS, "[1, 1]"]),
    "tap not an integer": (_taps([0, 1.0]), [TAPS]),
    "nested tap past the last layer": (_taps([0, 5], nested=True), [TAPS, "[0, 5]"]),
    "default taps on a 2-layer target": (_taps(None), [TAPS, "2-layer"]),
    "one tap for a two-tap fc": (_taps([1]), ["'fc.weight'", "[96, 128]", "[96, 64]"]),
    "draft vocabulary above the vocabulary": (lambda cfg: cfg.update(draft_vocab_size=300),
                                              ["draft_vocab_size", "300"]),
    "draft vocabulary not the lm_head's": (lambda cfg: cfg.update(draft_vocab_size=120),
                                           ["'lm_head.weight'", "[100, 96]", "[120, 96]"]),
    "gelu": (lambda cfg: _llama(cfg).update(hidden_act="gelu"), ["hidden_act", "'gelu'"]),
    "kv heads not dividing heads": (lambda cfg: _llama(cfg).update(num_key_value_heads=4), ["num_key_value_heads"]),
    "zero intermediate size": (lambda cfg: _llama(cfg).update(intermediate_size=0), ["intermediate_size", "0"]),
    # values the EAGLE-1/2 loader refuses (eagle12_checkpoint.check_head_config): each is one
    # HeadCheckpointError naming the key, never a raw TypeError / ValueError or a silent NaN head
    "text rms_norm_eps": (lambda cfg: _llama(cfg).update(rms_norm_eps="x"), ["rms_norm_eps", "'x'"]),
    "zero rms_norm_eps": (lambda cfg: _llama(cfg).update(rms_norm_eps=0), ["rms_norm_eps", "0"]),
    "negative rms_norm_eps": (lambda cfg: _llama(cfg).update(rms_norm_eps=-1e-5), ["rms_norm_eps", "-1e-05"]),
    "text rope_theta": (lambda cfg: _llama(cfg).update(rope_theta="x"), ["rope_theta", "'x'"]),
    "zero rope_theta (NaN rotary)": (lambda cfg: _llama(cfg).update(rope_theta=0), ["rope_theta", "0"]),
    "text head_dim": (lambda cfg: _llama(cfg).update(head_dim="16"), ["head_dim", "'16'"]),
    "taps not a list": (_taps(5), [TAPS, "5"]),
    "eagle_config not an object": (lambda cfg: (cfg.pop(TAPS), cfg.update(eagle_config=[0, 1])), ["eagle_config"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(CONFIG_BROKEN))
def test_bad_config_is_one_clear_error(layout_heads, gqa, tmp_path, case, layout):
    _, dirs, _ = layout_heads
    change, words = CONFIG_BROKEN[case]
    folder = _edit_config(dirs[layout], tmp_path / "head", change)
    with pytest.raises(HeadCheckpointError) as info:
        load_head(folder, gqa.hf)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


@pytest.mark.parametrize("value", ["missing", [1], "llama"])
def test_speculators_config_without_its_llama_part_is_refused(layout_heads, gqa, tmp_path, value):
    _, dirs, _ = layout_heads

    def change(cfg):
        cfg.pop("transformer_layer_config")
        if value != "missing":
            cfg["transformer_layer_config"] = value

    folder = _edit_config(dirs["speculators"], tmp_path / "head", change)
    with pytest.raises(HeadCheckpointError, match="transformer_layer_config"):
        load_head(folder, gqa.hf)


@pytest.mark.parametrize("draft_vocab", [100, 0])
def test_explicit_draft_vocab_is_refused_and_writes_nothing(eagle3, tmp_path, draft_vocab):
    out_root = tmp_path / "out"
    with pytest.raises(ValueError, match="--draft-vocab") as info:
        export(str(eagle3.target_dir), str(eagle3.head_dir), out_root,
               ExportOptions(max_length=64, draft_vocab=draft_vocab, name="x"), progress=None)
    assert "EAGLE-3" in str(info.value) and "128" in str(info.value)
    assert not out_root.exists() or list(out_root.iterdir()) == []


def test_cli_draft_vocab_for_eagle3_is_one_error_line(eagle3, tmp_path, capsys):
    from eagle_deploy.exporter.cli import main

    out_root = tmp_path / "engines"
    rc = main(["--model", str(eagle3.target_dir), "--draft", str(eagle3.head_dir), "--out", str(out_root),
               "--max-length", "64", "--draft-vocab", "100"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("eagle-export: error:")]
    assert rc == 2 and len(lines) == 1 and "--draft-vocab" in lines[0] and "Traceback" not in err, err
    assert not out_root.exists() or list(out_root.iterdir()) == []


def test_graph_top_k_above_the_draft_vocabulary_is_refused(eagle3, tmp_path):
    with pytest.raises(ValueError, match="--graph-top-k 129"):
        export(str(eagle3.target_dir), str(eagle3.head_dir), tmp_path / "out",
               ExportOptions(max_length=64, graph_top_k=129, name="x"), progress=None)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_bad_head_export_writes_nothing(layout_heads, gqa, tmp_path):
    _, dirs, _ = layout_heads
    folder = _edit_state(dirs["speculators"], tmp_path / "head", _pop("d2t"))
    out_root = tmp_path / "out"
    with pytest.raises(HeadCheckpointError, match="'d2t'"):
        export(str(gqa.target_dir), str(folder), out_root, ExportOptions(max_length=64, name="x"), progress=None)
    assert not out_root.exists() or list(out_root.iterdir()) == []


def test_failure_after_the_graphs_leaves_no_folder(eagle3, tmp_path, monkeypatch):
    """A step failing after both EAGLE-3 graphs were written: no partial folder in --out."""
    import eagle_deploy.exporter.export as ex

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ex, "write_manifest", broken)
    out_root = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk full"):
        export(str(eagle3.target_dir), str(eagle3.head_dir), out_root, ExportOptions(max_length=64, name="x"),
               progress=None)
    assert not out_root.exists()  # not even the --out folder the export made for itself


# =========================================================================== 7. manifest


def _manifest_error(data: dict, tmp_path: Path) -> str:
    folder = tmp_path / "export"
    folder.mkdir(exist_ok=True)
    (folder / c.MANIFEST_FILE).write_text(json.dumps(data))
    with pytest.raises(ManifestError) as info:
        Manifest.load(folder)
    message = str(info.value)
    assert "\n" not in message
    return message


def _deep_manifest(deep) -> dict:
    return json.loads((deep.exports["fused"] / c.MANIFEST_FILE).read_text())


def test_deep_manifest_round_trips(deep, tmp_path):
    data = _deep_manifest(deep)
    assert data["target"]["extra"]["feature_layers"] == [2, 4, 5]
    assert data["draft"]["extra"]["head"]["feature_layers"] == [2, 4, 5]
    m = Manifest.from_json(data)
    assert json.loads(json.dumps(m.model_dump(mode="json"))) == data


@pytest.mark.parametrize("where", ["target", "draft"])
def test_disagreeing_feature_layers_name_the_field(deep, tmp_path, where):
    data = _deep_manifest(deep)
    if where == "target":
        data["target"]["extra"]["feature_layers"] = [2, 4, 6]
    else:
        data["draft"]["extra"]["head"]["feature_layers"] = [2, 3, 5]
    message = _manifest_error(data, tmp_path)
    assert "target.extra.feature_layers" in message and "draft.extra.head.feature_layers" in message, message
    assert ("[2, 4, 6]" if where == "target" else "[2, 3, 5]") in message, message


def test_target_taps_without_an_eagle3_head_fail(deep, tmp_path):
    data = _deep_manifest(deep)
    del data["target"]["extra"]["feature_layers"]
    message = _manifest_error(data, tmp_path)
    assert "target." in message, message


def test_eagle_head_record_with_sizes_is_rejected(gqa, deep, tmp_path):
    data = json.loads((gqa.export_dir / c.MANIFEST_FILE).read_text())
    data["draft"]["extra"]["head"] = {"kind": "eagle", "hidden": 64}
    message = _manifest_error(data, tmp_path)
    assert "draft.extra.head.hidden" in message and "no such field" in message, message
    data["draft"]["extra"]["head"] = {"kind": "eagle"}
    assert Manifest.from_json(data).draft.head_kind == "eagle"
    deep_data = _deep_manifest(deep)
    deep_data["draft"]["extra"]["head"]["kind"] = "eagle"
    message = _manifest_error(deep_data, tmp_path)
    assert "draft.extra.head." in message and "no such field" in message, message


@pytest.mark.parametrize("field, value, words", [
    ("feature_layers", [2, 4, 8], ["draft.extra.head.feature_layers[2]", "8"]),
    ("feature_layers", [4, 2, 5], ["draft.extra.head.feature_layers", "ascending"]),
    ("num_kv_heads", 3, ["draft.extra.head.num_kv_heads", "3"]),
    ("hidden", 0, ["draft.extra.head.hidden", "0"]),
])
def test_damaged_head_record_names_the_field(deep, tmp_path, field, value, words):
    data = _deep_manifest(deep)
    data["draft"]["extra"]["head"][field] = value
    message = _manifest_error(data, tmp_path)
    assert all(w in message for w in words), message


def test_a_head_the_fused_graph_cannot_hold_gets_the_standard_graph_or_one_clear_error(gqa, tmp_path):
    """An EAGLE-3 head with head dim 8 (onnxruntime's fused attention needs a multiple of 16) and
    one KV head: --graph auto falls back to the standard graph (which decodes losslessly),
    --graph fused is one ValueError naming the reason, and nothing is left behind."""
    from eagle_deploy.contract import onnx_io as c
    from eagle_deploy.contract.manifest import Manifest
    from eagle_deploy.exporter.export import ExportOptions, export

    head = tiny.build_tiny_eagle3_head(tmp_path / "h", gqa.target_dir, seed=3, hidden=32, num_heads=4,
                                       num_kv_heads=1, intermediate=64, feature_layers=(0, 1))
    out = export(str(gqa.target_dir), str(head), tmp_path / "x", ExportOptions(max_length=64, name="auto"),
                 progress=None)
    m = Manifest.load(out)
    assert m.target.kv_layout == m.draft.kv_layout == c.KV_SEQ_MAJOR
    from eagle_deploy.runtime.api import EagleRuntime

    prompt = [5, 6, 7, 8, 9]
    assert EagleRuntime.load(out, threads=1).generate(prompt, max_new_tokens=12).token_ids == gqa.expected(prompt, 12)
    with pytest.raises(ValueError, match="head dim 8 is not a multiple of 16.*--graph standard"):
        export(str(gqa.target_dir), str(head), tmp_path / "y", ExportOptions(max_length=64, name="f", graph="fused"),
               progress=None)
    assert not (tmp_path / "y").exists()
