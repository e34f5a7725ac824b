"""Is an export folder made of the files its manifest describes? `verify_export` answers
before anything is served from it (EagleRuntime.load, BatchRuntime.load, eagle-run,
eagle-serve, the Triton model, eagle-validate), at one of three levels (`VERIFY_LEVELS`):

- "fast" (the default): every graph's own inputs and outputs (names, dtypes, shapes, read
  from the .onnx file without its weights, `graph_io`; the prefill graph's too when the export
  has one) against the manifest, which
  Manifest.load already checked against the ONNX I/O contract; every recorded file present
  with its recorded size, and no unrecorded file in the tokenizer folder; the sha256 of every
  file up to `SMALL_FILE` bytes (tokenizer, draft vocabulary, small graphs) and, for larger
  ones, the sha256 of `SAMPLE_BLOCKS` blocks spread over the file (`sampled_digest`, 256 KiB
  read). Costs milliseconds: measured in docs/exports.md.
- "full": also the sha256 of every file, with a progress bar (tqdm, on a terminal) when
  there is more than `BAR_BYTES` to read.
- "off": nothing (tests that edit a graph on purpose; `rerecord_files` records an edited
  folder instead).

What is compared is the manifest's `files` record (`FileRecord`: size, sha256, sampled
sha256 of every file, written by eagle-export). A large file recorded without a sampled sha256
is hashed whole at "fast" too.

Every mismatch is one ManifestError line naming the file and what to do (re-export), e.g.

    /x/target.onnx is 86,723,562 bytes but /x/manifest.json records 540,567,091: ...; re-export
"""
from __future__ import annotations

import hashlib
import io
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from .manifest import FileRecord, Manifest, ManifestError, check_graph_io, unreadable
from .onnx_io import MANIFEST_FILE, TensorSpec

VERIFY_LEVELS = ("fast", "full", "off")
# files up to this size are hashed whole at level "fast" (what that costs: docs/decisions.md, 'Export
# verification, measured')
SMALL_FILE = 16 << 20
SAMPLE_BLOCKS, SAMPLE_BLOCK = 64, 4096  # sampled_digest: 64 blocks of 4 KiB, evenly spread
BAR_BYTES = 256 << 20  # level "full" shows a progress bar above this many bytes
_CHUNK = 1 << 22
DIFFERENT = ("the folder's files are not the ones its manifest describes (a manifest or file from another export, "
             "or a damaged copy)")


@dataclass(frozen=True)
class VerifyReport:
    """What verify_export checked: level, files compared (`files`), bytes hashed."""

    level: str
    files: int = 0
    hashed_bytes: int = 0


def sha256_file(path: Path, bar=None) -> str:
    """Hex sha256 of a file; `bar` (a tqdm bar or None) is advanced by the bytes read."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            if bar is not None:
                bar.update(len(block))
    return h.hexdigest()


def sampled_digest(path: Path) -> str:
    """Hex sha256 of a file's size and of SAMPLE_BLOCKS blocks of SAMPLE_BLOCK bytes at evenly
    spaced offsets (first and last block included): 256 KiB read whatever the file's size.
    Catches a file replaced or overwritten in part (any overwritten stretch longer than
    size / SAMPLE_BLOCKS), not a few flipped bytes: that takes level "full"."""
    size = os.path.getsize(path)
    h = hashlib.sha256(struct.pack("<Q", size))
    step = max(size - SAMPLE_BLOCK, 0) / (SAMPLE_BLOCKS - 1)
    with open(path, "rb") as f:
        for i in range(SAMPLE_BLOCKS):
            f.seek(int(i * step))
            h.update(f.read(SAMPLE_BLOCK))
    return h.hexdigest()


def file_records(folder: Path) -> dict[str, FileRecord]:
    """{path inside `folder` ('/'-separated): FileRecord} for every file under it but the
    manifest, sorted: what eagle-export writes into the manifest's `files`."""
    folder = Path(folder)
    records = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel.startswith(MANIFEST_FILE):  # the manifest and its temporary copy
            continue
        size = path.stat().st_size
        records[rel] = FileRecord(size=size, sha256=sha256_file(path),
                                  sampled_sha256=sampled_digest(path) if size > SMALL_FILE else None)
    return records


def rerecord_files(folder: Path) -> Manifest:
    """Re-write the manifest's `files` record from what `folder` holds now, and return the
    manifest: for a tool (or test) that changes an export's files on purpose. Raises
    ManifestError as Manifest.load."""
    manifest = Manifest.load(folder).replace(files=file_records(folder))
    manifest.save(folder)
    return manifest


# ---------------------------------------------------------------------------------------------
# Graph inputs and outputs, read from the .onnx protobuf without its weights

ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
               11: "float64", 16: "bfloat16"}  # onnx TensorProto.DataType -> contract dtype names


class _Damaged(Exception):
    pass


def _varint(f) -> int:
    shift = value = 0
    while True:
        b = f.read(1)
        if not b or shift > 63:
            raise _Damaged("cut inside a field")
        value |= (b[0] & 0x7F) << shift
        if b[0] < 0x80:
            return value
        shift += 7


def _fields(f, start: int, end: int):
    """(field number, value) of the protobuf message in f[start:end]: an int for varints,
    (offset, length) for length-delimited fields (seeked over, never read: initializers cost
    nothing), fixed-width fields skipped."""
    pos = start
    while pos < end:
        f.seek(pos)
        key = _varint(f)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value = _varint(f)
        elif wire == 2:
            length = _varint(f)
            value = (f.tell(), length)
            if value[0] + length > end:
                raise _Damaged(f"field {number} runs past the end")
        elif wire in (1, 5):
            value = None
            f.seek(8 if wire == 1 else 4, 1)
        else:
            raise _Damaged(f"wire type {wire} of field {number}")
        pos = f.tell() + (value[1] if wire == 2 else 0)
        yield number, value


def _text(f, span) -> str:
    f.seek(span[0])
    return f.read(span[1]).decode("utf-8", errors="replace")


def _tensor_type(f, span) -> tuple[str, tuple]:
    """TypeProto (span) -> (dtype, shape): tensor_type = 1 {elem_type = 1, shape = 2 {dim = 1
    {dim_value = 1 | dim_param = 2}}}; a dimension with neither is "?" (as session_io)."""
    dtype, shape = "?", []
    for number, tensor in _fields(f, span[0], sum(span)):
        if number != 1:
            continue
        for key, value in _fields(f, tensor[0], sum(tensor)):
            if key == 1:
                dtype = ONNX_DTYPES.get(value, f"onnx type {value}")
            elif key == 2:
                for d, dim in _fields(f, value[0], sum(value)):
                    if d == 1:
                        found = dict(_fields(f, dim[0], sum(dim)))
                        shape.append(found[1] if 1 in found else _text(f, found[2]) if 2 in found else "?")
    return dtype, tuple(shape)


def _value_info(data: bytes) -> TensorSpec:
    f = io.BytesIO(data)
    name, dtype, shape = "", "?", ()
    for number, value in _fields(f, 0, len(data)):
        if number == 1:
            name = _text(f, value)
        elif number == 2:
            dtype, shape = _tensor_type(f, value)
    return TensorSpec(name, dtype, shape)


def graph_io(path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) an .onnx file declares (ModelProto.graph = 7: input = 11, output =
    12), in graph order, read by seeking over everything else (nodes, weights): milliseconds
    for a file of any size. Raises ManifestError for a missing, truncated or non-ONNX file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            graph = next((v for n, v in _fields(f, 0, size) if n == 7 and isinstance(v, tuple)), None)
            if graph is None:
                raise _Damaged("no graph")
            inputs, outputs = [], []
            for number, value in _fields(f, graph[0], sum(graph)):
                if number in (11, 12):
                    f.seek(value[0])
                    (inputs if number == 11 else outputs).append(_value_info(f.read(value[1])))
    except OSError as err:
        problem = unreadable(path)
        if problem is not None or isinstance(err, FileNotFoundError):
            raise ManifestError(f"{path} {problem or 'is missing'} (the manifest names it); copy the whole export "
                                "folder or re-export") from None
        raise ManifestError(f"{path} is not a readable ONNX graph ({err or type(err).__name__}: truncated or "
                            "damaged); re-export") from None
    except (_Damaged, KeyError, UnicodeDecodeError) as err:
        raise ManifestError(f"{path} is not a readable ONNX graph ({err or type(err).__name__}: truncated or "
                            "damaged); re-export") from None
    return inputs, outputs


# ---------------------------------------------------------------------------------------------
# The check


def _mismatch(path: Path, source: Path, what: str) -> ManifestError:
    return ManifestError(f"{path} does not match {source} ({what}): {DIFFERENT}; re-export")


def _bar(total: int, progress: bool | None):
    if total <= BAR_BYTES or progress is False:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="verifying sha256", file=sys.stderr,
                disable=None if progress is None else False, leave=False)


def verify_export(folder: Path, manifest: Manifest, level: str = "fast", progress: bool | None = None) -> VerifyReport:
    """Check that `folder` holds the files `manifest` (its Manifest.load) describes, at
    `level` ("fast" | "full" | "off", see the module docstring), before any graph is opened.
    progress: the "full" progress bar (None: on a terminal only; False: never).

    Raises ManifestError (one line naming the file, ending in what to do) for a graph whose
    inputs/outputs differ from the manifest's, a missing, unreadable, truncated or resized
    file, or content that differs from its recorded sha256 or sampled digest; ValueError for
    an unknown level."""
    if level not in VERIFY_LEVELS:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_LEVELS)}, got {level!r}")
    if level == "off":
        return VerifyReport("off")
    folder = Path(folder)
    source = folder / MANIFEST_FILE
    for which in manifest.graph_names:  # the most specific message first: the graph and the manifest disagree
        entry = getattr(manifest, which)
        check_graph_io(entry, which, *graph_io(folder / entry.path), dims=manifest.graph_dims(which),
                       source=str(source))
    if manifest.shared_weights is not None:
        manifest.shared_weights.check(folder, "target")  # missing or short: names the tensors it holds
    expected, sizes = manifest.files, {}
    _no_unlisted_tokenizer_files(folder, manifest, source)
    for rel, record in expected.items():
        path = folder / rel
        problem = unreadable(path)
        if problem is not None:
            raise ManifestError(f"{path} {problem} ({source} lists it); copy the whole export folder or "
                                "re-export")
        sizes[rel] = path.stat().st_size
        if sizes[rel] != record.size:
            raise ManifestError(f"{path} is {sizes[rel]:,} bytes but {source} records {record.size:,}: {DIFFERENT}; "
                                "re-export")
    return _compare_content(folder, source, expected, sizes, level, progress)


def _no_unlisted_tokenizer_files(folder: Path, manifest: Manifest, source: Path) -> None:
    """The tokenizer folder holds only recorded files: transformers reads whatever is there
    (a chat_template.jinja added later changes every chat prompt)."""
    if not manifest.tokenizer or not (folder / manifest.tokenizer).is_dir():
        return
    for path in sorted((folder / manifest.tokenizer).rglob("*")):
        if path.is_file() and path.relative_to(folder).as_posix() not in manifest.files:
            raise ManifestError(f"{path} is not one of the export's files ({source} does not list it): {DIFFERENT}; "
                                "remove it or re-export")


def _compare_content(folder: Path, source: Path, expected: dict[str, FileRecord], sizes: dict, level: str,
                     progress: bool | None) -> VerifyReport:
    """The content half of verify_export: sha256 (whole files) or sampled digests."""
    whole = [rel for rel, r in expected.items() if level == "full" or sizes[rel] <= SMALL_FILE or not r.sampled_sha256]
    sampled = [rel for rel in expected if rel not in whole]
    hashed = sum(sizes[rel] for rel in whole)
    bar = _bar(hashed, progress)
    try:
        for rel in whole:
            want = expected[rel].sha256
            try:
                found = sha256_file(folder / rel, bar)
            except OSError as err:
                raise ManifestError(f"{folder / rel} cannot be read ({err.strerror or err}); re-export") from None
            if found != want:
                raise _mismatch(folder / rel, source, f"sha256 {found[:12]}..., recorded {want[:12]}...")
    finally:
        if bar is not None:
            bar.close()
    for rel in sampled:
        if sampled_digest(folder / rel) != expected[rel].sampled_sha256:
            raise _mismatch(folder / rel, source, f"{SAMPLE_BLOCKS} sampled blocks differ from the recorded ones")
    return VerifyReport(level, len(expected), hashed + len(sampled) * SAMPLE_BLOCKS * SAMPLE_BLOCK)
