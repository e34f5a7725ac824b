"""Training an EAGLE-1/2 or EAGLE-3 head on self-distilled features.

Objective (EAGLE, arXiv 2401.15077 §4): Smooth-L1 between the predicted and the target's
next feature, plus 0.1 x cross-entropy between the target's next-token distribution
softmax(lm_head(f_{i+1})) and the head's, through the frozen shared LM head; uniform noise
U(-noise, noise) on the input features; AdamW with betas (0.9, 0.95); gradients clipped at
0.5 (by value, as the reference implementation does).

Optional training-time unrolling (`unroll` > 1, as EAGLE-3's training-time test and HASS
do, arXiv 2503.01840 §3.2): step s feeds the head its own step-(s-1) predictions, attending
to the real-feature keys of the context and to its own chain's earlier steps exactly as in
tree drafting; step s is weighted decay**(s-1).

EAGLE-3 heads (arXiv 2503.01840 §3): the first step is fed the target's taps (fused by the
head's fc), later steps the head's own outputs (the same unrolling: "training-time test");
the loss is the cross-entropy between the target's next-token distribution restricted to
the draft vocabulary (the target's logits over those ids, softmaxed) and the head's own
distribution over it; no feature regression. Features are then [taps; final] per position
(data.compute_features with feature_layers).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from eagle_deploy.heads.eagle3 import Eagle3Head
from eagle_deploy.heads.eagle12 import EagleHead

from .data import TokenData
from .settings import MAX_SEQ_LEN


@dataclass
class TrainConfig:
    epochs: float = 4.0
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    batch_tokens: int = 4096
    noise: float = 0.1
    feature_weight: float = 1.0
    ce_weight: float = 0.1
    unroll: int = 1
    step_decay: float = 0.8
    ce_topk: int = 0  # 0: full-vocabulary soft targets; K: the target's top-K probabilities, renormalised
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    max_seq_len: int = MAX_SEQ_LEN  # eagle-train --max-seq-len's default too
    val_fraction: float = 0.03
    seed: int = 0
    # 0: no limit; else the number of steps is planned from the time per step measured over the
    # warm-up steps (steps_for_budget), the cosine schedule ends there, and training also stops
    # if it reaches the budget first (validation included)
    time_budget_s: float = 0.0
    max_steps: int = 0  # > 0: exactly this many steps (the schedule ends there); epochs and the budget's plan ignored
    # bf16 autocast on a CPU too (CUDA always trains under it); for CPUs with native bf16, where
    # a step is faster (docs/decisions.md, 'eagle-train settings, measured')
    cpu_bf16: bool = False
    # also score the prompt positions while training (the target's distribution there is the soft
    # label, as EAGLE-1 trained on fixed ShareGPT text rather than on its own answers); validation
    # stays on response positions, so its figures compare with heads trained without it
    prompt_positions: bool = False

    def to_json(self) -> dict:
        return asdict(self)


def unroll_masks(n: int, steps: int, device) -> list[torch.Tensor]:
    """Attention masks of each unrolled step s (1-based): [n, s * n] bool over keys
    [step-1 keys | step-2 keys | ... | step-s keys]. Query i (position i) at step s sees
    step-1 keys j <= i - s + 1 (the real context) and step-k key i - s + k for k = 2..s (its
    own chain: the tree ancestors it would see while drafting)."""
    ar = torch.arange(n, device=device)
    masks = []
    for s in range(1, steps + 1):
        blocks = [ar[None, :] <= (ar[:, None] - s + 1)]
        blocks += [ar[None, :] == (ar[:, None] - s + k) for k in range(2, s + 1)]
        masks.append(torch.cat(blocks, dim=1))
    return masks


def unrolled_forward(head: EagleHead | Eagle3Head, feats: torch.Tensor, tokens: torch.Tensor,
                     steps: int) -> list[torch.Tensor]:
    """feats [B, n, F] (target features f_0..f_{n-1}; an EAGLE-3 head's taps), tokens [B, n]
    (t_1..t_n) -> the head's outputs at each step, [B, n, H] each (step s at index i predicts
    f_{i+1}, and the token t_{i+2})."""
    B, n, _ = feats.shape
    pos = torch.arange(n, device=feats.device)[None].expand(B, n)
    kvh, hd = head.dims.num_kv_heads, head.dims.head_dim
    # key and value of each of the head's layers (EAGLE-3: one)
    past = [torch.zeros(0, B, kvh, hd, device=feats.device, dtype=feats.dtype)] * (2 * head.dims.num_layers)
    eagle3 = isinstance(head, Eagle3Head)
    call = head.layer if eagle3 else head  # EAGLE-3: fc fuses the taps once, outside the layer
    outs, inputs = [], head.fuse(feats) if eagle3 else feats
    for s, mask in enumerate(unroll_masks(n, steps, feats.device), start=1):
        m = mask[None].expand(B, n, s * n)
        out, *present = call(inputs, tokens, pos, m, *past)
        outs.append(out)
        past = [torch.cat((p, q)) for p, q in zip(past, present)]
        # index i gets step s's prediction at i-1
        inputs = torch.cat((torch.zeros_like(out[:, :1]), out[:, :-1]), dim=1)
    return outs


@dataclass
class Batch:
    feats: torch.Tensor  # [B, n, H] f_0..f_{n-1}
    tokens: torch.Tensor  # [B, n] t_1..t_n
    target: torch.Tensor  # [B, n, H] f_1..f_n
    chain_start_ok: torch.Tensor  # [B, n] bool: position i may start a chain (i >= prompt_len - 1, or any i)
    valid: torch.Tensor  # [B, n] bool: f_{i+1} exists


def make_batch(data: TokenData, features: list[torch.Tensor], idx, device, max_len: int,
               prompt_positions: bool = False) -> Batch:
    """The sequences `idx` (cut at `max_len` tokens) as one padded batch; chains start at the
    last prompt token and after it, or anywhere when `prompt_positions`."""
    lengths = [min(len(features[i]), max_len) for i in idx]
    n = max(lengths) - 1
    H = features[idx[0]].shape[-1]
    B = len(idx)
    feats = torch.zeros(B, n + 1, H, dtype=features[idx[0]].dtype, device=features[idx[0]].device)
    tokens = torch.zeros(B, n + 1, dtype=torch.long)
    start_ok = torch.zeros(B, n, dtype=torch.bool)
    valid = torch.zeros(B, n, dtype=torch.bool)
    for b, i in enumerate(idx):
        L = lengths[b]
        feats[b, :L] = features[i][:L]
        tokens[b, :L] = torch.from_numpy(data.sequence(int(i))[:L])
        valid[b, : L - 1] = True
        start_ok[b, 0 if prompt_positions else max(int(data.prompt_lens[i]) - 1, 0): L - 1] = True
    feats = feats.to(device)
    return Batch(feats[:, :-1], tokens[:, 1:].to(device), feats[:, 1:], start_ok.to(device), valid.to(device))


def step_losses(head: EagleHead | Eagle3Head, batch: Batch, cfg: TrainConfig, train: bool,
                target_lm: torch.Tensor | None = None) -> tuple[torch.Tensor, list[dict]]:
    """Weighted loss over unrolled steps and per-step metrics (loss parts, top-1 accuracy).
    `target_lm` [draft_vocab, H]: the target's LM-head rows of the draft vocabulary (frozen);
    metrics' acc is then agreement with the target's top-1 among them. EAGLE-3 heads need it;
    for an EAGLE-1/2 head it restricts the cross-entropy to the tokens its export can propose
    (`eagle-export --draft-vocab N` keeps the same N most frequent ids), which makes the
    LM-head products, most of a CPU training step, vocab / draft_vocab times cheaper (None:
    the full vocabulary)."""
    if isinstance(head, Eagle3Head):
        return _eagle3_losses(head, batch, cfg, target_lm)
    logits = head.logits if target_lm is None else (lambda f: (f @ target_lm.t()).float())
    feats = batch.feats.float()
    if train and cfg.noise > 0:
        feats = feats + (torch.rand_like(feats) * 2 - 1) * cfg.noise
    preds = unrolled_forward(head, feats, batch.tokens, cfg.unroll)
    target = batch.target.float()
    # every step scores a subset of step 1's positions (_chain_ok): the target's soft labels
    # (LM-head product, softmax or top-k, argmax) are computed once, over step 1's, and indexed
    first = _chain_ok(batch, 1)
    with torch.no_grad():
        t_logits = logits(target[first])
        t_top1 = t_logits.argmax(-1)
        if cfg.ce_topk:
            tp, ti = torch.topk(torch.softmax(t_logits, dim=-1), min(cfg.ce_topk, t_logits.shape[-1]), dim=-1)
            tp = tp / tp.sum(-1, keepdim=True)
        else:
            t_probs = torch.softmax(t_logits, dim=-1)
        del t_logits
    total, metrics = 0.0, []
    for s, pred in enumerate(preds, start=1):
        ok = _chain_ok(batch, s)
        if not bool(ok.any()):
            continue
        rows = ok[first]  # step s's positions among step 1's
        p, t = pred[ok], target[ok]
        reg = F.smooth_l1_loss(p, t)
        logq = torch.log_softmax(logits(p), dim=-1)
        if cfg.ce_topk:
            ce = -(tp[rows] * logq.gather(-1, ti[rows])).sum(-1).mean()
        else:
            ce = -(t_probs[rows] * logq).sum(-1).mean()
        weight = cfg.step_decay ** (s - 1)
        total = total + weight * (cfg.feature_weight * reg + cfg.ce_weight * ce)
        acc = (logq.argmax(-1) == t_top1[rows]).float().mean()
        metrics.append({"step": s, "reg": reg.item(), "ce": ce.item(), "acc": acc.item(), "n": int(ok.sum())})
    return total, metrics


def _chain_ok(batch: Batch, s: int) -> torch.Tensor:
    """[B, n] positions scored at unrolled step s: the chain's start i - s + 1 is at or after
    the last prompt token, and the next feature exists."""
    n = batch.valid.shape[1]
    ok = torch.zeros_like(batch.valid)
    ok[:, s - 1:] = batch.chain_start_ok[:, : n - s + 1]
    return ok & batch.valid


def _eagle3_losses(head: Eagle3Head, batch: Batch, cfg: TrainConfig, target_lm: torch.Tensor):
    W = len(head.cfg.feature_layers) * head.cfg.target_hidden
    taps, final = batch.feats[..., :W].float(), batch.target[..., W:].float()
    preds = unrolled_forward(head, taps, batch.tokens, cfg.unroll)
    first = _chain_ok(batch, 1)  # as in step_losses: soft labels once, over step 1's positions
    with torch.no_grad():
        t_logits = final[first] @ target_lm.t()  # the target's logits over the draft vocabulary
        t_top1, t_probs = t_logits.argmax(-1), torch.softmax(t_logits, dim=-1)
        del t_logits
    total, metrics = 0.0, []
    for s, pred in enumerate(preds, start=1):
        ok = _chain_ok(batch, s)
        if not bool(ok.any()):
            continue
        rows = ok[first]
        logq = torch.log_softmax(head.logits(pred[ok]), dim=-1)
        ce = -(t_probs[rows] * logq).sum(-1).mean()
        total = total + cfg.step_decay ** (s - 1) * ce
        with torch.no_grad():  # agreement with the target's top-1 within the draft vocabulary
            acc = (logq.argmax(-1) == t_top1[rows]).float().mean()
        metrics.append({"step": s, "reg": 0.0, "ce": ce.item(), "acc": acc.item(), "n": int(ok.sum())})
    return total, metrics


def _batches(data: TokenData, order: np.ndarray, batch_tokens: int, max_len: int, rng: np.random.Generator | None):
    """Length-bucketed batches of sequence indices (shuffled between buckets when rng)."""
    lengths = np.minimum(np.diff(data.offsets), max_len)
    srt = order[np.argsort(lengths[order], kind="stable")]
    batches, cur, cur_max = [], [], 0
    for i in srt:
        m = max(cur_max, int(lengths[i]))
        if cur and m * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, m = [], int(lengths[i])
        cur.append(int(i))
        cur_max = m
    if cur:
        batches.append(cur)
    if rng is not None:
        rng.shuffle(batches)
    return batches


def scored_sequences(data: TokenData, max_len: int) -> np.ndarray:
    """[sequences] bool: the sequence has a position the loss scores within its first
    `max_len` tokens (make_batch's truncation): its last prompt token is before the last kept
    one (`Batch.chain_start_ok`)."""
    kept = np.minimum(np.diff(data.offsets), max_len)
    return np.maximum(np.asarray(data.prompt_lens) - 1, 0) < kept - 1


def split(data: TokenData, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train/validation split by prompt id (all samples of one prompt on one side)."""
    ids = sorted({m["id"] for m in data.meta})
    rng = np.random.default_rng(seed)
    val_ids = (set(rng.choice(ids, size=max(1, int(len(ids) * val_fraction)), replace=False).tolist())
               if val_fraction > 0 else set())
    is_val = np.array([m["id"] in val_ids for m in data.meta])
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)


@torch.no_grad()
def evaluate(head: EagleHead | Eagle3Head, data, features, order, cfg: TrainConfig, device,
             target_lm: torch.Tensor | None = None) -> list[dict]:
    """Per-step validation metrics, position-weighted."""
    head.eval()
    sums: dict[int, dict] = {}
    for idx in _batches(data, order, cfg.batch_tokens, cfg.max_seq_len, None):
        _, ms = step_losses(head, make_batch(data, features, idx, device, cfg.max_seq_len), cfg, train=False,
                            target_lm=target_lm)
        for m in ms:
            acc = sums.setdefault(m["step"], {"reg": 0.0, "ce": 0.0, "acc": 0.0, "n": 0})
            for k in ("reg", "ce", "acc"):
                acc[k] += m[k] * m["n"]
            acc["n"] += m["n"]
    head.train()
    return [{"step": s, **{k: v[k] / max(v["n"], 1) for k in ("reg", "ce", "acc")}, "n": v["n"]}
            for s, v in sorted(sums.items())]


def train_head(head: EagleHead | Eagle3Head, data: TokenData, features: list[torch.Tensor], cfg: TrainConfig,
               device: str, log=print, target_lm: torch.Tensor | None = None, clock=time.perf_counter) -> dict:
    """Train `head` in place; returns a history dict (per-epoch validation, wall time, "steps"
    planned and "steps_done"). The target's embedding (and an EAGLE-1/2 head's shared LM head)
    stay frozen; an EAGLE-3 head trains its own LM head against `target_lm` (see step_losses).
    `clock` (seconds) times the budget (cfg.time_budget_s)."""
    torch.manual_seed(cfg.seed)
    head.to(device).train()
    frozen = (head.embed.weight,) if isinstance(head, Eagle3Head) else (head.embed.weight, head.lm_head.weight)
    for p in frozen:
        p.requires_grad_(False)
    if target_lm is not None:
        target_lm = target_lm.to(device)
    params = [p for n, p in head.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    train_idx, val_idx = split(data, cfg.val_fraction, cfg.seed)
    scored = scored_sequences(data, cfg.max_seq_len)
    if not scored.all():  # prompts as long as max_seq_len: none of their response positions is scored
        if cfg.prompt_positions:  # trained on (their prompt positions), left out of validation only
            val_idx = val_idx[scored[val_idx]]
        else:
            log(f"train: {int((~scored).sum())} sequences skipped: their prompts fill the first {cfg.max_seq_len} "
                "tokens (max_seq_len), so none of their response positions would be trained on")
            train_idx, val_idx = train_idx[scored[train_idx]], val_idx[scored[val_idx]]
        if not train_idx.size:
            raise ValueError(f"no training sequence has a response position within max_seq_len {cfg.max_seq_len}")
    rng = np.random.default_rng(cfg.seed)
    per_epoch = len(_batches(data, train_idx, cfg.batch_tokens, cfg.max_seq_len, None))
    total_steps = cfg.max_steps or max(1, int(math.ceil(per_epoch * cfg.epochs)))
    # a time budget becomes a step count at the end of the warm-up (at most PLAN_MAX steps),
    # timed over its last three quarters (early steps run slower: first-call allocations). Until
    # then the lr is the warm-up's, which does not depend on the count, and after it the schedule
    # depends on steps only, so --max-steps with the logged count reproduces the run
    plan_at = 0 if cfg.max_steps or not cfg.time_budget_s else min(PLAN_MAX, max(2, cfg.warmup_steps))
    time_from = max(1, plan_at // 4)
    history = {"config": cfg.to_json(), "train_sequences": int(len(train_idx)), "val_sequences": int(len(val_idx)),
               "steps": total_steps, "epochs": [], "val": []}
    t0, step, t1 = clock(), 0, 0.0
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if str(device).startswith("cuda")
                else torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.cpu_bf16))
    while step < total_steps:
        running = []
        for idx in _batches(data, train_idx, cfg.batch_tokens, cfg.max_seq_len, rng):
            if step >= total_steps or (cfg.time_budget_s and clock() - t0 > cfg.time_budget_s):
                break
            lr = cfg.lr * _schedule(step, cfg.warmup_steps, step / total_steps, cfg.min_lr_ratio)
            for g in opt.param_groups:
                g["lr"] = lr
            with autocast:
                batch = make_batch(data, features, idx, device, cfg.max_seq_len, cfg.prompt_positions)
                loss, ms = step_losses(head, batch, cfg, train=True, target_lm=target_lm)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_value_(params, cfg.grad_clip)
            opt.step()
            running.append(ms)
            step += 1
            if step == time_from:
                t1 = clock()
            elif step == plan_at:
                now = clock()
                per_step = (now - t1) / (step - time_from)
                planned = steps_for_budget(step, now - t0, per_step, cfg.time_budget_s, total_steps)
                if planned < total_steps:
                    total_steps = history["steps"] = planned
                    log(f"train: the {cfg.time_budget_s / 60:g}-min budget fits {planned} steps at "
                        f"{per_step:.2f} s/step (--max-steps {planned} reproduces this schedule)")
            if step % 50 == 0:
                first = [m for r in running[-50:] for m in r if m["step"] == 1]
                log(f"step {step}/{total_steps} lr {lr:.2e} loss {float(loss.detach()):.4f} "
                    f"acc1 {np.mean([m['acc'] for m in first]):.3f} ({clock() - t0:.0f}s)")
        if val_idx.size:
            with autocast:
                val = evaluate(head, data, features, val_idx, cfg, device, target_lm)
            history["val"].append({"step": step, "time_s": round(clock() - t0, 1), "metrics": val})
            log("val " + " ".join(f"acc{m['step']} {m['acc']:.3f}" for m in val) + f" (step {step})")
        if cfg.time_budget_s and clock() - t0 > cfg.time_budget_s:
            break
    history["wall_time_s"] = round(clock() - t0, 1)
    history["steps_done"] = step
    if step < total_steps:
        log(f"train: the time budget ended training at step {step} of the {total_steps} planned")
    return history


PLAN_MAX = 100  # the latest step at which a time budget is turned into a step count
VAL_SHARE = 0.05  # of the remaining budget, kept for the per-epoch validation passes


def steps_for_budget(step: int, elapsed_s: float, per_step_s: float, budget_s: float, total_steps: int) -> int:
    """Steps a time budget fits: the `step` already done in `elapsed_s` plus what the rest of
    `budget_s` (less VAL_SHARE for validation) holds at `per_step_s` seconds per step, at most
    `total_steps` (the epochs' count) and at least `step + 1`."""
    more = int((budget_s - elapsed_s) * (1 - VAL_SHARE) / max(per_step_s, 1e-9))
    return max(step + 1, min(total_steps, step + more))


def _schedule(step: int, warmup: int, progress: float, floor: float) -> float:
    """Linear warm-up, then cosine decay to `floor` over `progress` in [0, 1] (the fraction of
    the planned steps done)."""
    if step < warmup:
        return (step + 1) / warmup
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
