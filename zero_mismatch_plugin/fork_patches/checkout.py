"""A source checkout of an upstream: which upstream it is and which version it states."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Callable

from zero_mismatch_plugin.fork_patches.manifest import PatchError

# The file that marks each upstream's checkout (at the repository root) and states its version.
CHECKOUT_MARKER = {"verl": "verl/version/version", "megatron-lm": "megatron/core/package_info.py", "vllm": "vllm/envs.py",
                   "mbridge": "mbridge/core/bridge.py"}
VERSION_FILE = {"verl": "verl/version/version", "megatron-lm": "megatron/core/package_info.py",
                "vllm": "vllm/_version.py", "mbridge": "pyproject.toml"}


def require_directory(root: Path) -> Path:
    if not root.exists():
        raise PatchError(f"{root}: no such directory; pass the root of a verl, vLLM, Megatron-LM or mbridge checkout")
    if not root.is_dir():
        raise PatchError(f"{root} is a file, not a directory; pass the root of the checkout that holds it")
    return root.resolve()


def detect_upstream(root: Path) -> str:
    found = [name for name, marker in CHECKOUT_MARKER.items() if (root / marker).is_file()]
    if len(found) != 1:
        what = "none" if not found else ", ".join(found)
        raise PatchError(
            f"{root}: cannot tell which upstream this checkout is (found {what}); pass the repository root, "
            f"or --upstream ({', '.join(CHECKOUT_MARKER)})"
        )
    return found[0]


def require_checkout_of(upstream: str, root: Path) -> None:
    """Refuse a directory that is not a checkout of ``upstream`` (e.g. ``--upstream`` is wrong)."""
    marker = CHECKOUT_MARKER[upstream]
    if not (root / marker).is_file():
        others = [name for name, path in CHECKOUT_MARKER.items() if name != upstream and (root / path).is_file()]
        looks_like = f"; it looks like a {others[0]} checkout" if len(others) == 1 else ""
        raise PatchError(f"{root} is not a {upstream} checkout: it has no {marker}{looks_like}. "
                         "Pass the repository root of the upstream the patches are for.")


def _read_python(path: Path) -> ast.Module:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError) as error:
        raise PatchError(f"{path}: cannot read the version from it ({type(error).__name__}: {error}); "
                         "restore the file from the upstream repository") from error


def _literal(node: ast.AST, path: Path):
    try:
        return ast.literal_eval(node)
    except ValueError as error:
        raise PatchError(f"{path}: the version is not a literal ({ast.unparse(node)}); "
                         "restore the file from the upstream repository") from error


def _megatron_checkout_version(root: Path) -> str | None:
    info = root / VERSION_FILE["megatron-lm"]
    if not info.is_file():
        return None
    values = {}
    for node in _read_python(info).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
                values[node.targets[0].id] = _literal(node.value, info)
    try:
        return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{values.get('PRE_RELEASE', '')}"
    except KeyError:
        return None


def _vllm_checkout_version(root: Path) -> str | None:
    # Written by the build (setuptools-scm); a fresh clone has none until it is built.
    version_file = root / VERSION_FILE["vllm"]
    if not version_file.is_file():
        return None
    for node in _read_python(version_file).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        if "__version__" in names and node.value is not None:
            return str(_literal(node.value, version_file))
    return None


def _verl_checkout_version(root: Path) -> str | None:
    version_file = root / VERSION_FILE["verl"]
    if not version_file.is_file():
        return None
    try:
        return version_file.read_text(encoding="utf-8").strip() or None
    except UnicodeDecodeError as error:
        raise PatchError(f"{version_file}: not text ({error}); restore it from the upstream repository") from error


def _mbridge_checkout_version(root: Path) -> str | None:
    import tomllib

    version_file = root / VERSION_FILE["mbridge"]
    if not version_file.is_file():
        return None
    try:
        version = tomllib.loads(version_file.read_text(encoding="utf-8")).get("project", {}).get("version")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise PatchError(f"{version_file}: cannot read the version from it ({error}); "
                         "restore the file from the upstream repository") from error
    return str(version) if version else None


_CHECKOUT_VERSION = {"verl": _verl_checkout_version, "megatron-lm": _megatron_checkout_version,
                     "vllm": _vllm_checkout_version, "mbridge": _mbridge_checkout_version}


def checkout_version(upstream: str, root: Path) -> str | None:
    """The version the checkout states in its own files, or None when it states none."""
    return _CHECKOUT_VERSION[upstream](root)


def _warn_on_stderr(message: str) -> None:
    print(f"WARNING: {message}", file=sys.stderr)


def resolve_version(upstream: str, root: Path, assume_version: str | None,
                    warn: Callable[[str], None] | None = None) -> str:
    """The version to gate the patches on: the checkout's own, or, when it states none, the assumed one.

    ``assume_version`` never overrides a version the checkout states; using it is announced
    through ``warn``, since nothing then confirms it.
    """
    stated = checkout_version(upstream, root)
    if assume_version is not None and not assume_version.strip():
        raise PatchError("--assume-version is empty; give the version the checkout is, e.g. --assume-version 0.31.0")
    if assume_version is None:
        if stated is None:
            raise PatchError(f"{root}: cannot read the {upstream} version of this checkout (no version in "
                             f"{VERSION_FILE[upstream]}); pass --assume-version V if you know it")
        return stated
    if stated is not None and stated != assume_version:
        raise PatchError(f"{root} states {upstream} {stated} ({VERSION_FILE[upstream]}); --assume-version "
                         f"{assume_version} cannot override a version the checkout states. Nothing was changed.")
    if stated is None:
        (warn or _warn_on_stderr)(f"{root} states no {upstream} version ({VERSION_FILE[upstream]} is missing); assuming "
             f"{assume_version} because --assume-version says so. Nothing confirms that claim: each patch "
             "still has to match the code around its changes exactly, but it was tested on the pinned "
             "version only.")
    return assume_version
