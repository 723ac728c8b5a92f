"""Is a layer's method still the release's own? Asked by every packed path before it computes a step itself (#53).

gdn_compat's packed paths compute some of the release's steps in their own code (0.18/0.19's q/k/v preparation and
gated norm + exchange, the rule the layer calls; the fused region also the gate and the gated norm). A framework
that replaces one of those (an output gate, a clamped decay, another delta-rule kernel) does it by subclassing, by
assigning to the release's own class (RL trainers and bridges patch megatron in place), or by setting an attribute on
the layer, at any time: before ``apply()``, after it, after the first packed call. A path that kept computing the
release's step would then silently ignore the replacement, so each call looks up the function objects the layer
would call now (its ``__dict__``, then its class: a dict lookup and a cached attribute lookup per name) and asks
whether they are the release's own. The answer is cached per tuple of function identities, so a replacement made at
any time is a new key and is judged at the next call, and judging (reading code objects) happens once per function.

The release's own: the function defined by the release's module for that class and name (the code object's file,
name and qualified name, as the registry judges its patch targets; megatron's ``jit_fuser`` wrapper is looked
through), a gdn_compat replacement (``gdn_gate_fp32``'s gate, which the paths compute the same way), or, for the rule
the layer calls (``gated_delta_rule``: an instance attribute on 0.18/0.19, the module's ``chunk_gated_delta_rule`` /
``torch_chunk_gated_delta_rule`` on 0.16/0.17), the very function ``fla.ops.gated_delta_rule`` exports as
``chunk_gated_delta_rule`` or the release's torch rule.
"""

from __future__ import annotations

import sys
from typing import Any

from gdn_compat._registry import MARKER, foreign

RULE = "gated_delta_rule"  # not a method: the rule the layer calls (see the module docstring)
# A function that computes exactly fla's chunk_gated_delta_rule (a pure-torch stand-in that lets the release's native
# THD run on the CPU, as gdn_compat's test suite does) says so with this attribute set true
STANDS_FOR_FLA = "__gdn_compat_stands_for_fla__"


def _plain(obj: Any) -> Any:
    func = getattr(obj, "__func__", obj)  # a bound method set on the layer
    return getattr(func, "_torchdynamo_orig_callable", None) or func  # megatron's jit_fuser (torch.compile)


def _where(obj: Any) -> str:
    func = _plain(obj)
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(obj).__qualname__)}"


class Own:
    """The check for one release module (its ``GatedDeltaNet``, its torch rule, fla's rule)."""

    def __init__(self, release: Any):
        self.release = release
        base = getattr(release, "GatedDeltaNet", None)
        # the release's classes that may define a method (0.19: GatedDeltaNet and _GDNBase in the package's files)
        self.homes = tuple(c for c in base.__mro__ if c.__module__.startswith("megatron.")) if isinstance(base, type) else ()
        self._verdicts: dict[tuple, tuple[tuple[Any, ...], tuple[str, ...]]] = {}

    def rule_of(self, layer: Any) -> Any:
        """The rule the release would call for ``layer``: 0.18/0.19 set it on the layer, 0.16/0.17 call the module's."""
        found = layer.__dict__.get(RULE)
        if found is not None:
            return found
        name = "torch_chunk_gated_delta_rule" if layer.config.deterministic_mode else "chunk_gated_delta_rule"
        return getattr(self.release, name, None)

    def _rule_is_own(self, obj: Any) -> bool:
        fla = sys.modules.get("fla.ops.gated_delta_rule")
        if fla is not None and obj is getattr(fla, "chunk_gated_delta_rule", None) or getattr(obj, STANDS_FOR_FLA, False):
            return True  # fla's, the rule gdn_compat's core runs (its own calls into the same kernels)
        func = _plain(obj)
        torch_rule = getattr(self.release, "torch_chunk_gated_delta_rule", None)
        if torch_rule is None or obj is not torch_rule and func is not _plain(torch_rule):
            return False
        home = sys.modules.get(getattr(func, "__module__", ""))
        return home is not None and foreign(home, "torch_chunk_gated_delta_rule", torch_rule) is None

    def _is_own(self, name: str, obj: Any) -> bool:
        if obj is None or getattr(obj, MARKER, None):  # absent on this release, or gdn_compat's own replacement
            return True
        if name == RULE:
            return self._rule_is_own(obj)
        func = _plain(obj)
        return any(name in c.__dict__ and foreign(c, name, func) is None for c in self.homes)

    def replaced(self, layer: Any, names: tuple[str, ...]) -> tuple[str, ...]:
        """Which of ``names`` ``layer`` would now call from elsewhere than the release, each said with what is there
        instead; () when every one is the release's own (or gdn_compat's)."""
        mine, cls = layer.__dict__, type(layer)
        found = tuple(self.rule_of(layer) if n == RULE else mine[n] if n in mine else getattr(cls, n, None)
                      for n in names)
        key = (names, *map(id, found))
        hit = self._verdicts.get(key)
        if hit is None:  # the objects are kept with the verdict, so their ids cannot be reused while it is cached
            said = tuple(f"{n} ({'set on the layer' if n in mine else 'the release module' if n == RULE else 'now'}: "
                         f"{_where(o)})" for n, o in zip(names, found) if not self._is_own(n, o))
            hit = self._verdicts[key] = (found, said)
        return hit[1]
