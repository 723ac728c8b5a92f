"""CPU demo: packed (THD) GatedDeltaNet forward and backward on megatron-core 0.16/0.17 through
gdn_compat, checked against running each sequence on its own. No GPU needed.

    nox -s demo            (or, from the repository root: python -m examples.cpu_demo)
"""

from __future__ import annotations

import logging
import sys

import torch

import gdn_compat
from tests.support.gdn import build_gdn, l2norm_ref, offsets, packed
from tests.support.megatron import world


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    with world():
        return demo()


def demo() -> int:
    report = gdn_compat.apply()
    print(f"{report.facts.release}: " + "; ".join(f"{r.name} {r.status}" for r in report))
    if report["gdn_thd"].status != "applied":
        print(f"gdn_thd not applied here ({report['gdn_thd'].reason}); the demo needs megatron-core 0.16/0.17")
        return 1
    import megatron.core.ssm.gated_delta_net as release

    release.l2norm = l2norm_ref  # the release's unpacked path calls fla's Triton l2norm: give it torch's
    lengths = [1, 37, 5, 64, 90, 3]
    cu = offsets(lengths)
    m = build_gdn(deterministic=True)
    x = torch.randn(cu[-1], 1, 64, requires_grad=True)
    out, _ = m(x, None, packed_seq_params=packed(cu))
    out.square().sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    worst_out, worst_gx = 0.0, 0.0
    print(f"{len(lengths)} sequences packed into {cu[-1]} tokens: {lengths}")
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        xi = x[a:b].detach().clone().requires_grad_(True)
        oi, _ = m(xi, None)  # the release's own forward, one sequence
        oi.square().sum().backward()
        d_out = (oi - out[a:b]).abs().max().item()
        d_gx = (xi.grad - x.grad[a:b]).abs().max().item()
        worst_out, worst_gx = max(worst_out, d_out), max(worst_gx, d_gx)
        print(f"  sequence {i} ({b - a:>3} tokens): max |packed - alone| output {d_out:.2e}, input grad {d_gx:.2e}")
    worst_p = max((packed_grads[n] - p.grad).abs().max().item() for n, p in m.named_parameters())
    print(f"worst: output {worst_out:.2e}, input grad {worst_gx:.2e}, parameter grad {worst_p:.2e}")
    ok = worst_out < 1e-5 and worst_gx < 1e-5 and worst_p < 1e-4
    print("packed == per-sequence:", "yes" if ok else "NO")
    gdn_compat.revert()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
