"""``zmrl patches``: the upstream patches for a fork, their manifest, checking and applying.

The diffs live in ``diffs/`` (also reachable as ``patches/`` at the top of a source checkout),
listed with their pinned upstream versions in ``diffs/manifest.yaml``. Patching is done by the
system ``patch`` program with no fuzz, on copies: ``check`` never writes to the installed
packages, and ``apply_to`` touches a checkout only after every patch applied to a copy of it.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

DIFFS_DIR = Path(__file__).resolve().parent / "diffs"
MANIFEST = DIFFS_DIR / "manifest.yaml"


class PatchError(RuntimeError):
    """A patch does not apply, or is refused for the version it would be applied to."""


@dataclass(frozen=True)
class Upstream:
    name: str  # verl | vllm | megatron-lm
    distribution: str
    package: str


@dataclass(frozen=True)
class Patch:
    name: str
    upstream: str
    versions: tuple[str, ...]
    diff: str
    files: tuple[str, ...]
    purpose: str
    test: str

    @property
    def diff_path(self) -> Path:
        return DIFFS_DIR / self.diff


@dataclass(frozen=True)
class Manifest:
    upstreams: dict[str, Upstream]
    patches: tuple[Patch, ...]

    def by_name(self, name: str) -> Patch:
        for patch in self.patches:
            if patch.name == name:
                return patch
        raise KeyError(name)

    def for_upstream(self, upstream: str) -> list[Patch]:
        return [p for p in self.patches if p.upstream == upstream]


def load_manifest(path: Path = MANIFEST) -> Manifest:
    import yaml

    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    upstreams = {name: Upstream(name, spec["distribution"], spec["package"]) for name, spec in raw["upstreams"].items()}
    patches = []
    for entry in raw["patches"]:
        patch = Patch(
            name=entry["name"], upstream=entry["upstream"], versions=tuple(str(v) for v in entry["versions"]),
            diff=entry["diff"], files=tuple(entry["files"]), purpose=entry["purpose"], test=entry["test"],
        )
        if patch.upstream not in upstreams:
            raise PatchError(f"{path}: patch {patch.name} names an unknown upstream {patch.upstream!r}")
        if not patch.diff.startswith(f"{patch.upstream}/"):
            raise PatchError(f"{path}: patch {patch.name} must live under {patch.upstream}/")
        patches.append(patch)
    names = [p.name for p in patches]
    if len(set(names)) != len(names):
        raise PatchError(f"{path}: duplicate patch names")
    return Manifest(upstreams, tuple(patches))


def diff_targets(diff_text: str) -> list[str]:
    """The files a unified diff writes (its ``+++ b/...`` headers, ``b/`` stripped)."""
    targets = []
    for line in diff_text.splitlines():
        if line.startswith("+++ "):
            target = line[4:].split("\t")[0].strip()
            targets.append(target[2:] if target.startswith("b/") else target)
    return targets


# ----- upstream versions ----------------------------------------------------------------------


def installed_version(upstream: Upstream) -> str | None:
    try:
        return metadata.version(upstream.distribution)
    except metadata.PackageNotFoundError:
        return None


def installed_root(upstream: Upstream) -> Path:
    """The directory that holds the installed package directory (site-packages)."""
    try:
        dist = metadata.distribution(upstream.distribution)
    except metadata.PackageNotFoundError as error:
        raise PatchError(f"{upstream.distribution} is not installed") from error
    root = Path(dist.locate_file("")).resolve()
    if not (root / upstream.package).is_dir():
        raise PatchError(f"{upstream.distribution}: no {upstream.package}/ under {root}")
    return root


def _megatron_checkout_version(root: Path) -> str | None:
    info = root / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        return None
    values = {}
    for node in ast.parse(info.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    try:
        return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{values.get('PRE_RELEASE', '')}"
    except KeyError:
        return None


def _vllm_checkout_version(root: Path) -> str | None:
    # Written by the build (setuptools-scm); a fresh clone has none until it is built.
    version_file = root / "vllm" / "_version.py"
    if not version_file.is_file():
        return None
    for node in ast.parse(version_file.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                names = [target] if isinstance(target, ast.Name) else []
                if any(n.id == "__version__" for n in names):
                    return str(ast.literal_eval(node.value))
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "__version__" and node.value:
            return str(ast.literal_eval(node.value))
    text = version_file.read_text(encoding="utf-8")
    for line in text.splitlines():
        if line.startswith("__version__ = version = "):
            return ast.literal_eval(line.split("=", 2)[2].strip())
    return None


def _verl_checkout_version(root: Path) -> str | None:
    version_file = root / "verl" / "version" / "version"
    return version_file.read_text(encoding="utf-8").strip() if version_file.is_file() else None


_CHECKOUT_VERSION = {"verl": _verl_checkout_version, "megatron-lm": _megatron_checkout_version, "vllm": _vllm_checkout_version}
_CHECKOUT_MARKER = {"verl": "verl/version/version", "megatron-lm": "megatron/core/package_info.py", "vllm": "vllm/envs.py"}


def detect_upstream(root: Path) -> str:
    found = [name for name, marker in _CHECKOUT_MARKER.items() if (root / marker).is_file()]
    if len(found) != 1:
        what = "none" if not found else ", ".join(found)
        raise PatchError(
            f"{root}: cannot tell which upstream this checkout is (found {what}); pass --upstream "
            f"({', '.join(_CHECKOUT_MARKER)})"
        )
    return found[0]


def checkout_version(upstream: str, root: Path) -> str | None:
    return _CHECKOUT_VERSION[upstream](root)


# ----- applying -------------------------------------------------------------------------------


def _require_patch_program() -> str:
    program = shutil.which("patch")
    if program is None:
        raise PatchError("the `patch` program is needed (e.g. apt-get install patch)")
    return program


def run_patch(patch: Patch, root: Path, dry_run: bool = False) -> None:
    """Apply one diff under ``root`` with no fuzz; raise :class:`PatchError` with patch's output."""
    command = [
        _require_patch_program(), "-p1", "--forward", "--batch", "--fuzz=0", "--no-backup-if-mismatch",
        "--reject-file=-", "-d", str(root), "-i", str(patch.diff_path),
    ]
    if dry_run:
        command.append("--dry-run")
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise PatchError(f"{patch.name} does not apply under {root}:\n{(result.stdout + result.stderr).strip()}")


def _touched_files(patches: list[Patch]) -> list[str]:
    files: dict[str, None] = {}
    for patch in patches:
        targets = diff_targets(patch.diff_path.read_text(encoding="utf-8"))
        if sorted(set(targets)) != sorted(set(patch.files)):
            raise PatchError(f"{patch.name}: the manifest lists {sorted(patch.files)}, the diff writes {sorted(set(targets))}")
        files.update(dict.fromkeys(targets))
    return list(files)


def apply_to_copy(patches: list[Patch], source_root: Path, destination: Path) -> Path:
    """Copy the files ``patches`` touch from ``source_root`` to ``destination`` and apply them there."""
    _copy_files(_touched_files(patches), source_root, destination)
    for patch in patches:
        run_patch(patch, destination)
    return destination


def copy_patched_package(manifest: Manifest, upstream: str, destination: Path) -> Path:
    """A full copy of the installed package of ``upstream`` under ``destination``, every patch applied.

    For tests and experiments: import from ``destination`` to run the patched upstream.
    """
    spec = manifest.upstreams[upstream]
    root = installed_root(spec)
    shutil.copytree(root / spec.package, destination / spec.package,
                    ignore=shutil.ignore_patterns("__pycache__"), symlinks=True)
    for patch in manifest.for_upstream(upstream):
        run_patch(patch, destination)
    return destination


@dataclass(frozen=True)
class CheckResult:
    patch: Patch
    version: str | None
    ok: bool
    detail: str


def _copy_files(relatives: list[str], source_root: Path, destination: Path) -> None:
    for relative in relatives:
        source = source_root / relative
        if not source.is_file():
            raise PatchError(f"{source_root}: has no {relative}")
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


def check_installed(manifest: Manifest) -> list[CheckResult]:
    """Apply each upstream's patches, in order, to copies of the installed files of that upstream."""
    results = []
    for name, spec in manifest.upstreams.items():
        patches = manifest.for_upstream(name)
        if not patches:
            continue
        version = installed_version(spec)
        if version is None:
            results += [CheckResult(p, None, False, f"{spec.distribution} is not installed") for p in patches]
            continue
        with tempfile.TemporaryDirectory(prefix=f"zmrl-patches-{name}-") as tmp:
            try:
                _copy_files(_touched_files(patches), installed_root(spec), Path(tmp))
            except PatchError as error:
                results += [CheckResult(p, version, False, str(error)) for p in patches]
                continue
            # In manifest order on the same copies, as a user applies them.
            for patch in patches:
                if version not in patch.versions:
                    results.append(CheckResult(patch, version, False, f"made for {spec.distribution} "
                                               f"{', '.join(patch.versions)}; installed is {version}"))
                    continue
                try:
                    run_patch(patch, Path(tmp))
                except PatchError as error:
                    results.append(CheckResult(patch, version, False, str(error)))
                    continue
                results.append(CheckResult(patch, version, True, "applies"))
    return results


def apply_to(root: Path, upstream: str | None = None, assume_version: str | None = None,
             manifest: Manifest | None = None) -> list[Patch]:
    """Apply every patch for the upstream checked out at ``root``; all or nothing."""
    manifest = manifest or load_manifest()
    root = root.resolve()
    if not root.is_dir():
        raise PatchError(f"{root}: no such directory")
    upstream = upstream or detect_upstream(root)
    if upstream not in manifest.upstreams:
        raise PatchError(f"unknown upstream {upstream!r} (known: {', '.join(manifest.upstreams)})")
    patches = manifest.for_upstream(upstream)
    if not patches:
        raise PatchError(f"no patches for {upstream}")
    version = assume_version or checkout_version(upstream, root)
    if version is None:
        raise PatchError(f"{root}: cannot read the {upstream} version of this checkout; "
                         f"pass --assume-version if you know it")
    refused = [p.name for p in patches if version not in p.versions]
    if refused:
        made_for = sorted({v for p in patches for v in p.versions})
        raise PatchError(f"{root} is {upstream} {version}; the patches were made for {', '.join(made_for)} "
                         f"(refused: {', '.join(refused)}). Nothing was changed.")
    # Everything must apply to a copy before the checkout is touched.
    with tempfile.TemporaryDirectory(prefix=f"zmrl-apply-{upstream}-") as tmp:
        apply_to_copy(patches, root, Path(tmp))
    for patch in patches:
        run_patch(patch, root)
    return patches


# ----- the command -----------------------------------------------------------------------------


def list_command() -> int:
    manifest = load_manifest()
    print(f"patches in {DIFFS_DIR} (apply in this order, `patch -p1` from the checkout root):")
    for patch in manifest.patches:
        spec = manifest.upstreams[patch.upstream]
        print(f"  {patch.name}  [{spec.distribution} {', '.join(patch.versions)}]")
        print(f"      {patch.purpose}")
        print(f"      diff: {patch.diff}; files: {', '.join(patch.files)}")
        print(f"      test: {patch.test}")
    return 0


def check_command() -> int:
    manifest = load_manifest()
    results = check_installed(manifest)
    for result in results:
        spec = manifest.upstreams[result.patch.upstream]
        status = "ok  " if result.ok else "FAIL"
        print(f"{status} {result.patch.name} ({spec.distribution} {result.version or 'not installed'}): "
              f"{result.detail}")
    failed = sum(not r.ok for r in results)
    print(f"{len(results) - failed} of {len(results)} patches apply to the installed upstream packages"
          " (nothing installed was modified)")
    return 1 if failed else 0


def apply_command(directory: str, upstream: str | None, assume_version: str | None) -> int:
    import sys

    try:
        applied = apply_to(Path(directory), upstream, assume_version)
    except PatchError as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 1
    for patch in applied:
        print(f"applied {patch.name}: {', '.join(patch.files)}")
    return 0
