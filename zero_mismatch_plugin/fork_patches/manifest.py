"""The patch manifest (``diffs/manifest.yaml``) and where the pinned upstreams are installed."""

from __future__ import annotations

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

    def upstream(self, name: str) -> Upstream:
        if name not in self.upstreams:
            raise PatchError(f"unknown upstream {name!r}: use one of {', '.join(self.upstreams)}")
        return self.upstreams[name]


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


def touched_files(patches: list[Patch]) -> list[str]:
    """Every file ``patches`` write, in order of first appearance; checks them against the manifest."""
    files: dict[str, None] = {}
    for patch in patches:
        targets = diff_targets(patch.diff_path.read_text(encoding="utf-8"))
        if sorted(set(targets)) != sorted(set(patch.files)):
            raise PatchError(f"{patch.name}: the manifest lists {sorted(patch.files)}, the diff writes {sorted(set(targets))}")
        files.update(dict.fromkeys(targets))
    return list(files)


# ----- the installed upstream packages ---------------------------------------------------------


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


def installed_file_differs_from_record(upstream: Upstream, relative: str) -> str | None:
    """Why the installed ``relative`` is not the file the distribution shipped, or None.

    Compares with the sha256 the installer wrote into the distribution's RECORD; the
    blob ids in the patches are those of the shipped files.
    """
    import base64
    import hashlib

    dist = metadata.distribution(upstream.distribution)
    for entry in dist.files or ():
        if entry.as_posix() == relative and entry.hash is not None:
            if entry.hash.mode != "sha256":
                return None
            digest = base64.urlsafe_b64encode(hashlib.sha256(Path(dist.locate_file(entry)).read_bytes()).digest())
            if digest.rstrip(b"=").decode() != entry.hash.value:
                return (f"the installed {relative} differs from the file {upstream.distribution} shipped "
                        f"(its RECORD): reinstall {upstream.distribution}")
            return None
    return None
