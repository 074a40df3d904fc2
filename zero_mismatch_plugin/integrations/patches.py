"""The one mechanism for every change the plugin makes to someone else's code at run time.

:class:`FunctionPatch` replaces a function, method or attribute; :class:`HookRegistration` appends
to a fork's hook list. Each is named, version-gated, reversible and lazy, and is listed in
:data:`REGISTRY`. See docs/architecture.md, "Adding a patch"; fork patches: docs/patches.md.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from dataclasses import dataclass
from typing import Callable, Union


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
    # When the plugin applies it (the switch a user turns on), for the listing and error messages.
    when: str = ""

    @property
    def target(self) -> str:
        return f"{self.module}:{self.attribute if self.owner is None else f'{self.owner}.{self.attribute}'}"

    def _put(self):
        owner = _owner_object(self)
        original = _current(owner, self.attribute)
        replacement = self.build(original)
        try:
            replacement.__wrapped__ = original
        except (AttributeError, TypeError):  # objects without a __dict__ (a logger adapter has one)
            pass
        setattr(owner, self.attribute, replacement)
        _rebind_importers(self, original, replacement)
        return original

    def _take(self, original) -> None:
        owner = _owner_object(self)
        replacement = _current(owner, self.attribute)
        if original is ABSENT:  # the patch bound a name the module had left unbound
            delattr(owner, self.attribute)
        else:
            setattr(owner, self.attribute, original)
        _rebind_importers(self, replacement, original)


def patch_at(target: str, build: Callable[[Callable], Callable], **fields) -> FunctionPatch:
    """A :class:`FunctionPatch` of ``target``, written as :attr:`FunctionPatch.target` prints it:
    ``"module:attribute"`` or ``"module:Owner.attribute"``."""
    module, _, path = target.partition(":")
    owner, _, attribute = path.rpartition(".")
    if not module or not attribute:
        raise ValueError(f"patch target {target!r}: write it as 'module:attribute' or 'module:Owner.attribute'")
    return FunctionPatch(module=module, owner=owner or None, attribute=attribute, build=build, **fields)


@dataclass(frozen=True)
class HookRegistration:
    """Append ``function`` to the hook list ``module.attribute`` (or ``module.attribute[key]`` when
    that is a dict of lists), for the versions ``versions`` of the package imported as ``package``."""

    name: str
    package: str
    versions: tuple[str, ...]
    module: str
    attribute: str
    key: str | None
    function: Callable
    why: str
    when: str = ""

    @property
    def target(self) -> str:
        where = self.attribute if self.key is None else f"{self.attribute}[{self.key!r}]"
        return f"{self.module}:{where} += {self.function.__qualname__}"

    def _hooks(self) -> list:
        hooks = getattr(sys.modules[self.module], self.attribute)
        return hooks if self.key is None else hooks[self.key]

    def _put(self):
        self._hooks().append(self.function)

    def _take(self, _record) -> None:
        hooks = self._hooks()
        if self.function in hooks:
            hooks.remove(self.function)


Patch = Union[FunctionPatch, HookRegistration]

# Every runtime patch of the plugin: group -> "module:attribute" of the list of its patches. The
# modules are imported only when the registry is read (they import nothing heavy themselves).
REGISTRY: dict[str, str] = {
    "vLLM, in every engine process (vLLM general plugin, ZMRL_NUMERICS)": "zero_mismatch_plugin.integrations.vllm.plugin:PATCHES",
    "verl Megatron engine (ZMRL_MEGATRON_ALIGNED=1)": "zero_mismatch_plugin.integrations.verl.megatron_engine:PATCHES",
    "verl CPU platform (ZMRL_VERL_PLATFORM=cpu)": "zero_mismatch_plugin.integrations.verl.cpu.patches:PATCHES",
    "verl Megatron engine on the CPU platform (mbridge backend)": "zero_mismatch_plugin.integrations.verl.cpu.mcore_engine:PATCHES",
    "verl FSDP engine (ZMRL_FSDP_ALIGNED=1)": "zero_mismatch_plugin.integrations.verl.fsdp_engine:PATCHES",
    "megatron-core on a CPU (Megatron-face expert and pipeline parallelism; verl's Megatron engine)": "zero_mismatch_plugin.integrations.megatron.cpu_patches:PATCHES",
}

# target -> (patch, what undoing it needs), while applied.
_applied: dict[str, tuple[Patch, object]] = {}
# module name -> patches waiting for that module to be imported.
_pending: dict[str, list[Patch]] = {}


def registered() -> list[tuple[str, Patch]]:
    """(group, patch) for every runtime patch of the plugin, in :data:`REGISTRY` order."""
    entries = []
    for group, location in REGISTRY.items():
        module_name, attribute = location.split(":")
        entries.extend((group, patch) for patch in getattr(importlib.import_module(module_name), attribute))
    return entries


def describe(patch: Patch) -> dict[str, str]:
    return dict(name=patch.name, package=patch.package, versions=", ".join(patch.versions),
                target=patch.target, when=patch.when, why=patch.why)


def list_command() -> int:
    """``zmrl patches list``, second part: the runtime patches, by group."""
    print("runtime patches (applied in the running process, removable; not in any checkout):")
    group = None
    for patch_group, patch in registered():
        if patch_group != group:
            group = patch_group
            print(f"  {group}:")
        info = describe(patch)
        print(f"    {info['name']}  [{info['package']} {info['versions']}]  {info['target']}")
        if info["when"]:
            print(f"        when: {info['when']}")
        print(f"        why: {info['why']}")
    return 0


def installed_version(package: str) -> str:
    return str(getattr(importlib.import_module(package), "__version__", "unknown"))


def check_version(patch: Patch) -> str:
    """The installed version of the patch's package; :class:`UnsupportedVersion` if it is not one
    the patch supports. A local build label (``0.31.0+cpu``) may be left out of ``versions``."""
    version = installed_version(patch.package)
    if version not in patch.versions and version.split("+")[0] not in patch.versions:
        switch = (f", or turn off what applies it ({patch.when})" if patch.when
                  else ", or turn off the feature that needs this patch")
        raise UnsupportedVersion(
            f"zero-mismatch patch {patch.name!r} of {patch.package} supports {patch.package} "
            f"{', '.join(patch.versions)}; found {patch.package} {version}. Install a supported "
            f"{patch.package}{switch}.")
    return version


def _owner_object(patch: FunctionPatch):
    module = sys.modules[patch.module]
    return module if patch.owner is None else getattr(module, patch.owner)


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


# What ``build`` is given for a module-level name the module left unbound (an optional import
# that failed); removing the patch unbinds it again.
ABSENT = _Absent()


def _current(owner, attribute: str):
    # A class attribute is read from the class's own dict so that a staticmethod/classmethod
    # wrapper is kept as it is; one the class does not set itself (inherited or unset) is ABSENT,
    # so that removing the patch deletes the class's own binding again.
    if isinstance(owner, type):
        return owner.__dict__.get(attribute, ABSENT)
    return getattr(owner, attribute, ABSENT)


def _rebind_importers(patch: FunctionPatch, old: Callable, new: Callable) -> None:
    for name in patch.bound_in:
        module = sys.modules.get(name)
        if module is not None and getattr(module, patch.attribute, None) is old:
            setattr(module, patch.attribute, new)


def _put_now(patch: Patch) -> None:
    _applied[patch.target] = (patch, patch._put())


def apply(patch: Patch) -> None:
    """Check the version, then patch now if the module is imported, else as soon as it is.
    Applying an applied or pending patch again does nothing; applying a second patch of a target
    another patch holds is refused."""
    if is_applied(patch) or is_pending(patch):
        return
    holder = _applied.get(patch.target)
    if holder is not None:
        raise RuntimeError(f"zero-mismatch patch {patch.name!r}: {patch.target} is already patched by "
                           f"{holder[0].name!r}; remove that one first")
    check_version(patch)
    if patch.module in sys.modules:
        _put_now(patch)
        return
    _pending.setdefault(patch.module, []).append(patch)
    _install_hook()


def remove(patch: Patch) -> None:
    """Put the original back (or forget a pending patch). Removing a patch that is not applied
    does nothing."""
    waiting = _pending.get(patch.module, [])
    if patch in waiting:
        waiting.remove(patch)
    if is_applied(patch):
        _, record = _applied.pop(patch.target)
        patch._take(record)
    if not any(_pending.values()):
        _uninstall_hook()


def is_applied(patch: Patch) -> bool:
    entry = _applied.get(patch.target)
    return entry is not None and entry[0] == patch


def is_pending(patch: Patch) -> bool:
    return patch in _pending.get(patch.module, [])


def applied() -> list[str]:
    """Names of the patches in place in this process."""
    return sorted(patch.name for patch, _ in _applied.values())


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
            _put_now(patch)

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
