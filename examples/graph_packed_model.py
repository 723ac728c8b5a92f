"""Train a GDN GPTModel on packed micro-batches from ONE CUDA graph, with a new pack layout every step.

    python -m examples.graph_packed_model [--steps 20] [--budget 8192] [--layers 4]   (repository root, one GPU)

The recipe (gdn_compat.graphs):
1. ``gdn_compat.apply()`` before the model is built (0.18/0.19: ``apply(gdn_thd_graph_safe=True)``).
2. Static buffers for everything a step reads: token ids, positions, labels, loss mask, and a
   ``PackBuffer(budget, max_sequences)`` for the offsets. A pack shorter than the budget is padded to it
   (``pad_to``: one more sequence, masked out of the loss).
3. ``graph, loss = gdn_compat.graphs.capture(step)``: warm-up on a side stream, then one capture of
   zero_grad(set_to_none=True) + forward + backward.
4. Every step: ``buf.load(offsets)``, copy the batch into the static tensors, ``graph.replay()``, then the
   optimizer step outside the graph (it reads the grads the graph wrote).
The model here is built by tests/support/model.py (megatron-core's own GPTModel, TransformerLayer,
GatedDeltaNet and MLP; no Transformer Engine). Each step checks the replayed loss against the same step
run eagerly every --check steps.
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def random_pack(budget: int, max_sequences: int, rng: random.Random) -> list[int]:
    """Sequence lengths of a pack of at most ``budget`` tokens (an RL rollout batch, say)."""
    lengths, left = [], budget - rng.randint(0, budget // 8)  # packs rarely fill the budget exactly
    while left > 0 and len(lengths) < max_sequences - 1:  # keep one slot for the padding sequence
        n = min(left, rng.randint(64, budget // 4))
        lengths.append(n)
        left -= n
    return lengths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--budget", type=int, default=8192, help="tokens per micro-batch (one capture per budget)")
    ap.add_argument("--max-sequences", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--check", type=int, default=5, help="compare the replay with an eager step every N steps")
    args = ap.parse_args()

    from tests.support import model as M
    from tests.support.gdn import QWEN3_NEXT
    from tests.support.megatron import world

    with world(cuda=True):
        import gdn_compat

        facts = gdn_compat.probe()
        report = gdn_compat.apply(**({"gdn_thd_graph_safe": True} if facts.gdn_thd == "native" else {}))
        print("applied:", ", ".join(report.applied))
        model = M.build(M.config(shape=dict(QWEN3_NEXT, ffn=4096), bf16=True, layers=args.layers), device="cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        budget = args.budget
        buf = gdn_compat.graphs.PackBuffer(budget, args.max_sequences, device="cuda")
        ids, pos, labels = (torch.zeros(1, budget, dtype=torch.long, device="cuda") for _ in range(3))
        mask = torch.zeros(1, budget, device="cuda")

        def load(lengths: list[int], seed: int) -> None:
            cu = gdn_compat.graphs.pad_to([0, *torch.tensor(lengths).cumsum(0).tolist()], budget)
            padded = [b - a for a, b in zip(cu, cu[1:])]  # the real sequences plus the padding one
            batch = M.packed_batch(padded, None, seed=seed)
            batch["mask"][sum(lengths):] = 0  # the padding sequence carries no loss
            buf.load(cu)
            for static, key in ((ids, "ids"), (pos, "positions"), (labels, "labels"), (mask, "mask")):
                static.copy_(batch[key][None])

        def step():
            model.zero_grad(set_to_none=True)
            per_token = model(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels,
                              packed_seq_params=buf.params)
            loss = (per_token.float() * mask).sum() / mask.sum().clamp(min=1)
            loss.backward()
            return loss

        rng = random.Random(0)
        load(random_pack(budget, args.max_sequences, rng), seed=0)
        t0 = time.perf_counter()
        graph, loss = gdn_compat.graphs.capture(step)
        print(f"captured one graph for a {budget}-token budget in {time.perf_counter() - t0:.1f} s")
        grads = [p.grad for p in model.parameters()]  # the graph writes these on every replay
        for i in range(args.steps):
            lengths = random_pack(budget, args.max_sequences, rng)
            load(lengths, seed=i + 1)
            graph.replay()
            if args.check and i % args.check == 0:  # the same step eagerly: same bits expected
                replayed = loss.item()
                saved = [g.clone() for g in grads]
                eager = step().item()
                assert replayed == eager and all(torch.equal(a, p.grad) for a, p in zip(saved, model.parameters())), \
                    f"step {i}: replay {replayed} vs eager {eager}"
                for p, g in zip(model.parameters(), grads):  # the graph's own grad tensors back in .grad
                    p.grad = g
            optimizer.step()
            print(f"step {i:3d}: {len(lengths):2d} sequences, {sum(lengths):5d} of {budget} tokens, "
                  f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
