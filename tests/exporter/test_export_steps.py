"""`export()` as named steps, and the draft head's own position limit: recorded in the
manifest, and an explicit --max-length above it refused before anything is written."""
from __future__ import annotations

import json
import shutil

import pytest

from eagle_deploy.contract.manifest import Dims, Manifest
from eagle_deploy.exporter.cli import main
from eagle_deploy.exporter.export import ExportOptions, check_max_length, check_options, export


def _dims(limit: int) -> Dims:
    return Dims(num_layers=2, hidden=64, num_heads=4, num_kv_heads=4, head_dim=16, vocab=256,
                max_position_embeddings=limit, rms_norm_eps=1e-5)


def test_check_max_length():
    target, head = _dims(8192), _dims(2048)
    assert check_max_length(None, target, head) == 2048  # a default is capped to the head's limit
    assert check_max_length(None, _dims(100_000), _dims(100_000)) == 4096
    assert check_max_length(2048, target, head) == 2048
    with pytest.raises(ValueError, match=r"--max-length 4096 exceeds the draft head's max_position_embeddings 2048"):
        check_max_length(4096, target, head)
    with pytest.raises(ValueError, match=r"--max-length 9000 must be in \[2, 8192\]"):
        check_max_length(9000, target, head)
    with pytest.raises(ValueError, match=r"--max-length -3 must be in \[2, 8192\]"):
        check_max_length(-3, target, head)


def test_check_options_needs_no_model():
    # fp16 keeps an unquantised draft graph, so it gets the tree of --draft-quant none (test_draft_quant.py)
    unquantised_draft_tree = check_options(ExportOptions(draft_quant="none"))[1]
    assert check_options(ExportOptions(dtype="fp16")) == ("float16", unquantised_draft_tree)
    with pytest.raises(ValueError, match="--dtype fp8"):
        check_options(ExportOptions(dtype="fp8"))
    with pytest.raises(ValueError, match="--quant int4 quantises an fp32 graph"):
        check_options(ExportOptions(dtype="fp16", quant="int4"))


def _short_head(src, dst, limit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = limit
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_max_length_above_the_heads_limit_is_refused_before_anything_is_written(mha, tmp_path, capsys):
    head = _short_head(mha.head_dir, tmp_path / "head", 128)
    out = tmp_path / "engines"
    rc = main(["--model", str(mha.target_dir), "--draft", str(head), "--out", str(out), "--max-length", "200"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("eagle-export: error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "--max-length 200 exceeds the draft head's max_position_embeddings 128" in lines[0]
    assert not out.exists() or list(out.iterdir()) == []


def test_the_heads_limit_is_recorded_and_caps_the_default_length(mha, tmp_path):
    head = _short_head(mha.head_dir, tmp_path / "head", 128)
    folder = export(str(mha.target_dir), str(head), tmp_path / "engines", ExportOptions(name="short"), progress=None)
    m = Manifest.load(folder)
    assert m.draft.max_position_embeddings == 128 and m.max_length == 128 and m.dims.max_position_embeddings == 256
    assert sorted(p.name for p in (tmp_path / "engines").iterdir()) == ["short"]  # no partial folder left


@pytest.mark.parametrize("value", ["long", 0, 1.5])
def test_a_bad_head_position_limit_is_one_clear_error(mha, tmp_path, capsys, value):
    head = _short_head(mha.head_dir, tmp_path / "head", value)
    rc = main(["--model", str(mha.target_dir), "--draft", str(head), "--out", str(tmp_path / "engines"),
               "--max-length", "64"])
    err = capsys.readouterr().err
    assert rc == 2 and "max_position_embeddings must be a positive integer" in err and "Traceback" not in err


def test_the_progress_line_names_the_head_the_draft_graph_is_built_from(tmp_path):
    """A user sees which head an alias picked (its shipped one, an explicit folder, or a random
    one) without opening the manifest."""
    from types import SimpleNamespace

    from eagle_deploy.exporter.export import ExportPlan, head_description

    def plan(draft, default, head_dir):
        checkpoint = SimpleNamespace(default_draft=default)
        return ExportPlan("m", draft, checkpoint, head_dir, tmp_path, "float32", None)

    assert head_description(plan(None, "shipped:qwen2.5-coder-0.5b", tmp_path), False) == \
        "the shipped head qwen2.5-coder-0.5b"
    assert head_description(plan("heads/mine", "shipped:x", tmp_path), True) == "EAGLE-3 head heads/mine"
    assert head_description(plan("random", "shipped:x", None), False) == "a random head (untrained)"
    assert head_description(plan(None, None, None), False) == "a random head (untrained)"
