"""The manifest's shared-weights record (`shared_weights`) and the draft vocabulary's ranking
source: round trip, left out of the JSON when nothing is shared, one-line errors for damaged
fields, and the file check the backends run before opening a graph."""
from __future__ import annotations

import json

import pytest

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import Manifest, ManifestError, SharedTensor, SharedWeights
from tests.contract.test_manifest import _error, _manifest

EMBED = SharedTensor(role="embedding", target_name="embed.weight", draft_name="embed.weight", dtype="float32",
                     shape=(256, 64), offset=0, length=256 * 64 * 4)
SHARED = SharedWeights(file=c.SHARED_WEIGHTS_FILE, size=EMBED.length, tensors=(EMBED,), sha256="cd")


def _data(**changes) -> dict:
    return json.loads(json.dumps(_manifest(**changes).model_dump(mode="json")))


def test_shared_weights_and_vocab_source_round_trip(tmp_path):
    m = _manifest(shared_weights=SHARED, draft=_manifest().draft.replace(draft_vocab_size=64,
                                                                         draft_vocab_file="draft_vocab.npy",
                                                                         draft_vocab_source="merge_rank"))
    m.save(tmp_path)
    data = json.loads((tmp_path / c.MANIFEST_FILE).read_text())
    assert data["shared_weights"]["tensors"][0] == {"role": "embedding", "target_name": "embed.weight",
                                                    "draft_name": "embed.weight", "dtype": "float32",
                                                    "shape": [256, 64], "offset": 0, "length": 65536}
    assert data["draft"]["extra"]["draft_vocab_source"] == "merge_rank"
    assert Manifest.load(tmp_path) == m


def test_exports_without_shared_weights_leave_the_key_out():
    data = _data()
    assert "shared_weights" not in data
    m = Manifest.from_json(data)
    assert m.shared_weights is None and m.draft.draft_vocab_source is None


@pytest.mark.parametrize("field, value, text", [
    ("role", "bias", "shared_weights.tensors[0].role: expected one of embedding, lm_head"),
    ("length", 10**9, "shared_weights.tensors[0].length: expected at most 65536 (the shared file is 65536 bytes)"),
    ("shape", [256, -1], "shared_weights.tensors[0].shape[1]: expected an integer >= 0"),
    ("dtype", "float8", "shared_weights.tensors[0].dtype: expected one of float32"),
])
def test_damaged_shared_tensor_is_one_line_naming_the_field(field, value, text):
    data = _data(shared_weights=SHARED)
    data["shared_weights"]["tensors"][0][field] = value
    assert text in _error(data)


def test_shared_file_must_be_a_plain_name_other_than_the_graphs():
    for bad in ("../shared.data", c.TARGET_FILE):
        data = _data(shared_weights=SHARED)
        data["shared_weights"]["file"] = bad
        assert "shared_weights.file: expected a data file name inside the export folder" in _error(data)


def test_unknown_vocab_source_is_refused():
    data = _data()
    data["draft"]["extra"]["draft_vocab_source"] = "vibes"
    assert "draft.extra.draft_vocab_source: expected one of token_counts, merge_rank, token_id" in _error(data)


def test_check_names_the_missing_or_truncated_file(tmp_path):
    with pytest.raises(ManifestError, match="shared.data is missing: the draft graph needs the token embedding"):
        SHARED.check(tmp_path)
    (tmp_path / c.SHARED_WEIGHTS_FILE).write_bytes(b"\0" * 100)
    with pytest.raises(ManifestError, match="truncated \\(100 bytes, expected 65536\\): the target graph"):
        SHARED.check(tmp_path, "target")
    (tmp_path / c.SHARED_WEIGHTS_FILE).write_bytes(b"\0" * 65536)
    SHARED.check(tmp_path)
