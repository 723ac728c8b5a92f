"""``GDN_COMPAT_AUTO=1``: ``gdn_compat.apply()`` in any Python process as soon as megatron-core is imported, without a
line of code in the training script or the framework.

What runs at interpreter start. The gdn_compat wheel installs ``gdn_compat_auto.pth`` into site-packages; Python's
``site`` module executes its one line in every process of that environment. The line reads
``os.environ["GDN_COMPAT_AUTO"]`` and, unless the variable is set (to 1, true, yes or on), does nothing else: no
import, no hook. When it is set, the line imports this module (standard library only: no torch, no megatron,
not even the ``gdn_compat`` package) and calls ``install()``, which puts one finder at the front of
``sys.meta_path``. The finder answers only for ``megatron.core``: the normal import runs, and right after
``megatron/core/__init__.py`` has executed (before any model can exist) it calls ``gdn_compat.apply()`` once,
logs one line naming where the request came from, and removes itself. ``GDN_COMPAT_DISABLE`` /
``GDN_COMPAT_ENABLE`` apply as they do to ``apply()``.

If megatron-core is already imported when the hook is installed (``gdn_compat.auto()`` called late, or
``import gdn_compat`` with the variable set after interpreter start), it applies at once and logs a warning saying
so: a model built before that point runs unpatched. A failure to apply is logged as an error and never breaks
the import of megatron-core. Turn it off by unsetting ``GDN_COMPAT_AUTO`` (or setting it to 0); the ``.pth`` file
goes away with ``pip uninstall gdn-compat``.
"""

from __future__ import annotations

import os
import sys
import threading

ENV = "GDN_COMPAT_AUTO"
TARGET = "megatron.core"
_ON, _OFF = {"1", "true", "yes", "on"}, {"", "0", "false", "no", "off"}
_lock = threading.Lock()
_state: dict = {"installed": False, "applied": False, "finder": None}


def _log(level: str, message: str, *args: object) -> None:
    import logging  # imported when there is something to say: nothing heavier than os at interpreter start

    getattr(logging.getLogger("gdn_compat"), level)(message, *args)


def requested() -> bool:
    """Whether ``GDN_COMPAT_AUTO`` asks for it; an unknown value is a warning and a no."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in _ON:
        return True
    if value not in _OFF:
        _log("warning", "gdn_compat: %s=%r is neither on (1, true, yes, on) nor off (0, false, no, off): not "
                        "applying", ENV, os.environ.get(ENV))
    return False


def install(source: str) -> None:
    """Apply gdn_compat when megatron-core is first imported in this process (at once if it already is)."""
    with _lock:
        if _state["installed"]:
            return
        _state["installed"] = True
    module = sys.modules.get(TARGET)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        _log("warning", "gdn_compat: megatron-core was imported before gdn_compat could hook its import (%s); "
                        "applying now: a model built before this point runs without gdn_compat's patches", source)
        _apply(source)
        return
    finder = _Finder(source)
    _state["finder"] = finder
    sys.meta_path.insert(0, finder)


def disarm() -> None:
    """Remove a hook that has not fired (the doctor inspects the release as it is)."""
    finder = _state.get("finder")
    if finder is not None and finder in sys.meta_path:
        sys.meta_path.remove(finder)
    _state["finder"] = None


def _apply(source: str) -> None:
    with _lock:
        if _state["applied"]:
            return
        _state["applied"] = True
    try:
        import gdn_compat

        report = gdn_compat.apply()
    except Exception as exc:  # noqa: BLE001 - never break the user's import of megatron-core
        _log("error", "gdn_compat: %s asked to apply gdn_compat, which failed: %s: %s; megatron-core runs unpatched",
             source, type(exc).__name__, exc)
        return
    _log("info", "gdn_compat: applied from %s when megatron-core was imported: %s", source,
         ", ".join(report.applied) or "nothing needed on this release")


class _Finder:
    """Finds ``megatron.core`` with the other finders and wraps its loader; answers nothing else."""

    def __init__(self, source):
        self.source = source

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self)
        return spec


class _Loader:
    """megatron.core's own loader, then ``gdn_compat.apply()`` once the package has executed."""

    def __init__(self, inner, finder):
        self.inner, self.finder = inner, finder

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        disarm()
        _apply(self.finder.source)

    def __getattr__(self, name):  # is_package, get_filename, get_resource_reader, ...
        return getattr(self.inner, name)
