"""``once_differentiable`` with a message that names gdn_compat.

gdn_compat's autograd Functions (the fused region, fla's delta rule with the pack's chunk indices) compute their
backward in kernels that autograd cannot see, so a gradient of their gradients (a gradient penalty,
``create_graph=True`` then a second ``backward``) would silently miss every term that passes through them. torch's
``once_differentiable`` turns that into an error at the second backward; this one does the same with a message
that says where the Function comes from and what to do (fla's own Function has the same gap upstream).
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def once_differentiable(what: str) -> Any:
    """Decorate a Function's ``backward``: run it without recording a graph; when the caller asked for one
    (``create_graph=True``), its outputs carry a node that raises on a second backward, naming ``what``."""
    message = (f"gdn_compat: {what} has no double backward (a gradient of its gradients, e.g. a gradient penalty "
               f"through a packed GDN layer): its backward runs kernels autograd cannot differentiate. Run that "
               f"step without gdn_compat's packed path (gdn_compat.revert(), or unpacked input), or without "
               f"create_graph").encode()

    def wrap(backward: Any) -> Any:
        @functools.wraps(backward)
        def run(ctx: Any, *grads: Any) -> Any:
            with torch.no_grad():
                out = backward(ctx, *grads)
            if not torch.is_grad_enabled():  # a plain backward (create_graph=False)
                return out
            # create_graph=True: every gradient gets the raising node, whether or not the incoming gradients need
            # one (torch's version checks them, so a penalty on the parameters' gradients would lose its terms)
            outs = out if isinstance(out, tuple) else (out,)
            live = [(i, t) for i, t in enumerate(outs) if isinstance(t, torch.Tensor)]
            raising = torch._C._functions.DelayedError(message, len(live))(
                *[t.detach().requires_grad_(True) for _, t in live])
            raising = raising if isinstance(raising, tuple) else (raising,)
            result = list(outs)
            for (i, _), t in zip(live, raising):
                result[i] = t
            return tuple(result) if isinstance(out, tuple) else result[0]

        return run

    return wrap
