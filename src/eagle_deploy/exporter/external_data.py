"""ONNX external data, decided, written and read in one place: when a graph's weights go to a
`<file>.data` beside it (`use_external_data`), every tensor a graph holds (`graph_tensors`:
which external files a graph needs, trt_build), and writing a graph whose weights never all
sit in memory at once:

    TensorFile      an append-only `<graph>.data`: one tensor's bytes in, its TensorProto out
    tensor_bytes    the raw bytes of one initializer, inline or external (read on its own)
    save_graph      a ModelProto whose initializers are inline, in its own data file or in a
                    shared file -> `<graph>` (+ `<graph>.data`), copying one tensor at a time,
                    inline when the weights fit under protobuf's limit and the mode allows

The exporter builds, quantises and shares graphs through these, so an export's memory is one
tensor plus the graph's nodes, whatever the model's size (issue: 7B on a 24 GB machine).
Imports onnx only inside functions."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator

TWO_GIB = 2 * 1024**3  # protobuf's limit on one serialized message (an .onnx file without external data)
HEADROOM = 64 << 20  # bytes left under the limit for the graph itself (nodes, names, shapes)
MODES = ("auto", "always", "never")
INLINE_BELOW = 1024  # bytes: smaller tensors stay in the graph file (onnx.save_model's size_threshold)
ALIGNMENT = 4096  # external tensors start at multiples of this (page-aligned for memory mapping)


def use_external_data(mode: str, weight_bytes: int, what: str = "the graph") -> bool:
    """Whether a graph with `weight_bytes` bytes of weights is saved with external data:
    mode "always": yes; "auto": when the weights exceed 2 GiB - 64 MiB; "never": no. Raises
    ValueError on an unknown mode, and for "never" when the weights cannot fit inline
    (`what` names the graph in that message)."""
    if mode not in MODES:
        raise ValueError(f"external data mode {mode!r} is not one of {', '.join(MODES)}")
    too_big = weight_bytes > TWO_GIB - HEADROOM
    if mode == "never" and too_big:
        raise ValueError(f"{what}: {weight_bytes / 2**30:.1f} GiB of weights need external data (protobuf limit 2 GiB)")
    return mode == "always" or (mode == "auto" and too_big)


def graph_tensors(model) -> Iterator:
    """Every TensorProto of an onnx ModelProto: initializers, sparse initializers (values and
    indices) and constant tensors in node attributes, in subgraphs too (If / Loop / Scan
    bodies). Public protobuf fields only."""
    import onnx

    def of_graph(graph) -> Iterator:
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.TENSORS:
                    yield from attr.tensors
                elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
                    yield attr.sparse_tensor.values
                    yield attr.sparse_tensor.indices
                elif attr.type == onnx.AttributeProto.GRAPH:
                    yield from of_graph(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for sub in attr.graphs:
                        yield from of_graph(sub)

    yield from of_graph(model.graph)


def data_file_of(path: Path) -> str:
    """The name of a graph's own external-data file: `<graph file>.data`."""
    return Path(path).name + ".data"


class TensorFile:
    """An external-data file written front to back: `tensor(name, data, data_type, dims)`
    returns the TensorProto (inline below INLINE_BELOW bytes, else pointing at `data`'s bytes
    in this file, ALIGNMENT-aligned). `location` is the name graphs reference."""

    def __init__(self, path: Path, location: str | None = None):
        self.path = Path(path)
        self.location = location or self.path.name
        self._f = open(self.path, "wb")
        self.size = 0

    def tensor(self, name: str, data: bytes | memoryview, data_type: int, dims) -> object:
        import onnx

        t = onnx.TensorProto(name=name, data_type=data_type, dims=list(dims))
        if len(data) < INLINE_BELOW:
            t.raw_data = bytes(data)
            return t
        pad = -self.size % ALIGNMENT
        self._f.write(b"\0" * pad)
        offset = self.size + pad
        self._f.write(data)
        self.size = offset + len(data)
        set_external(t, self.location, offset, len(data))
        return t

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _clear_data(tensor) -> None:
    """Drop every data field and external reference of `tensor` (shape and dtype stay)."""
    for name in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data",
                 "data_location"):
        tensor.ClearField(name)
    del tensor.external_data[:]


def set_external(tensor, location: str, offset: int, length: int) -> None:
    """Point `tensor` at bytes [offset, offset + length) of `location` (its data cleared)."""
    import onnx

    _clear_data(tensor)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def set_inline(tensor, data: bytes) -> None:
    """Hold `data` as `tensor`'s raw_data (any other data field and external reference cleared)."""
    _clear_data(tensor)
    tensor.raw_data = bytes(data)


def external_info(tensor) -> dict | None:
    """{"location", "offset", "length"} of an external tensor, None for an inline one."""
    import onnx

    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in tensor.external_data}
    return {"location": info["location"], "offset": int(info.get("offset", 0)),
            "length": int(info["length"]) if "length" in info else None}


def tensor_bytes(tensor, folder: Path) -> bytes:
    """The raw bytes of one initializer: inline, or read from its external file in `folder`
    (only its own bytes are read)."""
    info = external_info(tensor)
    if info is None:
        if tensor.HasField("raw_data"):
            return tensor.raw_data
        from onnx import numpy_helper

        return numpy_helper.to_array(tensor).tobytes()
    path = Path(folder) / info["location"]
    with open(path, "rb") as f:
        f.seek(info["offset"])
        if info["length"] is None:
            return f.read()
        data = f.read(info["length"])
    if len(data) != info["length"]:
        raise ValueError(f"{path.name} is truncated: tensor {tensor.name} needs bytes "
                         f"[{info['offset']}, {info['offset'] + info['length']})")
    return data


def array_of(tensor, folder: Path | None = None):
    """One initializer as a numpy array, its external data read on its own from `folder`
    without being attached to `tensor` (onnx's `numpy_helper.to_array(t, base_dir)` keeps the
    bytes in the proto, so reading every weight that way ends with the whole model in memory)."""
    import numpy as np
    from onnx import helper, numpy_helper

    if external_info(tensor) is None:
        return numpy_helper.to_array(tensor)
    if folder is None:
        raise ValueError(f"tensor {tensor.name} has external data: its folder is needed")
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return np.frombuffer(tensor_bytes(tensor, folder), dtype=dtype).reshape(tuple(tensor.dims))


def load_model(path: Path):
    """`onnx.load(path)` with every external tensor read by `tensor_bytes` from the graph's
    folder and held inline: onnx.load itself refuses data files that are symbolic or hard
    links (an export linked or `cp -al`-copied elsewhere), which onnxruntime opens fine.
    Raises ValueError for a truncated data file, OSError for a missing one."""
    import onnx

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    for tensor in graph_tensors(model):
        if external_info(tensor) is not None:
            set_inline(tensor, tensor_bytes(tensor, path.parent))
    return model


def stored_bytes(tensors) -> int:
    """Bytes of data the initializers `tensors` hold, inline or external (external ones not read)."""
    total = 0
    for t in tensors:
        info = external_info(t)
        total += (info["length"] or 0) if info else (len(t.raw_data) or t.ByteSize())
    return total


def _replace_graph(model, path: Path) -> None:
    """Write the graph file `path` (its external data already in place) through a temporary
    file in its folder, renamed over it."""
    import onnx

    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        graph_tmp = Path(scratch) / path.name
        onnx.save_model(model, str(graph_tmp))
        os.replace(graph_tmp, path)


def save_graph(model, path: Path, folder: Path, external_data: str = "auto", keep: tuple[str, ...] = ()) -> None:
    """Write `model` to `path` with its weights: initializers inline or in a data file inside
    `folder` (its own old `<graph>.data` included, which may be `path`'s) are copied, one at a
    time, into a new `<graph>.data`, or all inline when `use_external_data(external_data, ...)`
    says so; initializers stored in one of the `keep` files (shared.data) stay where they are.
    The graph and its data file are replaced by rename at the end, so a failure leaves the old
    ones, except when the graph stays external in its own folder and only lost tensors from
    its data file (sharing): that file is then compacted in place (`_compact_in_place`), so a
    7B graph is never on disk twice. Raises ValueError (use_external_data) for "never" with
    weights over the limit."""
    import onnx

    path, folder = Path(path), Path(folder)
    own = data_file_of(path)
    movable = [t for t in model.graph.initializer if (external_info(t) or {}).get("location") not in keep]
    external = use_external_data(external_data, stored_bytes(movable), path.name)
    if external and folder.resolve() == path.parent.resolve() and _compactable(movable, own):
        _compact_in_place(model, movable, path, own)
        return
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        graph_tmp, data_tmp = Path(scratch) / path.name, Path(scratch) / own
        wrote = False
        with TensorFile(data_tmp, location=own) as out:
            for t in movable:
                if external_info(t) is None and (not external or t.ByteSize() < INLINE_BELOW):
                    continue
                data = tensor_bytes(t, folder)
                if external:
                    new = out.tensor(t.name, data, t.data_type, t.dims)
                    if external_info(new) is None:
                        set_inline(t, data)
                    else:
                        set_external(t, own, *(external_info(new)[k] for k in ("offset", "length")))
                        wrote = True
                else:
                    set_inline(t, data)
        onnx.save_model(model, str(graph_tmp))
        if wrote:
            os.replace(data_tmp, path.parent / own)
        else:
            (path.parent / own).unlink(missing_ok=True)
        os.replace(graph_tmp, path)


def _compactable(tensors: list, own: str) -> bool:
    """Whether every tensor is external in `own` or small and inline (a graph whose weights were
    only removed from its data file, as sharing does)."""
    infos = [external_info(t) for t in tensors]
    return (any(i is not None for i in infos)
            and all((i is not None and i["location"] == own and i["length"] is not None) or
                    (i is None and t.ByteSize() < INLINE_BELOW) for t, i in zip(tensors, infos)))


COPY_CHUNK = 64 << 20


def _compact_in_place(model, tensors: list, path: Path, own: str) -> None:
    """Close the gaps that removed tensors left in `path`'s own data file, moving each remaining
    tensor towards the start (in offset order, so no bytes are overwritten before they are
    read), then truncate it: no second copy of a large file on disk. A failure midway leaves a
    damaged data file, which is why only the exporter's private folder is compacted like this."""
    data = path.parent / own
    order = sorted((t for t in tensors if external_info(t) is not None), key=lambda t: external_info(t)["offset"])
    end = 0
    with open(data, "r+b") as f:
        for t in order:
            info = external_info(t)
            new = end + (-end % ALIGNMENT)
            if new > info["offset"]:  # a file not written by TensorFile: keep its own spacing
                new = end
            if new != info["offset"]:
                for start in range(0, info["length"], COPY_CHUNK):
                    f.seek(info["offset"] + start)
                    chunk = f.read(min(COPY_CHUNK, info["length"] - start))
                    f.seek(new + start)
                    f.write(chunk)
                set_external(t, own, new, info["length"])
            end = new + info["length"]
        f.truncate(end)
    _replace_graph(model, path)


def place_graph(model, path: Path, written_in: Path, external_data: str = "auto") -> None:
    """Put `model` at `path` when its external tensors were written to `written_in /
    data_file_of(path)` (a scratch folder on the same file system, or path's own folder): that
    file is moved beside the graph, or, when `use_external_data` says the weights stay inline,
    read back into the graph (small graphs only, by that rule)."""
    path, written_in = Path(path), Path(written_in)
    own = data_file_of(path)
    if not use_external_data(external_data, stored_bytes(model.graph.initializer), path.name):
        save_graph(model, path, written_in, external_data)
        return
    if written_in.resolve() != path.parent.resolve():
        os.replace(written_in / own, path.parent / own)
    _replace_graph(model, path)
