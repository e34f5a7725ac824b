"""contract/verify.py: an export folder whose files are not the ones its manifest describes
is refused on load with one line naming the file and "re-export" (issue 26, part 1)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from eagle_deploy.contract import onnx_io as c
from eagle_deploy.contract import verify as v
from eagle_deploy.contract.manifest import Manifest, ManifestError
from eagle_deploy.runtime import cli
from eagle_deploy.runtime.api import EagleRuntime
from tests.tiny_export import copy_export, tiny_export

THREADS = 1


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    return tiny_export(tmp_path_factory)


@pytest.fixture(scope="module")
def int4_dir(export_dir, tmp_path_factory):
    """The same tiny target and head exported with --quant int4 (the tools export is fp32)."""
    from eagle_deploy.exporter.export import ExportOptions, export

    root = export_dir.parent.parent
    return export(str(root / "target"), str(root / "head"), tmp_path_factory.mktemp("int4"),
                  ExportOptions(max_length=256, name="tiny-int4", quant="int4"), progress=None)


def _run(folder, capsys, *extra):
    rc = cli.main(["--engines", str(folder), "--prompt", "hello", "--raw", "--max-new-tokens", "8",
                   "--threads", str(THREADS), *extra])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    return rc, out, lines


def _overwrite(path, start: int, length: int) -> None:
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(os.urandom(length))


def test_the_export_records_every_file_with_its_size_and_sha256(export_dir):
    m = Manifest.load(export_dir)
    on_disk = sorted(p.relative_to(export_dir).as_posix() for p in export_dir.rglob("*") if p.is_file())
    assert sorted(m.files) == [p for p in on_disk if p != c.MANIFEST_FILE]
    for rel, record in m.files.items():
        assert record.size == (export_dir / rel).stat().st_size
        assert record.sha256 == v.sha256_file(export_dir / rel)
        assert record.sampled_sha256 is None  # all under SMALL_FILE: hashed whole on every load
    assert m.target.sha256 == m.files[c.TARGET_FILE].sha256
    assert any(rel.startswith(c.TOKENIZER_DIR + "/") for rel in m.files)
    report = v.verify_export(export_dir, m)
    assert report.files == len(m.files)
    assert report.hashed_bytes == sum(r.size for r in m.files.values())


def test_graph_io_is_what_onnxruntime_reports(export_dir):
    import onnxruntime as ort

    from eagle_deploy.runtime.backends.ort import session_io

    m = Manifest.load(export_dir)
    for which in ("target", "draft"):
        path = export_dir / getattr(m, which).path
        inputs, outputs = v.graph_io(path)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        s_in, s_out = session_io(session)
        assert [(s.name, s.dtype, len(s.shape)) for s in inputs] == [(s.name, s.dtype, len(s.shape)) for s in s_in]
        assert [(s.name, s.dtype) for s in outputs] == [(s.name, s.dtype) for s in s_out]
        assert inputs[0].shape[0] == "batch"


def test_a_manifest_copied_from_another_export_is_refused(export_dir, int4_dir, tmp_path, capsys):
    """Issue scenario 1: fp32's manifest in the int4 folder. The graphs' I/O agree (same
    contract), so only the recorded sizes tell: one line, exit 2, no text produced."""
    folder = copy_export(int4_dir, tmp_path / "int4")
    shutil.copy(export_dir / c.MANIFEST_FILE, folder / c.MANIFEST_FILE)
    rc, out, lines = _run(folder, capsys, "--compare-vanilla")
    records = Manifest.load(export_dir).files
    rel = next(r for r in records if (folder / r).stat().st_size != records[r].size)  # the first one checked
    assert rel.endswith(".onnx")
    assert rc == 2 and out == "" and len(lines) == 1, lines
    assert lines[0] == (f"eagle-run: error: {folder / rel} is {(folder / rel).stat().st_size:,} bytes but "
                        f"{folder / c.MANIFEST_FILE} records {records[rel].size:,}: {v.DIFFERENT}; re-export")


def test_shared_weights_overwritten_in_place_are_refused(export_dir, tmp_path, capsys):
    """Issue scenario 2: half of shared.data overwritten with random bytes (same size)."""
    folder = copy_export(export_dir, tmp_path / "x")
    path = folder / c.SHARED_WEIGHTS_FILE
    _overwrite(path, 0, path.stat().st_size // 2)
    rc, out, lines = _run(folder, capsys)
    assert rc == 2 and out == "" and len(lines) == 1, lines
    assert lines[0].startswith(f"eagle-run: error: {path} does not match {folder / c.MANIFEST_FILE} (sha256 ")
    assert lines[0].endswith("; re-export")
    with pytest.raises(ManifestError, match="shared.data does not match"):
        EagleRuntime.load(folder, threads=THREADS)
    assert EagleRuntime.load(folder, threads=THREADS, verify="off").verification.level == "off"


def test_large_files_are_checked_by_sampled_blocks_and_fully_on_request(export_dir, tmp_path, monkeypatch):
    """Files above SMALL_FILE get a sampled digest: half a file overwritten is caught by the
    fast level; one changed byte only by "full" (every sha256)."""
    monkeypatch.setattr(v, "SMALL_FILE", 1000)
    monkeypatch.setattr(v, "SAMPLE_BLOCKS", 4)  # 16-byte blocks: the 64 KiB shared file has gaps between them
    monkeypatch.setattr(v, "SAMPLE_BLOCK", 16)
    folder = copy_export(export_dir, tmp_path / "x")
    manifest = Manifest.load(folder).replace(files=v.file_records(folder))
    manifest.save(folder)
    manifest = Manifest.load(folder)
    assert manifest.files[c.SHARED_WEIGHTS_FILE].sampled_sha256 == v.sampled_digest(folder / c.SHARED_WEIGHTS_FILE)
    report = v.verify_export(folder, manifest)
    assert report.hashed_bytes == sum(r.size for r in manifest.files.values() if r.size <= 1000) + \
        sum(1 for r in manifest.files.values() if r.size > 1000) * v.SAMPLE_BLOCKS * v.SAMPLE_BLOCK
    path = folder / c.SHARED_WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # one byte between sampled blocks
    v.verify_export(folder, manifest)  # fast: not seen
    with pytest.raises(ManifestError, match=r"shared\.data does not match .* \(sha256 .*; re-export$"):
        v.verify_export(folder, manifest, "full", progress=False)
    _overwrite(path, path.stat().st_size // 2, path.stat().st_size // 2)
    with pytest.raises(ManifestError, match=f"shared.data does not match .*{v.SAMPLE_BLOCKS} sampled blocks differ"):
        v.verify_export(folder, manifest)


def test_full_verification_shows_a_progress_bar_for_large_exports(export_dir, monkeypatch, capsys):
    monkeypatch.setattr(v, "BAR_BYTES", 1000)
    manifest = Manifest.load(export_dir)
    assert v.verify_export(export_dir, manifest, "full", progress=True).hashed_bytes > 1000
    assert "verifying sha256" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["tokenizer file removed", "tokenizer file edited", "draft graph resized"])
def test_every_recorded_file_is_checked(export_dir, tmp_path, capsys, case):
    folder = copy_export(export_dir, tmp_path / "x")
    tok = next(p for p in sorted((folder / c.TOKENIZER_DIR).iterdir()) if p.name == "tokenizer.json")
    if case == "tokenizer file removed":
        tok.unlink()
        word = f"{tok} is missing ({folder / c.MANIFEST_FILE} lists it)"
    elif case == "tokenizer file edited":
        tok.write_text(tok.read_text().replace('"', "'", 1))
        word = f"{tok} does not match"
    else:
        with open(folder / c.DRAFT_FILE, "ab") as f:
            f.write(b"\0" * 10)
        word = f"{folder / c.DRAFT_FILE} is "
    rc, out, lines = _run(folder, capsys)
    assert rc == 2 and out == "" and len(lines) == 1 and word in lines[0] and "re-export" in lines[0], lines


def test_a_graph_whose_outputs_differ_from_the_manifest_is_refused_before_any_session(export_dir, tmp_path,
                                                                                        monkeypatch):
    """The graph's own I/O (read without its weights) against the manifest: no session opens."""
    import onnx

    folder = copy_export(export_dir, tmp_path / "x")
    model = onnx.load(str(folder / c.DRAFT_FILE))
    model.graph.output[2].type.tensor_type.elem_type = onnx.TensorProto.INT32
    onnx.save(model, str(folder / c.DRAFT_FILE))
    import eagle_deploy.runtime.backends.ort as ort_backend

    monkeypatch.setattr(ort_backend, "open_session", lambda *a: pytest.fail("a session was opened"))
    with pytest.raises(ManifestError, match=r"draft\.outputs\[2\]\.dtype: expected int32 \(graph draft\.onnx output "
                                            r"'topk_ids'\), found int64; the graph and the manifest disagree"):
        EagleRuntime.load(folder, threads=THREADS)


def test_the_file_record_is_required_and_a_large_file_without_samples_is_hashed_whole(export_dir, tmp_path,
                                                                                     monkeypatch):
    """Every manifest lists its files; a large file recorded without a sampled digest (a hand-made
    manifest) is compared by its sha256 at "fast" too, never left unchecked."""
    folder = copy_export(export_dir, tmp_path / "x")
    data = json.loads((folder / c.MANIFEST_FILE).read_text())
    (folder / c.MANIFEST_FILE).write_text(json.dumps({k: v for k, v in data.items() if k != "files"}))
    with pytest.raises(ManifestError, match=r"manifest\.json files: expected a JSON object, found nothing"):
        Manifest.load(folder)
    (folder / c.MANIFEST_FILE).write_text(json.dumps(data))
    monkeypatch.setattr(v, "SMALL_FILE", 1000)
    manifest = Manifest.load(folder)
    assert manifest.files[c.SHARED_WEIGHTS_FILE].sampled_sha256 is None  # recorded while it was "small"
    assert v.verify_export(folder, manifest).hashed_bytes == sum(r.size for r in manifest.files.values())
    _overwrite(folder / c.SHARED_WEIGHTS_FILE, 5000, 100)
    with pytest.raises(ManifestError, match="shared.data does not match"):
        v.verify_export(folder, manifest)


@pytest.mark.parametrize("bad, text", [
    ({"../x": {"size": 1, "sha256": "0" * 64}}, "files['../x']: expected a relative file path"),
    ({"a": {"size": -1, "sha256": "0" * 64}}, "files.a.size: expected an integer >= 0, found -1"),
    ({"a": {"size": 1, "sha256": "XYZ"}}, "files.a.sha256: expected a sha256 (64 lowercase hex digits), found 'XYZ'"),
])
def test_a_malformed_file_record_is_one_line(export_dir, bad, text):
    data = json.loads((export_dir / c.MANIFEST_FILE).read_text())
    with pytest.raises(ManifestError) as err:
        Manifest.from_json({**data, "files": bad}, "m.json")
    assert str(err.value).startswith(f"m.json {text}"), err.value


def test_an_unknown_level_is_refused(export_dir):
    with pytest.raises(ValueError, match="verify must be one of fast, full, off, got 'quick'"):
        v.verify_export(export_dir, Manifest.load(export_dir), "quick")


def _mismatched(export_dir, tmp_path):
    folder = copy_export(export_dir, tmp_path / "x")
    _overwrite(folder / c.SHARED_WEIGHTS_FILE, 0, 1000)
    return folder


def test_every_loader_verifies_before_serving(export_dir, tmp_path, capsys):
    """BatchRuntime.load, eagle-serve and the Triton worker refuse the same folder; --verify off
    (or the worker config's "verify") turns it off."""
    pytest.importorskip("fastapi")
    from eagle_deploy.runtime.batch import BatchRuntime
    from eagle_deploy.serve import cli as serve_cli
    from eagle_deploy.triton.worker import load_runtime

    folder = _mismatched(export_dir, tmp_path)
    with pytest.raises(ManifestError, match="shared.data does not match"):
        BatchRuntime.load(folder, 2, threads=THREADS)
    assert serve_cli.main(["--engines", str(folder), "--port", "0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"eagle-serve: error: {folder / c.SHARED_WEIGHTS_FILE} does not "
                                                   "match") and lines[0].endswith("re-export")
    config = {"engines": str(folder), "backend": "ort", "threads": THREADS}
    with pytest.raises(ManifestError, match="shared.data does not match"):
        load_runtime(config)
    rt, _, _ = load_runtime({**config, "verify": "off"})
    assert rt.verification.level == "off"


def test_eagle_run_verify_full_and_off(export_dir, tmp_path, capsys):
    folder = _mismatched(export_dir, tmp_path)
    rc, out, lines = _run(folder, capsys, "--verify", "full")
    assert rc == 2 and out == "" and len(lines) == 1 and "shared.data does not match" in lines[0]
    rc, out, lines = _run(folder, capsys, "--verify", "off")
    assert rc == 0 and out != ""  # what the issue saw: it runs, on weights that are not the export's
    rc, out, lines = _run(export_dir, capsys, "--verify", "full")
    assert rc == 0 and not any("present but not compared" in ln for ln in lines)


def test_an_unrecorded_file_in_the_tokenizer_folder_is_refused(export_dir, tmp_path, capsys):
    """transformers reads whatever the tokenizer folder holds: a chat template added later is
    not the export's tokenizer (rerecord_files records such an edit on purpose)."""
    folder = copy_export(export_dir, tmp_path / "x")
    extra = folder / c.TOKENIZER_DIR / "chat_template.jinja"
    extra.write_text("{{ messages }}")
    rc, out, lines = _run(folder, capsys)
    assert rc == 2 and out == "" and lines == [f"eagle-run: error: {extra} is not one of the export's files "
                                               f"({folder / c.MANIFEST_FILE} does not list it): {v.DIFFERENT}; remove "
                                               "it or re-export"]
    assert v.rerecord_files(folder).files[f"{c.TOKENIZER_DIR}/chat_template.jinja"].size == extra.stat().st_size
    assert _run(folder, capsys)[0] == 0


def _outside_sampled_blocks(path, at: int) -> int:
    """`at` moved forward until it lies in no block that sampled_digest reads."""
    size = path.stat().st_size
    step = max(size - v.SAMPLE_BLOCK, 0) / (v.SAMPLE_BLOCKS - 1)
    blocks = [int(i * step) for i in range(v.SAMPLE_BLOCKS)]
    while any(b <= at < b + v.SAMPLE_BLOCK for b in blocks):
        at += v.SAMPLE_BLOCK
    return at


def test_a_corrupted_copy_the_fast_check_cannot_see_is_refused_by_every_server(int4_dir, tmp_path, capsys,
                                                                                monkeypatch):
    """Issue 53 scenario: a copy of an int4 export with one huge value written into shared.data
    and one flipped byte in target.onnx passed the fast check, and eagle-serve answered with the
    lossless fingerprint. eagle-serve and the Triton worker verify "full" by default."""
    import struct

    import onnx

    pytest.importorskip("fastapi")
    from eagle_deploy.serve import cli as serve_cli
    from eagle_deploy.triton.worker import load_runtime

    monkeypatch.setattr(v, "SMALL_FILE", 1000)  # the tiny graphs stand for large ones: sampled at level "fast"
    monkeypatch.setattr(v, "SAMPLE_BLOCKS", 4)
    monkeypatch.setattr(v, "SAMPLE_BLOCK", 16)
    folder = copy_export(int4_dir, tmp_path / "x")
    v.rerecord_files(folder)
    shared, target = folder / c.SHARED_WEIGHTS_FILE, folder / c.TARGET_FILE
    with open(shared, "r+b") as f:
        f.seek(_outside_sampled_blocks(shared, shared.stat().st_size // 6 & ~3))
        f.write(struct.pack("<f", 3.0e38))
    graph = onnx.load(str(target), load_external_data=False)
    weight = max((t.raw_data for t in graph.graph.initializer), key=len)
    data = bytearray(target.read_bytes())
    at = _outside_sampled_blocks(target, data.find(weight) + len(weight) // 2)
    data[at] ^= 0x40
    target.write_bytes(bytes(data))
    v.verify_export(folder, Manifest.load(folder))  # the fast level does not see it: the case of the issue

    monkeypatch.setattr(serve_cli, "uvicorn_config", lambda *a: pytest.fail("eagle-serve went on to serve"))
    assert serve_cli.main(["--engines", str(folder), "--port", "0", "--threads", str(THREADS)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eagle-serve: error: ") and "does not match" in lines[0]
    assert f"{shared} " in lines[0] or f"{target} " in lines[0]
    with pytest.raises(ManifestError, match=r"(shared\.data|target\.onnx) does not match .*\(sha256 "):
        load_runtime({"engines": str(folder), "backend": "ort", "threads": THREADS})


@pytest.mark.parametrize("name", [c.SHARED_WEIGHTS_FILE, c.TARGET_FILE, c.MANIFEST_FILE])
def test_a_symlink_loop_is_named_as_one(export_dir, tmp_path, capsys, name):
    """Issue 53: a symlink loop in place of shared.data was reported as "shared.data is missing"."""
    folder = copy_export(export_dir, tmp_path / "x")
    path = folder / name
    path.unlink()
    os.symlink(name, path)  # a link to itself
    rc, out, lines = _run(folder, capsys)
    assert rc == 2 and out == "" and len(lines) == 1, lines
    assert lines[0].startswith(f"eagle-run: error: {path} is a symlink loop (a link that leads back to itself, "
                               "not a file)")
    assert "missing" not in lines[0] and lines[0].endswith("re-export")


def test_a_dangling_symlink_names_its_target(export_dir, tmp_path, capsys):
    folder = copy_export(export_dir, tmp_path / "x")
    path = folder / c.SHARED_WEIGHTS_FILE
    path.unlink()
    os.symlink(tmp_path / "gone.data", path)
    rc, out, lines = _run(folder, capsys)
    assert rc == 2 and len(lines) == 1
    assert lines[0].startswith(f"eagle-run: error: {path} is a symlink to {tmp_path / 'gone.data'}, which does not "
                               "exist")
