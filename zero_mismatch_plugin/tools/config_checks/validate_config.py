"""``zmrl validate-config``: compose a verl config as verl would and check it, reporting every
problem at once with the key to change.

Hydra only composes (:func:`compose_verl_config`); the checks are :mod:`zero_mismatch_plugin.tools.config_checks`'.
Where Hydra's own hint would mislead (a misspelt key, an unknown config name, an override without
``=``), :class:`ConfigComposeError` says what to change instead (docs/recipes.md).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Iterable

from omegaconf import DictConfig

from zero_mismatch_plugin.tools.config_checks import Problem, checked, format_report
from zero_mismatch_plugin.tools.config_checks.algorithms import FLASH_REINFORCE, REINFORCE_ZERO

__all__ = ["FLASH_REINFORCE", "REINFORCE_ZERO", "ConfigComposeError", "Problem", "compose_verl_config",
           "config_directory", "format_report", "validate_config"]

PKG_PREFIX = "pkg://"
FILE_PREFIX = "file://"
# Sections whose keys are names chosen by the user (Ray's environment, the plugin's own settings):
# a new key there is added with ++KEY=VALUE, as docs/recipes.md shows.
OPEN_SECTIONS = ("ray_kwargs.ray_init.runtime_env.env_vars", "zmrl")
# How many times an override of a missing key is taken out to find the keys close to the next one.
_MAX_UNKNOWN_KEYS = 8


class ConfigComposeError(ValueError):
    """The config cannot be composed as given; the message says what to change."""


def config_directory(config_path: str | Path) -> Path:
    """The directory a ``--config-path`` names: a path, ``file://PATH`` or ``pkg://PACKAGE`` (Hydra's
    forms; ``zmrl recipes list`` prints the shipped recipes as ``pkg://zero_mismatch_plugin.tools.recipes``)."""
    text = str(config_path)
    if text.startswith(PKG_PREFIX):
        import importlib.util

        module = text[len(PKG_PREFIX):].strip("/").replace("/", ".")
        try:
            spec = importlib.util.find_spec(module) if module else None
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            raise FileNotFoundError(f"--config-path {text}: no package {module!r} can be imported here "
                                    "(pkg:// names a Python package holding the config files)")
        directory = Path(locations[0])
    else:
        directory = Path(text[len(FILE_PREFIX):] if text.startswith(FILE_PREFIX) else text).expanduser()
    directory = directory.resolve()
    if not directory.is_dir():
        raise FileNotFoundError(f"--config-path {config_path}: no such directory")
    return directory


def _without_equals(overrides: list[str]) -> None:
    for index, override in enumerate(overrides):
        if "=" in override or override.startswith("~"):
            continue
        following = overrides[index + 1] if index + 1 < len(overrides) else None
        example = (f" ({override}={following}?)" if following is not None and "=" not in following
                   else "")
        raise ConfigComposeError(f"override {override!r} has no '=': an override is key=value (or ~key to remove "
                                 f"a key){example}")


def _config_names(directory: Path) -> list[str]:
    return sorted(path.stem for path in directory.glob("*.yaml"))


def _missing_config(directory: Path, config_name: str) -> ConfigComposeError:
    names = _config_names(directory)
    stem = config_name[:-len(".yaml")] if config_name.endswith(".yaml") else config_name
    close = difflib.get_close_matches(stem, names, n=3, cutoff=0.6)
    if close:
        found = f"did you mean {' or '.join(repr(name) for name in close)}?"
    else:
        found = f"configs there: {', '.join(names)}" if names else "the directory holds no .yaml file"
    return ConfigComposeError(f"no config {stem!r} in {directory} (no {stem}.yaml there): {found}")


def _paths(cfg: DictConfig) -> set[str]:
    """Every key path of a composed config, sections included (lists are not entered)."""
    from omegaconf import OmegaConf

    found: set[str] = set()

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            found.add(path)
            if isinstance(value, dict):
                walk(value, f"{path}.")

    walk(OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False), "")
    return found


def _children(paths: set[str], section: str) -> list[str]:
    depth = section.count(".") + 1 if section else 0
    prefix = f"{section}." if section else ""
    return [path[len(prefix):] for path in paths if path.startswith(prefix) and path.count(".") == depth]


def _close_key(key: str, paths: set[str]) -> tuple[str | None, str]:
    """(the existing key ``key`` most likely means, or None; the deepest section of ``key`` that exists)."""
    parts = key.split(".")
    depth = 0
    while depth < len(parts) and ".".join(parts[:depth + 1]) in paths:
        depth += 1
    parent = ".".join(parts[:depth])
    corrected: list[str] | None = parts[:depth]
    for part in parts[depth:]:
        section = ".".join(corrected)
        close = difflib.get_close_matches(part, _children(paths, section), n=1, cutoff=0.75)
        if not close:
            corrected = None
            break
        corrected.append(close[0])
    if corrected is not None and ".".join(corrected) != key:
        return repr(".".join(corrected)), parent
    # The right name in another section (e.g. a key of the actor given under the rollout).
    elsewhere = sorted(path for path in paths if path.rsplit(".", 1)[-1] == parts[-1] and path != key)
    return (" or ".join(repr(path) for path in elsewhere) if 0 < len(elsewhere) <= 3 else None), parent


def _unknown_key_message(override: str, paths: set[str]) -> str:
    key, deleting = _key_of(override), override.startswith("~")
    suggestion, parent = _close_key(key, paths)
    what = f"cannot remove {key!r}: the composed config has no such key" if deleting else \
        f"the composed config has no key {key!r}"
    if suggestion:
        return f"{what}; did you mean {suggestion}?"
    if not deleting and any(parent == section or parent.startswith(f"{section}.") for section in OPEN_SECTIONS):
        return f"{what}; {parent} takes new keys: add it with ++{override.lstrip('+')}"
    where = f" under {parent!r}" if parent else ""
    return (f"{what}, nor one close to it{where}: check the spelling (a key verl's config does not define is "
            "read by nothing)")


_OVERRIDE_MISSING = re.compile(r"Could not override '([^']+)'")
_DELETE_MISSING = re.compile(r"Could not delete from config\. '([^']+)' does not exist")


def _key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("~+")


def _compose(config_dir: Path, config_name: str, overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=config_name, overrides=overrides)


def _unknown_keys_error(config_dir: Path, config_name: str, overrides: list[str],
                        first: Exception) -> Exception:
    """The overrides naming keys the config lacks, with the keys close to each; ``first`` (Hydra's
    error) when that is not what went wrong."""
    remaining, unknown = list(overrides), []
    error: Exception = first
    for _ in range(_MAX_UNKNOWN_KEYS):
        text = str(error)
        match = _OVERRIDE_MISSING.search(text) or _DELETE_MISSING.search(text)
        if match is None:
            break
        key = match.group(1)
        offending = [o for o in remaining if _key_of(o) == key]
        if not offending:
            break
        unknown.append(offending[0])
        remaining.remove(offending[0])
        try:
            cfg = _compose(config_dir, config_name, remaining)
        except Exception as again:  # noqa: BLE001 - the next override of a missing key, or something else
            error = again
            continue
        paths = _paths(cfg)
        return ConfigComposeError("; ".join(_unknown_key_message(override, paths) for override in unknown))
    return first


def compose_verl_config(config_path: str | Path, config_name: str, overrides: Iterable[str] = ()) -> DictConfig:
    """Compose ``config_name`` from ``config_path`` with Hydra overrides, as verl's launcher does.

    ``config_path``: a directory, ``file://DIR`` or ``pkg://PACKAGE`` (:func:`config_directory`).
    Raises :class:`ConfigComposeError` for an override of a key the config lacks (naming the keys
    close to it), a ``+key=value`` adding a key close to an existing one, a config name the
    directory lacks and an override without ``=``; Hydra's own error for anything else."""
    from hydra.errors import ConfigCompositionException, MissingConfigException

    config_dir = config_directory(config_path)
    overrides = list(overrides)
    _without_equals(overrides)
    try:
        cfg = _compose(config_dir, config_name, overrides)
    except MissingConfigException as error:
        if str(error).startswith("Cannot find primary config"):
            raise _missing_config(config_dir, config_name) from None
        raise
    except ConfigCompositionException as error:
        replaced = _unknown_keys_error(config_dir, config_name, overrides, error)
        if replaced is error:
            raise
        raise replaced from None
    _refuse_added_misspellings(config_dir, config_name, overrides)
    return cfg


def _added_keys(overrides: list[str]) -> list[str]:
    """The ``+key=value`` overrides that add a config key (not ``++``, not a config group)."""
    added = []
    for override in overrides:
        if override.startswith("+") and not override.startswith("++") and "=" in override:
            key = _key_of(override)
            if "." in key and "/" not in key and "@" not in key and \
                    not any(key.startswith(f"{section}.") for section in OPEN_SECTIONS):
                added.append(override)
    return added


def _refuse_added_misspellings(config_dir: Path, config_name: str, overrides: list[str]) -> None:
    """A ``+key=value`` whose key is close to one the config has is the misspelling Hydra's advice
    adds: nothing reads it, and the checks would pass. Refused, naming the key it is close to."""
    added = _added_keys(overrides)
    if not added:
        return
    paths = _paths(_compose(config_dir, config_name, [o for o in overrides if o not in added]))
    messages = []
    for override in added:
        key = _key_of(override)
        if key in paths:
            continue
        suggestion, _ = _close_key(key, paths)
        if suggestion:
            messages.append(f"{override!r} adds {key!r}, which verl's config does not define, so nothing reads it; "
                            f"did you mean {suggestion}?")
    if messages:
        raise ConfigComposeError("; ".join(messages))


def validate_config(cfg: DictConfig) -> list[Problem]:
    """Every bad value, and every requirement of reinforce_zero / flash_reinforce (estimator, loss,
    sampling) that ``cfg`` violates. ``zmrl validate-config`` adds the cluster and alignment checks
    (:func:`zero_mismatch_plugin.tools.config_checks.check_config`)."""
    from zero_mismatch_plugin.tools.config_checks import algorithm_checks

    return checked(cfg, *algorithm_checks())
