"""Export at scale: write a random-weight checkpoint of a named shape, export it with
`eagle-export` in a child process, and report wall time, peak resident memory (anonymous and
file-backed separately, the whole process tree, sampled) and output size per stage.

    python -m eagle_deploy.bench.scale --shape llama2-7b --work /big/disk [--dtype fp16 | --quant int4]

Shapes (`SHAPES`) follow the published configs: llama2-7b (hidden 4096, 32 layers, MLP 11008,
32 heads, vocabulary 32,000: 6.7B parameters, 13.5 GB in fp16), llama3-8b (grouped-query
attention with 8 KV heads, MLP 14336, vocabulary 128,256), llama2-13b (hidden 5120, 40 layers,
MLP 13824: 26 GB in fp16) and `tiny` (the tests'). The draft head is `--draft random` (the
same layer shapes as a published EAGLE head). A benchmark, not a test: it needs the disk for
the checkpoint and the export (about 2x the fp16 weights) and minutes per 7B. Stages are the
export's own progress lines; a sample belongs to the stage running when it was taken.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

GIB = 2**30
SHARD_BYTES = 2 * GIB  # safetensors shards of the written checkpoint, as transformers writes them (about)

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=256),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "llama2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                       num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096),
}


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint tensors of a Llama config (transformers' names), in file order."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def write_checkpoint(shape: str, folder: Path, seed: int = 0) -> int:
    """A random fp16 Llama checkpoint of `shape` (weights normal(0, 0.02), norms 1) in
    safetensors shards of about SHARD_BYTES with their index, one shard in memory at a time;
    returns the bytes of weights written."""
    import torch

    from eagle_deploy.exporter.weights import SafetensorsShards

    cfg = {**SHAPES[shape], "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
           "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
           "torch_dtype": "float16"}
    gen = torch.Generator().manual_seed(seed)
    with SafetensorsShards(folder, SHARD_BYTES) as out:
        for name, dims in tensor_shapes(cfg):
            if name.endswith("norm.weight"):
                out.add(name, torch.ones(dims, dtype=torch.float16))
            else:
                out.add(name, (torch.randn(dims, generator=gen) * 0.02).to(torch.float16))
    total = out.total
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return total


@dataclass
class Stage:
    name: str
    start: float
    end: float = 0.0
    anon_mb: float = 0.0
    file_mb: float = 0.0
    samples: int = 0


@dataclass
class Sampler:
    """Samples the (anonymous, file-backed) RSS of a process tree every `interval` seconds into
    the current stage."""

    pid: int
    interval: float = 0.2
    stages: list[Stage] = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, first: str) -> None:
        self.stages.append(Stage(first, time.perf_counter()))
        self._thread.start()

    def stage(self, name: str) -> None:
        now = time.perf_counter()
        self.stages[-1].end = now
        self.stages.append(Stage(name, now))

    def _run(self) -> None:
        from eagle_deploy.runtime.memory import tree_rss_mb

        while not self._stop.is_set():
            anon, file = tree_rss_mb(self.pid)
            st = self.stages[-1]
            st.anon_mb, st.file_mb, st.samples = max(st.anon_mb, anon), max(st.file_mb, file), st.samples + 1
            self._stop.wait(self.interval)

    def stop(self) -> list[Stage]:
        self._stop.set()
        self._thread.join()
        self.stages[-1].end = time.perf_counter()
        return self.stages


def run_export(checkpoint: Path, out: Path, extra: list[str], interval: float = 0.2) -> tuple[list[Stage], Path]:
    """`eagle-export --model checkpoint --draft random --out out *extra` in a child process,
    sampled; returns its stages (named by its progress lines) and the export folder. Raises
    RuntimeError with the child's last lines if it fails."""
    cmd = [sys.executable, "-m", "eagle_deploy.exporter.cli", "--model", str(checkpoint), "--draft", "random",
           "--out", str(out), "--force", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid, interval)
    sampler.start("start-up")
    tail: list[str] = []
    for line in proc.stderr:
        line = line.rstrip()
        tail = (tail + [line])[-20:]
        if line.startswith("[") and "s] " in line:  # "[  12.3s] exporting target graph (...)"
            sampler.stage(line.split("s] ", 1)[1])
    stdout = proc.stdout.read()
    rc = proc.wait()
    stages = sampler.stop()
    if rc != 0:
        raise RuntimeError(f"eagle-export failed (exit {rc}): " + " | ".join(tail[-5:]))
    return stages, Path(stdout.strip().splitlines()[-1])


def run_tool(cmd: list[str], interval: float = 0.2) -> dict:
    """One tool on the export, sampled like the export: {"command", "rc", "wall_s",
    "peak_anon_gib", "first_line"} (its first line of stderr or stdout)."""
    proc = subprocess.Popen([sys.executable, "-m", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid, interval)
    sampler.start(cmd[0])
    out, err = proc.communicate()
    st = sampler.stop()[0]
    lines = [ln for ln in (err + out).splitlines() if ln.strip() and "Loading weights" not in ln]
    return {"command": " ".join(cmd), "rc": proc.returncode, "wall_s": round(st.end - st.start, 1),
            "peak_anon_gib": round(st.anon_mb / 1024, 2), "first_line": lines[0][:300] if lines else ""}


def check_tools(export: Path, work: Path) -> list[dict]:
    """eagle-triton-repo and eagle-validate on the export (issue 27 part 4): the repository is
    written (it references the export), validation runs or says how much memory it needs."""
    repo = work / "triton-repo"
    return [run_tool(["eagle_deploy.triton.repo", "--engines", str(export), "--out", str(repo), "--force"]),
            run_tool(["eagle_deploy.validate.cli", "--engines", str(export), "--work", str(work / "validate")])]


def folder_bytes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(Path(folder).iterdir()) if p.is_file()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle_deploy.bench.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--work", type=Path, required=True, help="folder for the checkpoint and the export (big)")
    ap.add_argument("--dtype", default="fp16", help="eagle-export --dtype (default fp16)")
    ap.add_argument("--quant", default=None, help="eagle-export --quant (int4 / int8: an fp32 graph quantised)")
    ap.add_argument("--keep", action="store_true", help="keep the export (the checkpoint is always kept for reuse)")
    ap.add_argument("--json", type=Path, default=None, help="write the result here too")
    ap.add_argument("--check-tools", action="store_true",
                    help="also run eagle-triton-repo and eagle-validate on the export")
    args = ap.parse_args(argv)
    ckpt = args.work / f"{args.shape}-random-fp16"
    t0 = time.perf_counter()
    if not any((ckpt / f).exists() for f in ("model.safetensors.index.json", "model.safetensors")):
        weights = write_checkpoint(args.shape, ckpt)
        print(f"checkpoint: {ckpt} ({weights / GIB:.1f} GiB) written in {time.perf_counter() - t0:.0f} s", flush=True)
    weights = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    extra = ["--dtype", "fp32" if args.quant else args.dtype] + (["--quant", args.quant] if args.quant else [])
    name = f"{args.shape}-{args.quant or args.dtype}"
    extra += ["--name", name]
    stages, folder = run_export(ckpt, args.work / "exports", extra)
    sizes = folder_bytes(folder)
    result = {"shape": args.shape, "export": " ".join(extra), "checkpoint_gib": round(weights / GIB, 2),
              "wall_s": round(stages[-1].end - stages[0].start, 1),
              "peak_anon_gib": round(max(s.anon_mb for s in stages) / 1024, 2),
              "peak_file_gib": round(max(s.file_mb for s in stages) / 1024, 2),
              "peak_total_gib": round(max(s.anon_mb + s.file_mb for s in stages) / 1024, 2),
              "stages": [{"stage": s.name, "wall_s": round(s.end - s.start, 1),
                          "peak_anon_gib": round(s.anon_mb / 1024, 2), "peak_file_gib": round(s.file_mb / 1024, 2),
                          "samples": s.samples} for s in stages],
              "output_bytes": sizes}
    if args.check_tools:
        result["tools"] = check_tools(folder, args.work)
    print(f"{args.shape} {' '.join(extra)}: {result['wall_s']} s, peak anonymous {result['peak_anon_gib']} GiB, "
          f"file-backed {result['peak_file_gib']} GiB (checkpoint {result['checkpoint_gib']} GiB)")
    print(f"{'stage':58s} {'wall s':>7s} {'anon GiB':>9s} {'file GiB':>9s}")
    for s in result["stages"]:  # a stage shorter than the sampling interval has no sample: "-"
        mem = (f"{s['peak_anon_gib']:9.2f} {s['peak_file_gib']:9.2f}" if s["samples"] else f"{'-':>9s} {'-':>9s}")
        print(f"{s['stage'][:58]:58s} {s['wall_s']:7.1f} {mem}")
    for n, b in sizes.items():
        print(f"  {n}: {b / GIB:.2f} GiB")
    for t in result.get("tools", []):
        print(f"{t['command'].split()[0]}: exit {t['rc']}, {t['wall_s']} s, peak anonymous {t['peak_anon_gib']} GiB: "
              f"{t['first_line']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if not args.keep:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
