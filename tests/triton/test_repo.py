"""Writing a Triton model repository (triton/repo.py, eagle-triton-repo, eagle-export
--triton-repo) and the stub environment (triton/env.py); no server needed."""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from eagle_deploy.contract.manifest import ManifestError
from eagle_deploy.contract.tree_config import TreeConfig, TreeConfigError
from eagle_deploy.exporter import cli as export_cli
from eagle_deploy.triton import env as triton_env
from eagle_deploy.triton import repo as triton_repo
from tests.triton.conftest import model_args, request

INPUT_NAMES = ["text_input", "max_tokens", "stream", "temperature", "top_p", "top_k", "seed", "min_p",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "response_format",
               "exclude_input_in_output"]


def params_of(config: str) -> dict:
    return dict(re.findall(r'parameters \{ key: "([^"]+)" value: \{ string_value: "((?:[^"\\]|\\.)*)" \} \}', config))


def test_repository_layout_and_config(tiny, tmp_path):
    model_dir = triton_repo.write_repo(tiny, tmp_path / "repo", instances=3, threads=2,
                                       tree=TreeConfig("dynamic", 12, 3, 3), default_max_tokens=64)
    assert model_dir == (tmp_path / "repo" / "eagle").absolute()
    assert (model_dir / "1" / "model.py").read_bytes() == triton_repo.MODEL_FILE.read_bytes()
    config = (model_dir / "config.pbtxt").read_text()
    for line in ('name: "eagle"', 'backend: "python"', "max_batch_size: 0",
                 "model_transaction_policy { decoupled: true }", "instance_group [ { count: 3 kind: KIND_CPU } ]"):
        assert line in config
    assert re.findall(r'\{ name: "(\w+)" data_type', config)[:len(INPUT_NAMES)] == INPUT_NAMES
    assert 'name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }' in config  # required
    p = params_of(config)
    assert p["engines"] == str(tiny.absolute()) and p["threads"] == "2" and p["default_max_tokens"] == "64"
    assert p["backend"] == "auto" and p["acceptance"] == "lossless" and p["worker_python"] == sys.executable
    assert p["prefill_graph"] == "auto" and p["prefix_cache_mb"] == "0.0"  # RuntimeOptions' defaults
    assert json.loads(p["tree"].replace('\\"', '"'))["total_tokens"] == 12
    assert p["EXECUTION_ENV_PATH"] == str(triton_env.default_env_dir().absolute())
    assert triton_env.env_ok(Path(p["EXECUTION_ENV_PATH"]))  # created on demand: a numpy<2 venv
    assert not [x for x in (tmp_path / "repo").iterdir() if x.name != "eagle"]  # no staging leftovers


def test_settings_are_checked_before_anything_is_written(tiny, tmp_path):
    out = tmp_path / "repo"
    for kw, message in [({"name": "a/b"}, "model name"), ({"instances": 0}, "instances"), ({"kind": "GPU"}, "kind"),
                        ({"backend": "cuda"}, "backend"), ({"threads": "many"}, "threads"),
                        ({"acceptance": "threshold", "threshold": 0}, "threshold"),
                        ({"default_max_tokens": 0}, "default_max_tokens"),
                        ({"prefill_graph": "int8"}, "prefill_graph"), ({"prefix_cache_mb": -1}, "prefix_cache_mb"),
                        ({"prefix_cache_mb": float("nan")}, "prefix_cache_mb")]:
        with pytest.raises(ValueError, match=message):
            triton_repo.write_repo(tiny, out, execution_env="", **kw)
    with pytest.raises(TreeConfigError):
        triton_repo.write_repo(tiny, out, execution_env="", tree=TreeConfig("dynamic", 16, 4, 99))
    with pytest.raises(ManifestError, match="nothing does not exist: pass an export folder"):
        triton_repo.write_repo(tmp_path / "nothing", out, execution_env="")
    assert not out.exists()
    triton_repo.write_repo(tiny, out, execution_env="")
    with pytest.raises(FileExistsError):
        triton_repo.write_repo(tiny, out, execution_env="")
    triton_repo.write_repo(tiny, out, execution_env="", force=True, name="second")
    assert sorted(x.name for x in out.iterdir()) == ["eagle", "second"]  # other models are left alone
    assert "EXECUTION_ENV_PATH" not in params_of((out / "eagle" / "config.pbtxt").read_text())


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_an_export_whose_files_are_not_its_manifests_is_refused(tiny, tmp_path, damage):
    """Checked as eagle-run checks it (verify_export "fast"), not when tritonserver loads it."""
    from tests.tiny_export import copy_export

    bad = copy_export(tiny, tmp_path / "bad")
    path = bad / "draft.onnx"
    data = bytearray(path.read_bytes())
    if damage == "flipped":
        data[len(data) // 2:len(data) // 2 + 16] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 16])
    else:
        data = data[:len(data) // 2]
    path.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="draft.onnx"):
        triton_repo.write_repo(bad, tmp_path / "repo", execution_env="")
    assert not (tmp_path / "repo").exists()


def test_backend_trt_needs_engines_and_missing_paths_are_noted(tiny, tmp_path, capsys):
    with pytest.raises(ValueError, match="--backend trt needs TensorRT engines"):
        triton_repo.write_repo(tiny, tmp_path / "repo", execution_env="", backend="trt")
    rc = triton_repo.main(["--engines", str(tiny), "--out", str(tmp_path / "repo"), "--execution-env",
                           str(tmp_path / "no-env"), "--worker-python", str(tmp_path / "no-python")])
    err = capsys.readouterr().err.splitlines()
    assert rc == 0  # a repository may be served where those paths exist (a container)
    assert err == [f"eagle-triton-repo: note: --worker-python {tmp_path / 'no-python'} is not an executable file on "
                   "this machine: the model's workers will not start unless it is one where tritonserver runs",
                   f"eagle-triton-repo: note: --execution-env {tmp_path / 'no-env'} does not exist on this machine: "
                   "tritonserver will not load the model unless it exists where tritonserver runs"]


def test_copied_engines_make_a_self_contained_repository(tiny, tmp_path, model_module, reference):
    model_dir = triton_repo.write_repo(tiny, tmp_path / "repo", copy_engines=True, execution_env="")
    p = params_of((model_dir / "config.pbtxt").read_text())
    assert p["engines"] == f"engines/{tiny.name}" and (model_dir / "1" / p["engines"] / "manifest.json").is_file()
    moved = shutil.move(str(tmp_path / "repo"), str(tmp_path / "moved"))  # the repository travels
    model = model_module.TritonPythonModel()
    args = model_args(Path(p["engines"]))
    args["model_repository"] = str(Path(moved) / "eagle")
    model.initialize(args)
    try:
        req = request("def add(a, b):", max_tokens=6, exclude_input_in_output=True)
        model.execute([req])
        assert req.sender.sent[0][0].text() == reference.generate("def add(a, b):", max_new_tokens=6).text
    finally:
        model.finalize()


def test_cli(tiny, tmp_path, capsys):
    out = tmp_path / "repo"
    assert triton_repo.main(["--engines", str(tiny), "--out", str(out), "--instances", "2", "--name", "m",
                             "--execution-env", "", "--depth", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(out.absolute() / "m")
    config = (out / "m" / "config.pbtxt").read_text()
    assert "count: 2" in config and '\\"depth\\": 3' in config
    assert triton_repo.main(["--engines", str(tiny), "--out", str(out), "--name", "p", "--execution-env", "",
                             "--prefill-graph", "target", "--prefix-cache-mb", "64"]) == 0
    capsys.readouterr()
    p = params_of((out / "p" / "config.pbtxt").read_text())
    assert p["prefill_graph"] == "target" and p["prefix_cache_mb"] == "64.0"
    assert triton_repo.main(["--engines", str(tiny), "--out", str(out), "--name", "m", "--execution-env", ""]) == 2
    assert "exists" in capsys.readouterr().err
    assert triton_repo.main(["--engines", str(tmp_path), "--out", str(out), "--name", "x", "--execution-env", ""]) == 2
    capsys.readouterr()
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert triton_repo.main(["--engines", str(tiny), "--out", str(afile), "--execution-env", ""]) == 2
    assert capsys.readouterr().err.strip() == f"eagle-triton-repo: error: --out {afile} is a file, not a folder"
    assert triton_repo.main(["--engines", str(tiny), "--out", str(out), "--instances", "0", "--execution-env", ""]) == 2
    assert capsys.readouterr().err.strip() == ("eagle-triton-repo: error: instances (--instances) must be an integer "
                                               ">= 1, got 0")


def test_eagle_export_triton_repo(tiny, tmp_path, capsys):
    root = tiny.parent.parent  # tests/tiny_export.py: ROOT/{target,head,exports/tiny}
    rc = export_cli.main(["--model", str(root / "target"), "--draft", str(root / "head"), "--out",
                          str(tmp_path / "engines"), "--max-length", "64", "--triton-repo", str(tmp_path / "repo"),
                          "--triton-instances", "2"])
    assert rc == 0, capsys.readouterr().err
    out = Path(capsys.readouterr().out.strip().splitlines()[-1])
    config = (tmp_path / "repo" / "eagle" / "config.pbtxt").read_text()
    assert params_of(config)["engines"] == str(out.absolute()) and "count: 2" in config


def test_stub_env_is_reused_and_its_python_version_read(tmp_path):
    env = triton_env.ensure_stub_env()
    assert env == triton_env.default_env_dir().absolute() and triton_env.env_ok(env)
    assert triton_env.python_version(env) == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert triton_env.ensure_stub_env(env) == env  # already usable: nothing is rebuilt
    assert not triton_env.env_ok(tmp_path)


def test_import_boundaries():
    """The exporter's CLI imports triton.repo, so repo / select / env import no runtime module;
    model.py runs in the stub's numpy<2 venv: standard library, numpy and pb_utils only."""
    from tests.test_layout import PACKAGE, imported_modules

    for name in ("repo.py", "select.py", "env.py", "serve.py"):
        found = imported_modules(PACKAGE / "triton" / name)
        assert not [m for m in found if m.startswith(("eagle_deploy.runtime", "eagle_deploy.exporter"))], name
    allowed = set(sys.stdlib_module_names) | {"numpy", "triton_python_backend_utils"}
    assert {m.split(".")[0] for m in imported_modules(triton_repo.MODEL_FILE)} <= allowed
