"""The head eagle-train starts from: a trained one (--init-head, checked against the run's
settings before any stage), else a new one with the target's geometry and --head-layers
decoder layers (EAGLE-3: its draft vocabulary and LM head taken from the data's most frequent
response tokens), optionally with its layers copied from consecutive target layers
(--init-from-layer)."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from eagle_deploy.contract.verify import sha256_file
from eagle_deploy.exporter.draft_vocab import best_ranked, default_size
from eagle_deploy.heads.api import kind_of, load_head
from eagle_deploy.heads.eagle3 import random_eagle3_head
from eagle_deploy.heads.eagle3_config import default_feature_layers
from eagle_deploy.heads.files import TOKEN_COUNTS_FILE

from .settings import TrainSettings


@dataclass
class InitHead:
    """A trained head to start from (--init-head): the module, and a sha256 over its files
    (config.json, the weights, token_counts.npy) for the head cache's key."""

    head: object  # EagleHead | Eagle3Head
    sha256: str
    counts: np.ndarray | None  # [vocab] int64: its token_counts.npy, or None


def feature_layers(settings: TrainSettings, hf) -> tuple[int, ...] | None:
    """The target layers an EAGLE-3 head taps (heads.eagle3_config.default_feature_layers); None for
    --arch eagle. Raises ValueError for --feature-layers that are not distinct ascending layers."""
    if settings.arch != "eagle3":
        return None
    layers = settings.feature_layers
    if layers is None:
        return default_feature_layers(hf.config.num_hidden_layers)
    if sorted(set(layers)) != list(layers) or layers[-1] >= hf.config.num_hidden_layers:
        raise ValueError(f"--feature-layers {list(layers)} must be distinct ascending layer ids below "
                         f"{hf.config.num_hidden_layers}")
    return tuple(layers)


def load_init_head(settings: TrainSettings, hf, log) -> InitHead | None:
    """--init-head, loaded for `hf` and checked against --arch (and an EAGLE-3 head against
    --feature-layers / --draft-vocab) before any stage runs. Raises ValueError naming the
    mismatch (HeadCheckpointError, a ValueError, for unreadable or misshapen files)."""
    folder = settings.init_head
    if folder is None:
        return None
    if settings.init_from_layer is not None:
        raise ValueError("--init-head and --init-from-layer both set the head's layer: give one")
    if not folder.is_dir():
        raise ValueError(f"--init-head {folder} is not a folder (a trained head: config.json + model.safetensors)")
    head = load_head(folder, hf)
    kind = kind_of(head)
    if kind != settings.arch:
        raise ValueError(f"--init-head {folder} is an {'EAGLE-3' if kind == 'eagle3' else 'EAGLE-1/2'} head but "
                         f"--arch is {settings.arch}")
    if kind == "eagle" and head.dims.num_layers != settings.head_layers:
        raise ValueError(f"--init-head {folder} has {head.dims.num_layers} decoder layers, not --head-layers "
                         f"{settings.head_layers}")
    if kind == "eagle3":
        layers, size = tuple(head.cfg.feature_layers), len(head.draft_to_target)
        if layers != feature_layers(settings, hf):
            raise ValueError(f"--init-head {folder} taps layers {list(layers)}, not --feature-layers "
                             f"{list(feature_layers(settings, hf))}")
        if settings.draft_vocab not in (None, size):
            raise ValueError(f"--init-head {folder} has a draft vocabulary of {size}, not --draft-vocab "
                             f"{settings.draft_vocab}")
    digest = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".bin",
                                                                              ".npy") and p.name != "train_log.json"):
        digest.update(f"{f.name}:{sha256_file(f)}".encode())
    counts = None
    if (folder / TOKEN_COUNTS_FILE).is_file():
        counts = np.load(folder / TOKEN_COUNTS_FILE)
        if counts.shape != (hf.config.vocab_size,):
            raise ValueError(f"--init-head {folder / TOKEN_COUNTS_FILE} has shape {counts.shape}, not "
                             f"({hf.config.vocab_size},)")
    log(f"init: starting from the head in {folder} ({kind})")
    return InitHead(head, digest.hexdigest(), counts)


def response_counts(data, vocab: int, init: InitHead | None = None) -> np.ndarray:
    """[vocab] int64: the data's response-token counts, plus the starting head's
    token_counts.npy when it has one (the frequencies of everything the head was trained on)."""
    counts = data.response_counts(vocab)
    return counts + init.counts.astype(counts.dtype) if init is not None and init.counts is not None else counts


def new_eagle3_head(hf, counts, layers, size: int | None, seed: int, eos_ids: Sequence[int]):
    """An EAGLE-3 head for `hf` with the target's geometry, tapping `layers`, over a draft
    vocabulary of the `size` most frequent response tokens by `counts` ([vocab]; `eos_ids`
    included; default draft_vocab.default_size), its LM head initialised from the target's rows
    of those tokens and its final norm from the target's; the rest random (random_eagle3_head)."""
    vocab = hf.config.vocab_size
    ids = draft_ids(counts, size or min(default_size(vocab), vocab), eos_ids)
    head = random_eagle3_head(hf, seed=seed, draft_ids=torch.from_numpy(ids), feature_layers=layers)
    with torch.no_grad():
        head.lm_head.weight.copy_(hf.get_output_embeddings().weight[torch.from_numpy(ids)])
        head.norm.weight.copy_(hf.model.norm.weight)
    return head


def draft_ids(counts, size: int, eos_ids: Sequence[int]) -> np.ndarray:
    """[size] int64, sorted: the `size` most frequent response tokens by `counts` ([vocab]
    int64, `response_counts`), every id of `eos_ids` always among them (the session's EOS ids,
    exporter.sources.eos_ids: Qwen2.5 stops on two; draft_vocab.best_ranked, as eagle-export
    ranks token_counts.npy). Raises ValueError outside [1, vocab]."""
    vocab = len(counts)
    if not 1 <= size <= vocab:
        raise ValueError(f"--draft-vocab {size} must be in [1, {vocab}]")
    return best_ranked(-counts, size, list(eos_ids))


def check_init_from_layer(settings: TrainSettings, hf) -> None:
    """--init-from-layer L with --head-layers N needs target layers L..L+N-1: ValueError
    otherwise (before any stage runs)."""
    layer, n, total = settings.init_from_layer, settings.head_layers, hf.config.num_hidden_layers
    if layer is not None and not 0 <= layer <= total - n:
        need = f"target layers {layer}..{layer + n - 1}" if n > 1 else f"target layer {layer}"
        raise ValueError(f"--init-from-layer {layer} needs {need}, but the target has layers 0..{total - 1}")


def init_from_layer(head, hf, layer: int) -> None:
    """Copy target layer `layer + i`'s attention, MLP and norms into the head's layer i, for
    each of the head's layers (layer 0 has no input norm: the target layer's is not copied).
    IndexError past the target's last layer (check_init_from_layer says so up front)."""
    with torch.no_grad():
        for i, dst in enumerate(head.layers):
            src = hf.model.layers[layer + i]
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(dst.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(dst.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
            dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
            if i > 0:
                dst.input_layernorm.weight.copy_(src.input_layernorm.weight)
