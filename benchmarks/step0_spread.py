"""Step 0 of the training benchmark, looked at closely (#53): is the spread of its losses the harness or the numerics?

bench_train's first runs gave step-0 losses from bitwise the same batch that differed by up to 0.17 nats between
configurations (native 7.118, both 7.211, det-both 7.045): more than one bf16 forward should. Two questions:

* the harness: does every configuration start from the same weights? Each run here builds the model as bench_train
  does (``tests.support.model.build``, one after another in this process) and prints a SHA-256 of its initial
  parameters. ``--as-before`` skips the CUDA RNG tracker's reseeding that build now does, i.e. the harness as it was.
* the numerics: every decoder layer's output and the loss of each configuration against an fp32 run of the same
  weights (native, nothing applied): relative L2 distance per layer. bf16's spread is native's own distance.

    python -m benchmarks.step0_spread --configs native,fused,flashqla,both,det-both [--as-before] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from benchmarks.bench_train import CONFIGS, VOCAB, WIDTH, batch, fingerprint


def step0(model, tokens: int, data_seed: int, device: str):
    """(loss, [each decoder layer's output in fp32]) of step 0's pack, forward only."""
    from tests.support.gdn import offsets, packed

    ids, labels, mask, pos, lengths = batch(0, tokens, data_seed)
    psp = packed(offsets(lengths))
    psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.to(device)
    psp.max_seqlen_q = psp.max_seqlen_kv = max(lengths)
    ids, labels, mask, pos = (t.to(device)[None] for t in (ids, labels, mask, pos))
    outs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda m, a, o: outs.append(o[0].detach().float()))
             for layer in model.decoder.layers]
    try:
        with torch.no_grad():
            per_token = model(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels,
                              packed_seq_params=psp)
    finally:
        for h in hooks:
            h.remove()
    return float((per_token.float() * mask).sum() / mask.sum()), outs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="native,fused,flashqla,both,det-both")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--as-before", action="store_true", help="no tracker reseeding between builds (the old harness)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import pytest

    import gdn_compat
    from tests.support import model as M
    from tests.support.megatron import world

    M.VOCAB = VOCAB
    results: dict = {"as_before": args.as_before, "configs": {}}
    with world(cuda=True), pytest.MonkeyPatch.context() as mp:
        if args.as_before:
            from megatron.core import tensor_parallel

            mp.setattr(tensor_parallel, "model_parallel_cuda_manual_seed", lambda *a, **k: None)
        # the truth: the weights of a native build from init seed 0, upcast, run in fp32 with nothing applied
        first = M.build(M.config(shape=WIDTH, bf16=True, layers=args.layers), seed=0, device="cuda")
        ref = M.build(M.config(shape=WIDTH, bf16=False, layers=args.layers), seed=0, device="cuda")
        with torch.no_grad():
            for p, q in zip(ref.parameters(), first.parameters(), strict=True):
                p.copy_(q.float())
        truth = (fingerprint(first),) + step0(ref, args.tokens, 0, "cuda")
        del ref, first
        results["fp32"] = {"weights": truth[0], "loss": truth[1]}
        print(f"[step0] fp32 run of the native build's weights (weights {truth[0]}): loss {truth[1]:.4f}", flush=True)
        for name in args.configs.split(","):
            switches, deterministic, data_seed, init_seed = CONFIGS[name]
            with contextlib.ExitStack() as stack:
                if switches is not None:
                    stack.enter_context(gdn_compat.applied(**switches))
                cfg = M.config(shape=WIDTH, bf16=True, layers=args.layers, deterministic=deterministic)
                model = M.build(cfg, seed=init_seed, device="cuda")
                weights = fingerprint(model)
                loss, outs = step0(model, args.tokens, data_seed, "cuda")
                same = weights == truth[0]
                dist = [rel(o, t) for o, t in zip(outs, truth[2])] if same else None
                results["configs"][name] = {"weights": weights, "same_weights_as_fp32_run": same, "loss": loss,
                                            "layer_rel_to_fp32": dist}
                print(f"[step0] {name} (weights {weights}{'' if same else ', NOT the fp32 run weights'}): loss "
                      f"{loss:.4f}" + (f" (fp32 {truth[1]:.4f}, {loss - truth[1]:+.4f}); per layer rel to fp32 "
                                       + " ".join(f"{d:.4f}" for d in dist) if dist else ""), flush=True)
                del model
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
