"""`eagle-train`: train an EAGLE-1/2 draft head for a target by self-distillation.

Stages, each cached in --work so an interrupted run resumes where it stopped:
  1. data:     prompts -> the target's own responses (token ids; `data/part-*.npz`)
  2. features: token ids -> target features (`features.pt`, fp16)
  3. train:    head training (`checkpoint.pt` after every epoch)
  4. export:   the head in the published EAGLE layout (`--out`: config.json + model.safetensors)
Existing token data (e.g. the ids shipped in data/tokens/) can be reused with --data.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PRESETS = {
    # fits in ~60 minutes on a 2-core CPU, data generation included
    "cpu-quick": dict(limit=900, modes="0", max_new_tokens=160, gen_batch=32, epochs=6.0, batch_tokens=2048,
                      lr=6e-4, ce_topk=32, unroll=1, time_budget_min=30.0),
    # a GPU recipe (minutes on one H100/H200 for SmolLM2; hours for 7B targets)
    "gpu": dict(limit=0, modes="0,0.7", max_new_tokens=256, gen_batch=512, epochs=6.0, batch_tokens=32768,
                lr=1e-3, ce_topk=0, unroll=3, time_budget_min=0.0),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="target: alias, Hugging Face folder or .gguf file (as eagle-export)")
    p.add_argument("--out", type=Path, required=True, help="folder for the trained head (published EAGLE layout)")
    p.add_argument("--work", type=Path, default=None, help="cache folder for the stages (default: OUT/../<out name>.work)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-quick")
    p.add_argument("--prompts", default="train", help="'train' (src/eagle_deploy/data/prompts/train_prompts.jsonl) or a JSONL file")
    p.add_argument("--data", type=Path, nargs="*", default=None, help="existing token-data .npz files to train on (skips generation)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--seed", type=int, default=0)
    for name, default in PRESETS["cpu-quick"].items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=None, help=f"preset value (cpu-quick: {default})")
    p.add_argument("--init-from-layer", type=int, default=None, help="initialise the head's layer from this target layer")
    p.add_argument("--torch-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="target precision for data generation and features (bf16: large targets on a GPU; needs CUDA)")
    p.add_argument("--no-cache-features", action="store_true", help="keep features in memory only (large data on a GPU)")
    p.add_argument("--gen-time-budget-min", type=float, default=0.0, help="stop generating new data chunks after this many minutes (0: no limit)")
    return p


def _settings(args) -> dict:
    s = dict(PRESETS[args.preset])
    for k in s:
        v = getattr(args, k)
        if v is not None:
            s[k] = v
    return s


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    s = _settings(args)
    try:
        return run(args, s)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"eagle-train: error: {err}", file=sys.stderr)
        return 2


def run(args, s: dict) -> int:
    import torch
    from tqdm import tqdm

    from eagle_deploy.exporter.draft_head import head_config_for, random_head, save_head
    from eagle_deploy.exporter.export import _eos_ids, load_target
    from eagle_deploy.exporter.models import resolve_model, sha256_file

    from .data import TokenData, compute_features
    from .trainer import TrainConfig, train_head

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 matmuls for generation/features
    work = args.work or args.out.parent / (args.out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    log_lines = []

    def log(msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        log_lines.append(line)
        tqdm.write(line, file=sys.stderr)

    t_start = time.perf_counter()
    checkpoint = resolve_model(args.model)
    hf = load_target(checkpoint)
    tdtype = torch.bfloat16 if args.torch_dtype == "bf16" else torch.float32
    if tdtype == torch.bfloat16:
        if not device.startswith("cuda"):
            raise ValueError("--torch-dtype bf16 needs a CUDA device (the CPU path trains without autocast)")
        hf.to(tdtype)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint.hf_dir))
    eos = _eos_ids(checkpoint.hf_dir, hf.config, tokenizer)
    log(f"target {checkpoint.name} on {device}; settings {json.dumps(s)}")

    # 1. data
    timings = {}
    t = time.perf_counter()
    if args.data:
        data = TokenData.concat(TokenData.load(p) for p in args.data)
        log(f"data: {len(data)} sequences, {data.response_tokens} response tokens from {len(args.data)} file(s)")
    else:
        data = _generate(args, s, hf, tokenizer, eos, device, work, log)
    timings["data_s"] = round(time.perf_counter() - t, 1)

    # 2. features
    t = time.perf_counter()
    feat_path = work / "features.pt"
    key = {"sequences": len(data), "tokens": int(data.tokens.size), "sum": int(data.tokens.sum())}
    cached = torch.load(feat_path, weights_only=True) if feat_path.exists() else None
    if cached is not None and cached.get("key") == key:
        features = [f.to(device) for f in cached["features"]]
        log("features: cached")
    else:
        bar = tqdm(total=int(data.tokens.size), desc="features", unit="tok", file=sys.stderr)
        features = compute_features(hf, data, device, batch_tokens=65536 if device != "cpu" else 4096, dtype=tdtype,
                                    progress=bar.update)
        bar.close()
        if not args.no_cache_features:
            torch.save({"key": key, "features": [f.cpu() for f in features]}, feat_path)
    timings["features_s"] = round(time.perf_counter() - t, 1)

    # 3. train
    t = time.perf_counter()
    cfg = TrainConfig(epochs=s["epochs"], lr=s["lr"], batch_tokens=s["batch_tokens"], ce_topk=s["ce_topk"],
                      unroll=s["unroll"], seed=args.seed, time_budget_s=60.0 * s["time_budget_min"])
    head = random_head(hf, seed=args.seed)
    if args.init_from_layer is not None:
        _init_from_layer(head, hf, args.init_from_layer)
    bar = tqdm(total=None, desc="train", unit="step", file=sys.stderr)
    history = train_head(head, data, features, cfg, device, log=log)
    bar.close()
    timings["train_s"] = round(time.perf_counter() - t, 1)

    # 4. export
    head.to("cpu", torch.float32)
    head.config = head_config_for(hf.config)
    save_head(head, args.out)
    _save_token_counts(data, hf.config.vocab_size, args.out)
    card = {"target": {"spec": args.model, "source": str(checkpoint.source),
                       "sha256": sha256_file(checkpoint.source) if checkpoint.source.is_file() else None},
            "settings": s, "train": history, "timings_s": {**timings, "total_s": round(time.perf_counter() - t_start, 1)},
            "data": {"sequences": len(data), "response_tokens": data.response_tokens, "device": device}}
    (args.out / "train_log.json").write_text(json.dumps(card, indent=2) + "\n")
    (args.out / "train_log.txt").write_text("\n".join(log_lines) + "\n")
    log(f"head written to {args.out} (total {card['timings_s']['total_s']} s)")
    print(args.out)
    return 0


def _generate(args, s, hf, tokenizer, eos, device, work: Path, log):
    """Generate responses chunk by chunk; finished chunks are reused on resume."""
    import numpy as np
    from tqdm import tqdm

    from .data import TokenData, generate_data, prompt_set

    prompts = prompt_set(args.prompts)
    prompts = [prompts[i] for i in np.random.default_rng(args.seed).permutation(len(prompts))]  # mix categories across chunks
    if s["limit"]:
        prompts = prompts[: s["limit"]]
    modes = [float(m) for m in str(s["modes"]).split(",")]
    parts = work / "data"
    parts.mkdir(exist_ok=True)
    chunk = max(s["gen_batch"], 256)
    bar = tqdm(total=len(prompts) * len(modes), desc="generate", unit="resp", file=sys.stderr)
    done = []
    t0 = time.perf_counter()
    for c0 in range(0, len(prompts), chunk):
        path = parts / f"part-{c0 // chunk:05d}.npz"
        if args.gen_time_budget_min and time.perf_counter() - t0 > 60 * args.gen_time_budget_min and not path.exists():
            log(f"generation time budget reached after {c0} prompts")
            break
        if not path.exists():
            part = generate_data(hf, tokenizer, prompts[c0:c0 + chunk], modes, s["max_new_tokens"], s["gen_batch"],
                                 device, eos, seed=args.seed + c0, progress=bar.update, dtype=next(hf.parameters()).dtype)
            part.header = {"recipe": s, "prompts": args.prompts}
            part.save(path)
        else:
            bar.update(min(chunk, len(prompts) - c0) * len(modes))
        done.append(TokenData.load(path))
    bar.close()
    data = TokenData.concat(done)
    log(f"data: {len(data)} sequences, {data.response_tokens} response tokens")
    return data


def _save_token_counts(data, vocab: int, out: Path) -> None:
    """Response-token frequencies beside the head (for `eagle-export --draft-vocab N`)."""
    import numpy as np

    from eagle_deploy.exporter.draft_head import TOKEN_COUNTS_FILE

    counts = np.zeros(vocab, dtype=np.int64)
    for i in range(len(data)):
        seq = data.sequence(i)
        counts += np.bincount(seq[int(data.prompt_lens[i]):], minlength=vocab)[:vocab]
    np.save(out / TOKEN_COUNTS_FILE, counts)


def _init_from_layer(head, hf, layer: int) -> None:
    import torch

    src = hf.model.layers[layer]
    dst = head.layers[0]
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(dst.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(dst.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
        dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)


if __name__ == "__main__":
    sys.exit(main())
