"""`manifest.json`: what an export folder holds, read by the runtime instead of guessing.

Written by `eagle-export` beside the graphs; the runtime reads only this file, the graphs and
the tokenizer folder (it never imports the torch model).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagle_deploy.contract.onnx_io import MANIFEST_FILE

FORMAT_VERSION = 1


class ManifestError(ValueError):
    """An export folder or its manifest is missing, malformed or of another format version."""


@dataclass
class GraphEntry:
    """One exported graph: file, precision, I/O contract (list of TensorSpec json)."""

    path: str
    dtype: str  # activation/KV dtype T: float32 | float16 | bfloat16
    inputs: list[dict]
    outputs: list[dict]
    quant: str | None = None  # None | "int4" | "int8"
    sha256: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class Manifest:
    """Everything the runtime needs about an export (see engines/README.md)."""

    name: str
    dims: dict  # num_layers, hidden, num_heads, num_kv_heads, head_dim, vocab, max_position_embeddings, rms_norm_eps
    max_length: int  # KV capacity in tokens (prompt + generated)
    target: GraphEntry
    draft: GraphEntry  # extra: graph_top_k, trained, draft_vocab_size
    tree: dict  # default TreeConfig (runtime.tree.TreeConfig.to_json)
    eos_token_ids: list[int]
    tokenizer: str | None  # folder name inside the export, or None
    chat_template: bool
    sources: dict  # {"target": {...}, "draft": {...}} with paths and sha256
    tools: dict  # versions of the tools that produced the export
    engines: dict = field(default_factory=dict)  # extra backends (e.g. "trt": {...})
    notes: list[str] = field(default_factory=list)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict:
        return asdict(self)

    def save(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, folder: Path) -> "Manifest":
        folder = Path(folder)
        path = folder / MANIFEST_FILE
        if not path.exists():
            raise ManifestError(f"{folder} is not an export folder (no {MANIFEST_FILE}); run eagle-export first")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ManifestError(f"{path} is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise ManifestError(f"{path} is malformed: expected a JSON object, got {type(data).__name__}; re-export")
        if data.get("format_version") != FORMAT_VERSION:
            raise ManifestError(f"{path} has format_version {data.get('format_version')}, this runtime reads {FORMAT_VERSION}; re-export")
        try:
            data["target"] = GraphEntry(**data["target"])
            data["draft"] = GraphEntry(**data["draft"])
            return cls(**data)
        except (KeyError, TypeError) as err:
            raise ManifestError(f"{path} is malformed: {err}") from None
