"""``GDN_COMPAT_AUTO=1``: ``gdn_compat.apply()`` in any Python process as soon as megatron-core is imported, without a
line of code in the training script or the framework.

What runs at interpreter start. The gdn_compat wheel (and an editable install, ``pip install -e .``) installs
``gdn_compat_auto.pth`` into site-packages; Python's ``site`` module executes its one line in every process of that
environment. The line reads ``os.environ["GDN_COMPAT_AUTO"]`` and, unless the variable is set to something other
than an off value (unset, empty, 0, false, no, off), does nothing else: no import, no hook. Otherwise the line imports
this module (standard library only: no torch, no megatron, not even the ``gdn_compat`` package) and calls
``install()`` with gdn_compat's apply function named as ``"gdn_compat:_apply_from_hook"``, which puts one finder at the front of ``sys.meta_path``. The finder answers only for
``megatron.core``: the normal import runs, and right after ``megatron/core/__init__.py`` has executed (before any
model can exist) it calls ``gdn_compat.apply()`` once and removes itself. ``GDN_COMPAT_DISABLE`` /
``GDN_COMPAT_ENABLE`` apply as they do to ``apply()``.

Explicit code wins over the variable: a process that calls ``gdn_compat.apply(...)``, ``plan()``, ``probe()`` or
``report()`` decides for itself. While gdn_compat probes the release (and so imports megatron-core) the hook does not
fire; after that call the hook is gone. An ``apply(...)`` with switches after the hook already applied replaces what
the hook applied with what the switches say. A process whose only call was read-only (``plan()``, ``probe()``,
``report()``) before megatron-core was imported gets nothing from the variable, and a warning says so.

If megatron-core is already imported when the hook is installed (``gdn_compat.auto()`` called late, or
``import gdn_compat`` with the variable set after interpreter start), it applies at once and logs a warning saying
so: a model built before that point runs unpatched; if another thread is still importing it, a helper thread waits
for that import and then does the same. A failure to apply is logged as an error and never breaks the import of
megatron-core. ``GDN_COMPAT_LOG=info`` (or debug, warning) shows gdn_compat's messages on stderr without a line of
code: one summary line per ``apply()`` at info. An unknown value of either variable is a warning, once per process.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from typing import Any

ENV, LOG_ENV = "GDN_COMPAT_AUTO", "GDN_COMPAT_LOG"
TARGET = "megatron.core"
_ON, _OFF = {"1", "true", "yes", "on"}, {"", "0", "false", "no", "off"}
_LEVELS = ("debug", "info", "warning", "error")
# installed: install() ran; applied: the hook applied; decided: who decided instead (an explicit call), or None;
# suspended: gdn_compat is probing (the hook must not fire inside a probe); missed: the import happened meanwhile
_state: dict = {"installed": False, "applied": False, "finder": None, "decided": None, "suspended": 0,
                "missed": False, "warned": set(), "source": None, "apply": None}
_lock = threading.Lock()


def _log(level: str, message: str, *args: object) -> None:
    import logging  # imported when there is something to say: nothing heavier than os at interpreter start

    configure_logging()
    getattr(logging.getLogger("gdn_compat"), level)(message, *args)


def _once(key: str, level: str, message: str, *args: object) -> None:
    if key not in _state["warned"]:
        _state["warned"].add(key)
        _log(level, message, *args)


def configure_logging() -> None:
    """``GDN_COMPAT_LOG=info|debug|warning|error``: a stderr handler on the ``gdn_compat`` logger at that level,
    unless the logger already has handlers (the process configured logging itself). Once per process."""
    value = os.environ.get(LOG_ENV, "").strip().lower()
    if not value or "log" in _state:
        return
    _state["log"] = value
    import logging

    if value not in _LEVELS:
        _once("log-value", "warning", "%s=%r is not one of %s: not configuring gdn_compat's logging", LOG_ENV,
              os.environ.get(LOG_ENV), ", ".join(_LEVELS))
        return
    logger = logging.getLogger("gdn_compat")
    logger.setLevel(value.upper())
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # one line, not a second one through a root handler


def requested() -> bool:
    """Whether ``GDN_COMPAT_AUTO`` asks for it; an unknown value is a warning (once per process) and a no."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in _ON:
        return True
    if value not in _OFF:
        _once("value", "warning", "%s=%r is neither on (1, true, yes, on) nor off (0, false, no, off): not applying",
              ENV, os.environ.get(ENV))
    return False


def install(source: str, apply: Any) -> None:
    """Call ``apply(source)`` when megatron-core is first imported in this process (at once if it already is).
    ``apply`` is a callable, or ``"module:function"`` (what the ``.pth`` line names: gdn_compat's
    ``_apply_from_hook``), imported only when it is called; this module itself names no package of gdn_compat's."""
    with _lock:
        if _state["applied"] or _state["decided"]:
            return
        first = not _state["installed"]
        if first:
            _state["installed"], _state["source"], _state["apply"] = True, source, apply
        source, late = _state["source"], TARGET in sys.modules
        if first and not late:
            _state["finder"] = _Finder(source)
            sys.meta_path.insert(0, _state["finder"])
    if not late:
        return
    # megatron.core is imported, or being imported, and the hook has not applied: it came first, or another finder
    # answered for it ahead of ours (an armed finder would then wait forever)
    disarm()
    if getattr(getattr(sys.modules.get(TARGET), "__spec__", None), "_initializing", False):
        _after_import_elsewhere(source)  # another thread (or our caller) is importing it right now
        return
    _log("warning", "megatron-core was imported before gdn_compat could hook its import (%s); applying now: a "
                    "model built before this point runs without gdn_compat's patches", source)
    _apply(source)


def _after_import_elsewhere(source: str) -> None:
    """megatron.core is in sys.modules but still executing: its finder has run, so ours would never be asked. A
    helper thread waits on the import (the module lock) and then applies, saying it is late."""

    def wait_then_apply() -> None:
        try:
            importlib.import_module(TARGET)
        except Exception as exc:  # noqa: BLE001 - the other import's failure is its own
            _log("warning", "%s: megatron-core failed to import (%s); gdn_compat not applied", source, exc)
            return
        _log("warning", "megatron-core was still being imported when gdn_compat's hook was installed (%s); applied "
                        "once that import finished: a model built before then runs without gdn_compat's patches",
             source)
        _apply(source)

    threading.Thread(target=wait_then_apply, name="gdn_compat-auto", daemon=True).start()


def disarm() -> None:
    """Remove a hook that has not fired (the doctor inspects the release as it is)."""
    finder = _state.get("finder")
    if finder is not None and finder in sys.meta_path:
        sys.meta_path.remove(finder)
    _state["finder"] = None


@contextlib.contextmanager
def suspended():
    """While gdn_compat probes the release: an import of megatron-core inside does not apply (it would patch the
    classes the probe is reading)."""
    _state["suspended"] += 1
    try:
        yield
    finally:
        _state["suspended"] -= 1


def decide(who: str) -> None:
    """The process called gdn_compat itself (``who``: "apply()", "plan()", ...): from now on its calls decide and the
    hook never applies. A read-only call that took the hook's moment (megatron-core imported by its probe) or left
    it armed is warned about: the variable asked for patches that nothing will apply unless the process calls
    ``apply()``."""
    with _lock:
        if _state["decided"] or _state["applied"]:
            return
        _state["decided"] = who
        armed = _state["finder"] is not None
    disarm()
    if who != "apply()" and (armed or _state["missed"]) and requested():
        _once("deferred", "warning", "%s is set, but this process called gdn_compat.%s before megatron-core was "
                                     "imported: the variable defers to the process's own calls, so nothing is "
                                     "applied unless it calls gdn_compat.apply()", ENV, who)


def _apply(source: str) -> None:
    with _lock:
        if _state["applied"] or _state["decided"]:
            return
        _state["applied"] = True
    try:
        apply = _state["apply"]
        if isinstance(apply, str):  # "module:function", imported now
            module, _, name = apply.partition(":")
            apply = getattr(importlib.import_module(module), name)
        apply(source)
    except Exception as exc:  # noqa: BLE001 - never break the user's import of megatron-core
        _log("error", "%s asked to apply gdn_compat, which failed: %s: %s; megatron-core runs unpatched", source,
             type(exc).__name__, exc)


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
        if _state["suspended"]:  # imported by gdn_compat's own probe: that call decides (see decide())
            _state["missed"] = True
            return
        _apply(self.finder.source)

    def __getattr__(self, name):  # is_package, get_filename, get_resource_reader, ...
        return getattr(self.inner, name)
