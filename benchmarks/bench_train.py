"""Does it train the same, and how much faster (#38)? One training run of a GDN + SwiGLU GPTModel per process.

The model: 8 layers of GatedDeltaNet + SwiGLU MLP at Qwen3-Next width (hidden 2048, 16 key / 32 value heads of
128, FFN 4096), vocabulary 512, megatron-core's own GPTModel from the local spec (tests/support/model.py).
Megatron's recipe in miniature: bf16 parameters in megatron-core's DistributedDataParallel (fp32 gradient buffer),
the release's ``finalize_model_grads``, then what megatron-core's ``Float16OptimizerWithFloat16Params`` does: the
fp32 gradients onto fp32 master weights, clipped to a global norm of 1.0, AdamW (weight decay 0.1 on matrices, none
on 1-D parameters, as megatron groups them), the masters copied back to bf16; linear warm-up, then cosine decay to
a tenth. (That optimizer itself allocates on CUDA unconditionally; this loop is the same steps, and runs on the CPU
too, so ``--cpu`` smoke-tests it.)

The task, which a model demonstrably learns within the run: every document repeats a pattern of 8-32 tokens, and a
pattern is a walk along one of 8 fixed random permutations of the tokens 1..511 from a random first token
(a, f(a), f(f(a)), ...). Within a period the next token follows from the current one and the document's
permutation (learned from the data as a whole, identified from the document's first transition): the loss falls well
below the data's unigram entropy (ln 511 = 6.24 nats) within a few hundred steps. At every period boundary the next
token is the pattern's first token, which only recall from earlier in the same document gives (about 1 token in
20); a leak of state across documents recalls another document's pattern. (A first version, a random pattern
repeated, sat on the unigram plateau for all 250 steps of its first H200 run: recall alone is learned late.)
Each step packs ``--tokens`` tokens (default 16,384) into documents of 64-4,096 tokens, a new layout every step;
the data depend only on the data seed and the step, so every configuration sees the same batches.

    python -m benchmarks.bench_train --configs native,native-seed1,fused,flashqla,both,det-both --json-dir DIR
    python -m benchmarks.bench_train --configs default,both --json-dir DIR        (0.16/0.17: gdn_thd)
    python -m benchmarks.bench_train --cpu --tiny --steps 3 --configs det-default  (a smoke run without a GPU)

The configurations run one after another in this process, each on a model built from the same seed (CONFIGS):
``native`` applies nothing (the release's own code; gdn_compat imported, nothing patched), ``native-seed1`` is
native with another data order and init seed (the spread that "trains the same" is judged against), the others
``gdn_compat.applied(...)`` with their switches. Each writes DIR/h200-train-<megatron-core>-<config>.json: the
loss and gradient norm of every step, the step times, tokens per second (median step after the first 10) and the
peak memory of its run. benchmarks/plot_train.py draws the curves and judges "trains the same".
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

VOCAB = 512
WIDTH = dict(hidden=2048, dk=128, dv=128, hk=16, hv=32, ffn=4096)  # Qwen3-Next's GDN layer, a SwiGLU MLP
TINY = dict(hidden=64, dk=16, dv=16, hk=2, hv=4, ffn=128)


PERMUTATIONS = 8


def _walks() -> torch.Tensor:
    """``[PERMUTATIONS, VOCAB]``: row k maps a token to its successor under permutation k (0 maps to 0, unused)."""
    gen = torch.Generator().manual_seed(4242)
    return torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(VOCAB - 1, generator=gen)])
                        for _ in range(PERMUTATIONS)])


WALKS = _walks()


def batch(step: int, tokens: int, data_seed: int, min_doc: int = 64, max_doc: int = 4096):
    """The pack of ``step``: (ids, labels, loss mask, positions, document lengths), all on the CPU.

    Documents of 64-4,096 tokens (the last one whatever is left, at least 2), each a pattern of 8-32 tokens walked
    along one of the permutations from a random first token, repeated; the label of a token is the next token of
    its document, the last token of a document has none (mask 0)."""
    gen = torch.Generator().manual_seed(data_seed * 1_000_003 + step)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        n = int(torch.randint(min_doc, max_doc + 1, (1,), generator=gen))
        left = tokens - sum(lengths)
        lengths.append(left if left - n < 2 else n)
    ids, labels, mask, pos = [], [], [], []
    for n in lengths:
        period = int(torch.randint(8, 33, (1,), generator=gen))
        walk = WALKS[int(torch.randint(0, PERMUTATIONS, (1,), generator=gen))]
        pattern = [int(torch.randint(1, VOCAB, (1,), generator=gen))]
        for _ in range(period - 1):
            pattern.append(int(walk[pattern[-1]]))
        doc = torch.tensor(pattern).repeat(n // period + 2)[:n + 1]
        ids.append(doc[:n])
        labels.append(doc[1:n + 1])
        m = torch.ones(n)
        m[-1] = 0.0
        mask.append(m)
        pos.append(torch.arange(n))
    return torch.cat(ids), torch.cat(labels), torch.cat(mask), torch.cat(pos), lengths


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


class MasterAdamW:
    """fp32 master weights for bf16 parameters whose fp32 gradients megatron's DDP keeps in ``main_grad``."""

    def __init__(self, params: list, lr: float, fused: bool, clip: float = 1.0, weight_decay: float = 0.1):
        self.params, self.clip = params, clip
        self.masters = [p.detach().float().clone() for p in params]
        decay = [m for p, m in zip(params, self.masters) if p.dim() > 1]
        plain = [m for p, m in zip(params, self.masters) if p.dim() <= 1]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": plain, "weight_decay": 0.0}],
                                     lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)
        self.param_groups = self.opt.param_groups

    @torch.no_grad()
    def step(self) -> float:
        """One update; the global gradient norm before clipping."""
        for p, m in zip(self.params, self.masters):
            m.grad = p.main_grad.float()
        norm = torch.nn.utils.clip_grad_norm_(self.masters, self.clip, foreach=True)
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)
        return norm.item()


# name: (gdn_compat switches or None for nothing applied, deterministic_mode, data seed, init seed)
CONFIGS = {
    "native": (None, False, 0, 0),
    "native-seed1": (None, False, 1, 1),
    "default": ({}, False, 0, 0),
    "fused": ({"gdn_fused": True}, False, 0, 0),
    "flashqla": ({"gdn_flashqla": True}, False, 0, 0),
    "both": ({"gdn_fused": True, "gdn_flashqla": True}, False, 0, 0),
    "det-both": ({"gdn_fused": True, "gdn_flashqla": True}, True, 0, 0),
    "det-default": ({}, True, 0, 0),
}


def fingerprint(model) -> str:
    """The first 16 hex digits of a SHA-256 over every parameter's name and values."""
    import hashlib

    digest = hashlib.sha256()
    for pname, p in model.named_parameters():
        digest.update(pname.encode())
        digest.update(p.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


WEIGHTS: dict[tuple, str] = {}  # (init seed, layers, tiny) -> the initial weights' fingerprint in this process


def train(args, name: str) -> dict:
    """One configuration's run, in megatron's world of this process."""
    import contextlib

    from megatron.core import package_info
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    import gdn_compat
    from tests.support import model as M
    from tests.support.gdn import offsets, packed

    switches, deterministic, data_seed, init_seed = CONFIGS[name]
    device = "cpu" if args.cpu else "cuda"
    with contextlib.ExitStack() as stack:
        applied = None
        if switches is not None:
            report = stack.enter_context(gdn_compat.applied(**switches))
            applied = sorted(report.applied)
            missing = sorted(set(switches) - set(applied))
            if missing:
                raise SystemExit(f"bench_train {name}: {missing} not applied: {[report[n].reason for n in missing]}")
        M.VOCAB = VOCAB  # M.build reads it
        shape = TINY if args.tiny else WIDTH
        cfg = M.config(shape=shape, bf16=not args.cpu, layers=args.layers, deterministic=deterministic)
        model = M.build(cfg, seed=init_seed, device=device)
        weights = fingerprint(model)
        first = WEIGHTS.setdefault((init_seed, args.layers, args.tiny), weights)
        if weights != first:  # the harness itself: every configuration of an init seed starts from the same weights
            raise SystemExit(f"bench_train {name}: initial weights {weights} differ from {first}, those of an earlier "
                             f"configuration with init seed {init_seed} in this process (#53)")
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        opt = MasterAdamW(list(model.parameters()), lr=args.lr, fused=not args.cpu)
        if not args.cpu:
            torch.cuda.reset_peak_memory_stats()
        losses, times, grad_norms = [], [], []
        for step in range(args.steps):
            ids, labels, mask, pos, lengths = batch(step, args.tokens, data_seed)
            psp = packed(offsets(lengths))
            psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.to(device)
            psp.max_seqlen_q = psp.max_seqlen_kv = max(lengths)
            ids, labels, mask, pos = (t.to(device)[None] for t in (ids, labels, mask, pos))
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
            if not args.cpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            ddp.zero_grad_buffer()
            per_token = ddp(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels,
                            packed_seq_params=psp)
            loss = (per_token.float() * mask).sum() / mask.sum()
            loss.backward()
            finalize_model_grads([ddp])
            grad_norm = opt.step()  # .item(): the step's end
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            grad_norms.append(grad_norm)
            if step % args.log_every == 0 or step == args.steps - 1:
                print(f"[bench_train {name}] step {step:4d} loss {losses[-1]:.4f} grad norm {grad_norm:.3f} "
                      f"{times[-1] * 1e3:.1f} ms", flush=True)
        peak = round(torch.cuda.max_memory_allocated() / 2**20) if not args.cpu else None
        del ddp, model, opt
    if not args.cpu:
        torch.cuda.empty_cache()
    step_s = statistics.median(times[10:] or times)
    return {
        "name": name, "megatron_core": ".".join(map(str, package_info.VERSION[:3])), "applied": applied,
        "switches": switches, "deterministic": deterministic, "data_seed": data_seed, "init_seed": init_seed,
        "initial_weights_sha256": weights,
        "layers": args.layers, "shape": shape, "vocab": VOCAB, "tokens_per_step": args.tokens, "steps": args.steps,
        "lr": args.lr, "warmup": args.warmup, "loss": losses, "grad_norm": grad_norms,
        "step_ms": [round(t * 1e3, 2) for t in times], "median_step_ms": round(step_s * 1e3, 2),
        "tokens_per_s": round(args.tokens / step_s), "peak_mib": peak, "unigram_entropy": math.log(VOCAB - 1),
        "torch": torch.__version__, "gpu": None if args.cpu else torch.cuda.get_device_name(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", required=True, help=f"comma separated, of {sorted(CONFIGS)}")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lr", type=float, default=6e-4)  # 1e-3 spiked at the end of warm-up (loss 8.3 at step 50)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--json-dir", default=None)
    ap.add_argument("--cpu", action="store_true", help="fp32 on the CPU (gloo): a smoke run of this script")
    ap.add_argument("--tiny", action="store_true", help="hidden 64 (with --cpu)")
    args = ap.parse_args()
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown configurations {unknown}: expected some of {sorted(CONFIGS)}")
    import os

    import pytest

    from tests.support.gdn import use_torch_l2norm
    from tests.support.megatron import world

    with world(cuda=not args.cpu), pytest.MonkeyPatch.context() as mp:
        if args.cpu:
            use_torch_l2norm(mp)
        for name in names:
            try:
                result = train(args, name)
            except Exception as exc:  # noqa: BLE001 - say it, and run the other configurations
                print(f"[bench_train {name}] failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            tail = statistics.mean(result["loss"][-20:])
            print(f"[bench_train {name}] megatron-core {result['megatron_core']} applied {result['applied']}: "
                  f"final loss (mean of the last 20 steps) {tail:.4f} (unigram entropy "
                  f"{result['unigram_entropy']:.2f}), {result['median_step_ms']} ms a step, "
                  f"{result['tokens_per_s']} tokens/s, peak {result['peak_mib']} MiB", flush=True)
            if args.json_dir:
                path = os.path.join(args.json_dir, f"{'cpu' if args.cpu else 'h200'}-train-{result['megatron_core']}-{name}.json")
                with open(path, "w") as fh:
                    json.dump(result, fh)


if __name__ == "__main__":
    main()
