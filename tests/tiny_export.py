"""One tiny export (random Llama target + random EAGLE head, tests/tiny.py) shared by the
tests of a session that need one (bench, train, validate, serve, triton and others), plus a short
prompt file that fits its 256-token capacity."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

PROMPTS = [
    {"id": "code-1", "category": "code", "prompt": "def add(a, b):"},
    {"id": "chat-1", "category": "chat", "prompt": "Hello there, how are you?"},
    {"id": "code-2", "category": "code", "prompt": "for i in range(10): print(i)"},
]
_CACHE: dict[str, Path] = {}


def tiny_export(tmp_path_factory) -> Path:
    """Build (once per session) and return the tiny export folder. Copy it before changing it."""
    key = str(tmp_path_factory.getbasetemp())
    if key not in _CACHE:
        import torch

        from eagle_deploy.exporter.export import ExportOptions, export
        from tests import tiny

        torch.set_num_threads(1)
        root = tmp_path_factory.mktemp("tools-tiny")
        target = tiny.build_tiny_target(root / "target", seed=0, norm_noise=0.1)
        head = tiny.build_tiny_head(root / "head", target, seed=1, norm_noise=0.1)
        _CACHE[key] = export(str(target), str(head), root / "exports", ExportOptions(max_length=256, name="tiny"),
                             progress=None)
    return _CACHE[key]


def copy_export(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def prompt_file(folder: Path, rows=PROMPTS) -> Path:
    path = Path(folder) / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def specbench_file(tmp_path, per_task: int = 3) -> Path:
    """A question.jsonl in Spec-Bench's layout: `per_task` questions of three MT-bench categories
    and of the five other tasks (MT-bench questions have a second turn)."""
    rows, qid = [], 0
    tasks = ["writing", "roleplay", "coding", "translation", "summarization", "qa", "math_reasoning", "rag"]
    for task in tasks:
        for i in range(per_task):
            qid += 1
            second = ["and a second turn"] if task in ("writing", "roleplay", "coding") else []
            turns = [f"{task} question {i}"] + second
            rows.append({"question_id": qid, "category": task, "turns": turns})
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path
