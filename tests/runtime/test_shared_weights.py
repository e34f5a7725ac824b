"""The runtime side of shared weights: both sessions take the embedding from one read-only
mapping of shared.data; a graph whose shared file is missing or truncated fails with one clear
error; a runtime can open the target alone (vanilla; its memory measured alone) and the draft
later; eagle-run --json reports memory by stage."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import Manifest, ManifestError
from eagle_deploy.runtime.api import EagleRuntime
from eagle_deploy.runtime.backends import load_backend
from tests.conftest import PROMPTS, THREADS


@pytest.fixture
def copy(mha, tmp_path):
    return shutil.copytree(mha.export_dir, tmp_path / "export")


def test_both_sessions_use_one_mapping_of_the_shared_file(mha):
    rt = mha.runtime()
    target, draft = rt.decoder.target, rt.decoder.drafter.backend
    assert target._shared is not None and target._shared is draft._shared
    mapping = target._shared.array
    assert isinstance(mapping, np.memmap) and mapping.size == mha.manifest.shared_weights.size
    # only the embedding is handed over; the LM head (prepacked by onnxruntime) is not
    assert [t.role for t in mha.manifest.shared_weights.tensors] == ["embedding", "lm_head"]
    assert len(target._shared.values) == 1


@pytest.mark.parametrize("which", ["target", "draft"])
def test_a_missing_shared_file_fails_with_one_clear_error(copy, which):
    (copy / c.SHARED_WEIGHTS_FILE).unlink()
    manifest = Manifest.load(copy)
    with pytest.raises(ManifestError) as err:
        load_backend("ort", copy, manifest, which, threads=THREADS)
    text = str(err.value)
    assert "shared.data is missing" in text and f"the {which} graph needs the token embedding and LM head" in text
    assert "re-export" in text and "\n" not in text


def test_a_truncated_shared_file_fails_at_load(copy):
    path = copy / c.SHARED_WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ManifestError, match="shared.data is truncated \\(1000 bytes"):
        EagleRuntime.load(copy, threads=THREADS)


def test_target_alone_then_the_draft(mha):
    rt = mha.runtime(with_draft=False)
    assert rt.decoder.drafter is None
    with pytest.raises(ValueError, match="without its draft graph"):
        rt.generate(PROMPTS[0], max_new_tokens=4)
    assert rt.generate(PROMPTS[0], max_new_tokens=24, mode="vanilla").token_ids == mha.expected(PROMPTS[0], 24)
    rt.load_draft()
    got = rt.generate(PROMPTS[0], max_new_tokens=24)
    assert got.token_ids == mha.expected(PROMPTS[0], 24) and got.stats.draft_forwards > 0
    rt.load_draft()  # a no-op once open


def test_eagle_run_json_reports_memory_by_stage(mha, capsys):
    from eagle_deploy.runtime import cli

    rc = cli.main(["--engines", str(mha.export_dir), "--prompt", "hello there", "--max-new-tokens", "8",
                   "--threads", "1", "--compare-vanilla", "--json"])
    assert rc == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert {"rss_before_load_mb", "rss_target_loaded_mb", "vanilla", "rss_draft_loaded_mb", "eagle",
            "eagle_vs_vanilla_peak_rss", "export"} <= set(memory)
    assert memory["eagle"]["peak_rss_mb"] >= memory["vanilla"]["peak_rss_mb"] > 0  # a high-water mark
    assert memory["eagle_vs_vanilla_peak_rss"] >= 1.0
    files = memory["export"]["files"]
    assert {"target.onnx", "draft.onnx", "shared.data", "manifest.json", "tokenizer/"} <= set(files)
    assert memory["export"]["total"] == sum(files.values())


def test_eagle_run_vanilla_never_opens_the_draft_graph(mha, capsys, monkeypatch):
    from eagle_deploy.runtime import api, cli

    opened = []

    def recording(kind, folder, manifest, which, *args, **kw):
        opened.append(which)
        return load_backend(kind, folder, manifest, which, *args, **kw)

    monkeypatch.setattr(api, "load_backend", recording)
    assert cli.main(["--engines", str(mha.export_dir), "--prompt", "hi", "--max-new-tokens", "4", "--threads", "1",
                     "--vanilla", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert opened == ["target"] and "vanilla" in memory and "eagle" not in memory


def test_device_memory_reads_this_process_from_nvidia_smi(monkeypatch):
    """No GPU here: the nvidia-smi path is checked on its output format (pynvml absent or failing)."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from eagle_deploy.runtime import memory

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails -> nvidia-smi
    out = "123, 500\n4242, 1536\n4242, 64\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=0, stdout=out))
    assert memory.device_memory_mb(4242) == 1600.0 and memory.device_memory_mb(99) == 0.0

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")
    monkeypatch.setattr(subprocess, "run", missing)
    assert memory.device_memory_mb(4242) is None
