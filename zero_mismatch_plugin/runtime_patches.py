"""The one mechanism for every change the plugin makes to someone else's code at run time.

A :class:`FunctionPatch` replaces one function, method or module attribute of vLLM, verl or
megatron-core with ``build(original)``. Every patch is

* **named** (``name``; :func:`applied` lists what is in place),
* **version-gated**: it states the package and the versions it was written against, and
  :func:`apply` refuses any other installed version with :class:`UnsupportedVersion`, naming both,
* **reversible**: :func:`remove` puts the original back (also where another module had bound it
  by name, ``bound_in``), and
* **lazy**: a patch of a module that is not imported yet is applied by a post-import hook the
  moment that module finishes executing, before any other module can bind its functions by name;
  so a plugin entry point can register patches without importing heavy modules.

Source changes a fork must carry instead live in :mod:`zero_mismatch_plugin.patching`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from dataclasses import dataclass
from typing import Callable


class UnsupportedVersion(RuntimeError):
    """The installed package is not a version the patch was written against."""


@dataclass(frozen=True)
class FunctionPatch:
    """Replace ``owner.attribute`` (owner: the module ``module``, or the class ``owner`` in it)
    with ``build(original)``, for the versions ``versions`` of the package imported as ``package``."""

    name: str
    package: str  # import name whose ``__version__`` is checked: "verl", "vllm", "megatron.core"
    versions: tuple[str, ...]
    module: str
    owner: str | None  # class name inside ``module``; None for a module-level attribute
    attribute: str
    build: Callable[[Callable], Callable]
    why: str
    # Modules that bind the function by name (``from module import attribute``): rebound too when
    # they were imported before the patch was applied.
    bound_in: tuple[str, ...] = ()


# (module, owner, attribute) -> (patch, original), while applied.
_originals: dict[tuple[str, str | None, str], tuple[FunctionPatch, Callable]] = {}
# module name -> patches waiting for that module to be imported.
_pending: dict[str, list[FunctionPatch]] = {}


def installed_version(package: str) -> str:
    return str(getattr(importlib.import_module(package), "__version__", "unknown"))


def check_version(patch: FunctionPatch) -> str:
    """The installed version of the patch's package; :class:`UnsupportedVersion` if it is not one
    the patch supports."""
    version = installed_version(patch.package)
    if version not in patch.versions:
        raise UnsupportedVersion(
            f"zero-mismatch patch {patch.name!r} of {patch.package} supports {patch.package} "
            f"{', '.join(patch.versions)}; found {patch.package} {version}. Install a supported "
            f"{patch.package} or turn off the feature that needs this patch.")
    return version


def _key(patch: FunctionPatch) -> tuple[str, str | None, str]:
    return patch.module, patch.owner, patch.attribute


def _owner_object(patch: FunctionPatch):
    module = sys.modules[patch.module]
    return module if patch.owner is None else getattr(module, patch.owner)


def _current(owner, attribute: str):
    # A class attribute is read from the class's own dict so that a staticmethod/classmethod
    # wrapper is kept as it is.
    return owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)


def _replace_now(patch: FunctionPatch) -> None:
    owner = _owner_object(patch)
    original = _current(owner, patch.attribute)
    replacement = patch.build(original)
    try:
        replacement.__wrapped__ = original
    except (AttributeError, TypeError):  # objects without a __dict__ (a logger adapter has one)
        pass
    setattr(owner, patch.attribute, replacement)
    _rebind_importers(patch, original, replacement)
    _originals[_key(patch)] = (patch, original)


def _rebind_importers(patch: FunctionPatch, old: Callable, new: Callable) -> None:
    for name in patch.bound_in:
        module = sys.modules.get(name)
        if module is not None and getattr(module, patch.attribute, None) is old:
            setattr(module, patch.attribute, new)


def apply(patch: FunctionPatch) -> None:
    """Check the version, then patch now if the module is imported, else as soon as it is.
    Applying an applied or pending patch again does nothing."""
    if is_applied(patch) or is_pending(patch):
        return
    check_version(patch)
    if patch.module in sys.modules:
        _replace_now(patch)
        return
    _pending.setdefault(patch.module, []).append(patch)
    _install_hook()


def remove(patch: FunctionPatch) -> None:
    """Put the original back (or forget a pending patch). Removing a patch that is not applied
    does nothing."""
    waiting = _pending.get(patch.module, [])
    if patch in waiting:
        waiting.remove(patch)
    entry = _originals.pop(_key(patch), None)
    if entry is not None:
        _, original = entry
        owner = _owner_object(patch)
        replacement = _current(owner, patch.attribute)
        setattr(owner, patch.attribute, original)
        _rebind_importers(patch, replacement, original)
    if not any(_pending.values()):
        _uninstall_hook()


def is_applied(patch: FunctionPatch) -> bool:
    entry = _originals.get(_key(patch))
    return entry is not None and entry[0] == patch


def is_pending(patch: FunctionPatch) -> bool:
    return patch in _pending.get(patch.module, [])


def applied() -> list[str]:
    """Names of the patches in place in this process."""
    return sorted(patch.name for patch, _ in _originals.values())


def pending() -> list[str]:
    """Names of the patches waiting for their module to be imported."""
    return sorted(patch.name for patches in _pending.values() for patch in patches)


# ----- post-import hook ----------------------------------------------------------------------


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then applies the patches waiting for the module."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for patch in _pending.pop(module.__name__, []):
            _replace_now(patch)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not _pending.get(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def _install_hook() -> None:
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


def _uninstall_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PostImportFinder)]
