"""A checkpoint's weights read one tensor at a time, and the transformers model they belong to
built without them, so that an export's memory does not grow with the model (a 7B fp32 model
is 27.5 GB; the exporter holds one weight tensor at a time, plus the embedding the draft head
reuses).

    CheckpointWeights   a transformers folder's weight files -> one tensor by name, in a dtype
                        (safetensors, single or sharded, read through `safetensors.safe_open`;
                        PyTorch `.bin` files memory-mapped by `torch.load(mmap=True)`)
    skeleton_target     config + weights -> the transformers model on the meta device except
                        its rotary embedding and the token embedding / LM head (real: the draft
                        head reuses them), checked against the checkpoint's tensor names and shapes

Raises UnsupportedModelError (exporter/target.py) with one line for a missing, truncated or
mismatched checkpoint, before anything is written.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eagle_deploy.contract.errors import first_line

from .streamed import param_slots
from .target import UnsupportedModelError, check_family, supported_families

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def _unloadable(hf_dir: Path, err: BaseException) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"cannot load the checkpoint in {hf_dir} ({type(err).__name__}: {first_line(err)}); expected a complete "
        f"Hugging Face checkpoint (config.json + weights) of a supported family: {supported_families()}")


class CheckpointWeights:
    """The weight tensors of a transformers folder, read one at a time.

    `shapes` maps every tensor name to its shape (read from the file headers only). `get(name,
    dtype)` returns a new CPU tensor in `dtype` (cast with torch's `.to`, as
    `model.to(dtype)` would). Raises UnsupportedModelError when the folder has no weight file
    or a file cannot be read, KeyError for an unknown name."""

    def __init__(self, hf_dir: Path):
        self.hf_dir = Path(hf_dir)
        self._file: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._bin: dict[Path, dict] = {}
        try:
            files = self._weight_files()
            for path in files:
                if path.suffix == ".safetensors":
                    self._index_safetensors(path)
                else:
                    self._index_bin(path)
        except UnsupportedModelError:
            raise
        except Exception as err:  # a truncated or corrupt file
            raise _unloadable(self.hf_dir, err) from None

    def _weight_files(self) -> list[Path]:
        for index in (SAFETENSORS_INDEX, BIN_INDEX):
            if (self.hf_dir / index).exists():
                weight_map = json.loads((self.hf_dir / index).read_text())["weight_map"]
                return sorted({self.hf_dir / f for f in weight_map.values()})
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (self.hf_dir / name).exists():
                return [self.hf_dir / name]
        raise _unloadable(self.hf_dir, FileNotFoundError("no model.safetensors or pytorch_model.bin"))

    def _index_safetensors(self, path: Path) -> None:
        from safetensors import safe_open

        size = path.stat().st_size
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                self._file[name] = path
                self.shapes[name] = tuple(piece.get_shape())
        # safe_open maps the file; a file cut short in its data fails only when a tensor is read
        end = _safetensors_data_end(path)
        if end > size:
            raise ValueError(f"{path.name} is truncated ({size} bytes, its header describes {end})")

    def _index_bin(self, path: Path) -> None:
        state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
        self._bin[path] = state
        for name, t in state.items():
            self._file[name] = path
            self.shapes[name] = tuple(t.shape)

    def names(self) -> set[str]:
        return set(self._file)

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        path = self._file[name]
        try:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as f:
                    t = f.get_tensor(name)
            else:
                t = self._bin[path][name]
            return t.to(dtype=dtype, copy=True).contiguous()
        except Exception as err:
            raise _unloadable(self.hf_dir, err) from None


def _safetensors_data_end(path: Path) -> int:
    """The file size a safetensors file's header implies (8 + header + the last data offset)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return 8 + n + max(ends, default=0)


def checkpoint_key(model: nn.Module, weights: CheckpointWeights) -> dict[int, str]:
    """id(parameter) -> the checkpoint tensor holding it (a tied weight is stored under one of
    its names). Raises UnsupportedModelError naming the first missing tensor or wrong shape."""
    names = weights.names()
    keys = {}
    for pid, slots in param_slots(model).items():
        found = next((q for _, _, q in slots if q in names), None)
        if found is None:
            raise _unloadable(weights.hf_dir, KeyError(f"{slots[0][2]} is not in the checkpoint"))
        shape = tuple(getattr(slots[0][0], slots[0][1]).shape)
        if weights.shapes[found] != shape:
            raise _unloadable(weights.hf_dir, ValueError(f"{found} has shape {list(weights.shapes[found])}, "
                                                         f"the config implies {list(shape)}"))
        keys[pid] = found
    return keys


@dataclass
class WeightSource:
    """Where each parameter of a skeleton model is stored: `keys` maps id(parameter) to its
    checkpoint tensor (shared by every module that reuses the parameter object)."""

    weights: CheckpointWeights
    keys: dict[int, str]

    def key(self, param: torch.Tensor) -> str:
        return self.keys[id(param)]

    def read(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The checkpoint's value of `param` in `dtype` (a new tensor)."""
        return self.weights.get(self.key(param), dtype)


def skeleton_target(hf_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, WeightSource]:
    """(model, source): the transformers model of `hf_dir` (a supported family) with its
    parameters on the meta device, except the rotary embedding (computed on the CPU) and the
    token embedding and LM head (read from the checkpoint in `dtype`; the draft head reuses
    them). Every parameter is checked against the checkpoint (name and shape). Raises
    UnsupportedModelError."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir = Path(hf_dir)
    try:
        config = AutoConfig.from_pretrained(str(hf_dir), trust_remote_code=False)
    except Exception as err:
        raise _unloadable(hf_dir, err) from None
    check_family(config)
    weights = CheckpointWeights(hf_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its inv_freq, computed for real
    keys = checkpoint_key(model, weights)
    slots = param_slots(model)
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        pid = id(module.weight)
        if module.weight.is_meta:
            real = nn.Parameter(weights.get(keys[pid], dtype), requires_grad=False)
            for mod, attr, _ in slots[pid]:
                mod._parameters[attr] = real
            keys[id(real)] = keys.pop(pid)
    return model.eval(), WeightSource(weights, keys)


class SafetensorsShards:
    """A transformers checkpoint written one tensor at a time: tensors go into
    `model-NNNNN.safetensors` shards of about `shard_bytes` each (one shard in memory at a
    time), and `close()` writes `model.safetensors.index.json` (its weight_map and total size),
    or, when everything fit in one shard, renames it `model.safetensors`.
    Use as a context manager; a failure leaves the shards written so far (the caller's
    temporary folder)."""

    def __init__(self, folder: Path, shard_bytes: int = 2 * 2**30):
        self.folder, self.shard_bytes = Path(folder), shard_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self._shard: dict[str, torch.Tensor] = {}
        self._size = self.total = self._count = 0
        self.weight_map: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._shard and self._size + nbytes > self.shard_bytes:
            self._flush()
        self._shard[name] = tensor.contiguous()
        self._size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._shard:
            return
        self._count += 1
        file = f"model-{self._count:05d}.safetensors"
        save_file(self._shard, str(self.folder / file), metadata={"format": "pt"})
        self.weight_map.update({k: file for k in self._shard})
        self._shard, self._size = {}, 0

    def close(self) -> None:
        self._flush()
        if self._count == 1:  # one shard: the single-file layout (model.safetensors, no index)
            (self.folder / "model-00001.safetensors").rename(self.folder / "model.safetensors")
            return
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=1))

    def __enter__(self):
        return self

    def __exit__(self, kind, *exc):
        if kind is None:
            self.close()


def gguf_to_safetensors(gguf: Path, folder: Path, shard_bytes: int = 2 * 2**30):
    """Dequantise a GGUF checkpoint into `folder` as an fp32 transformers checkpoint (config,
    generation config, safetensors shards), one tensor at a time: the GGUF file is memory-mapped
    by gguf-py's reader, each tensor dequantised, permuted and renamed by transformers' own GGUF
    tables (`modeling_gguf_pytorch_utils`), written, and dropped. The same tensors as loading
    the GGUF with transformers (`from_pretrained(gguf_file=...)`, fp32) and saving the model,
    without the model in memory. Returns the transformers config. Raises
    UnsupportedModelError for an architecture outside `FAMILIES`, what the readers raise for a
    corrupt file."""
    import numpy as np
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    gguf = Path(gguf)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    check_family(config)
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)  # metadata only
    reader = GGUFReader(str(gguf))
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    mapping = get_gguf_hf_weights_map(meta, processor)
    with SafetensorsShards(folder, shard_bytes) as out:
        for tensor in reader.tensors:
            result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                       tensor_key_mapping=mapping, parsed_parameters=parsed)
            if result.name not in mapping:  # e.g. llama.cpp's rope_freqs: transformers recomputes it
                continue
            out.add(mapping[result.name], torch.from_numpy(np.array(result.weights, dtype=np.float32)))
    config.architectures = config.architectures or [type(meta).__name__]
    config.dtype = "float32"
    config.save_pretrained(str(folder))
    GenerationConfig.from_model_config(config).save_pretrained(str(folder))
    return config
