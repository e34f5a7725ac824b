"""A damaged manifest or a graph that does not match it stops `eagle-run` at load with one
line naming the manifest field (exit 2), before any forward: no traceback, no onnxruntime log.
The pure comparisons are tested in tests/contract/test_manifest.py."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract.manifest import ManifestError
from eagle_deploy.runtime import cli
from eagle_deploy.runtime.backends.ort import OrtBackend
from tests.conftest import THREADS


def _edit(path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _rename_kv(d):
    d["target"]["inputs"][4]["name"] = "past_key_values.0.kez"


# case -> (manifest edit, the exact text of the one error line)
DAMAGED = {
    "renamed KV input of layer 0": (_rename_kv, "target.inputs[4].name: expected 'past_key_values.0.key' (the ONNX I/O "
                                                "contract), found 'past_key_values.0.kez'"),
    "negative max_length": (lambda d: d.update(max_length=-3), "max_length: expected an integer >= 2, found -3"),
    "missing target": (lambda d: d.pop("target"),
                       "target: expected a graph entry (JSON object), found nothing (the key is missing)"),
    "changed num_layers": (lambda d: d["dims"].update(num_layers=3),
                           "dims.num_layers: expected 2 (target.inputs holds the KV of 2 layers), found 3"),
    "changed hidden size": (lambda d: d["dims"].update(hidden=65),
                            "dims.hidden: expected 64 (graph target.onnx output 'features' dimension 2), found 65"),
}


def _run(folder, capsys) -> tuple[int, str]:
    rc = cli.main(["--engines", str(folder), "--prompt", "hi", "--raw", "--max-new-tokens", "4",
                   "--threads", str(THREADS)])
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eagle-run: error: "), err
    return rc, lines[0]


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_manifest_is_one_line_naming_the_field(mha, tmp_path, capsys, case):
    folder = shutil.copytree(mha.export_dir, tmp_path / "export")
    change, text = DAMAGED[case]
    _edit(folder / c.MANIFEST_FILE, change)
    rc, line = _run(folder, capsys)
    assert rc == 2 and line == f"eagle-run: error: {folder / c.MANIFEST_FILE} {text}" + (
        "; the graph and the manifest disagree: re-export" if "(graph " in text else ""), line


def test_a_graph_whose_kv_input_was_renamed_is_caught_when_opened(mha, tmp_path, capsys):
    """The graph changed, the manifest did not: the backend compares the session's inputs
    with the manifest's and names layer 0."""
    import onnx

    folder = shutil.copytree(mha.export_dir, tmp_path / "export")
    model = onnx.load(str(folder / c.TARGET_FILE))
    old, new = c.past_name(0, "key"), "past_key_values.0.kez"
    for i in model.graph.input:
        if i.name == old:
            i.name = new
    for node in model.graph.node:
        node.input[:] = [new if x == old else x for x in node.input]
    onnx.save(model, str(folder / c.TARGET_FILE))
    rc, line = _run(folder, capsys)
    assert rc == 2 and line == (f"eagle-run: error: {folder / c.MANIFEST_FILE} target.inputs[4]: expected input "
                                f"'past_key_values.0.kez' (graph target.onnx has it there), found "
                                f"'past_key_values.0.key'; the graph and the manifest disagree: re-export")


def test_the_ort_backend_checks_the_entry_it_is_given(mha):
    """The comparison also guards entries that did not come from Manifest.load."""
    m = mha.manifest
    renamed = tuple(replace(s, name="past_key_values.0.kez") if s.name == c.past_name(0, "key") else s
                    for s in m.target.inputs)
    with pytest.raises(ManifestError, match=r"target\.inputs\[4\]: expected input 'past_key_values\.0\.key' "
                                            r"\(graph target\.onnx has it there\), found 'past_key_values\.0\.kez'"):
        OrtBackend(mha.export_dir, m.target.replace(inputs=renamed), m.dims, threads=THREADS)
    with pytest.raises(ManifestError, match=r"dims\.vocab: expected 256 \(graph target\.onnx output 'logits'"):
        OrtBackend(mha.export_dir, m.target, m.dims.replace(vocab=300), threads=THREADS)
    OrtBackend(mha.export_dir, m.draft, m.dims, threads=THREADS)  # the real entries pass
