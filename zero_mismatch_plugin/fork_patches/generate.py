"""Render the ``.patch`` files under ``diffs/`` from their edits (:mod:`.edits`) and commit messages.

Each is written as ``git format-patch`` output against the pinned upstream files, with their blob
ids in its ``index`` lines: ``python -m zero_mismatch_plugin.fork_patches.generate --write``. A test
renders them again and requires byte equality, so a shipped patch cannot drift from its definition.
"""

from __future__ import annotations

from zero_mismatch_plugin.fork_patches.edits import megatron_lm as megatron_lm_edits
from zero_mismatch_plugin.fork_patches.edits import mbridge as mbridge_edits
from zero_mismatch_plugin.fork_patches.edits import megatron_lm_cpu as megatron_lm_cpu_edits
from zero_mismatch_plugin.fork_patches.edits import verl as verl_edits
from zero_mismatch_plugin.fork_patches.edits import vllm_cpu as vllm_cpu_edits
from zero_mismatch_plugin.fork_patches.edits import vllm_cpu_linear_attention as vllm_cpu_gdn_edits
from zero_mismatch_plugin.fork_patches.edits import vllm_gpu as vllm_gpu_edits
from zero_mismatch_plugin.fork_patches.edits.edit import Edit, apply_edits
from zero_mismatch_plugin.fork_patches.formatpatch import FileChange, format_patch
from zero_mismatch_plugin.fork_patches.messages import MESSAGES

# Patch name (as in manifest.yaml) -> its edits.
EDITS: dict[str, list[Edit]] = {**verl_edits.EDITS, **vllm_gpu_edits.EDITS, **vllm_cpu_edits.EDITS,
                               **vllm_cpu_gdn_edits.EDITS, **megatron_lm_edits.EDITS,
                               **megatron_lm_cpu_edits.EDITS, **mbridge_edits.EDITS}


def render_changes(edits: list[Edit], read) -> list[FileChange]:
    """Each file ``edits`` touch, before (``read(path)``) and after the edits, in edit order."""
    paths = list(dict.fromkeys(edit.path for edit in edits))
    changes = []
    for path in paths:
        before = read(path)
        changes.append(FileChange(path, before, apply_edits(before, [e for e in edits if e.path == path], path)))
    return changes


def render_all(manifest) -> dict[str, str]:
    """Patch name -> its ``git format-patch`` text, numbered within its upstream's series.

    Each is rendered against the pinned upstream files with the patches before it applied,
    so the ``index`` lines chain as ``git am`` applies the series.
    """
    from zero_mismatch_plugin.fork_patches import installed_root

    rendered, state = {}, {}
    for patch in manifest.patches:
        root = installed_root(manifest.upstreams[patch.upstream])
        series = [p.name for p in manifest.for_upstream(patch.upstream)]

        def read(path, upstream=patch.upstream, root=root):
            key = (upstream, path)
            if key not in state:
                state[key] = (root / path).read_text(encoding="utf-8")
            return state[key]

        changes = render_changes(EDITS[patch.name], read)
        for change in changes:
            state[(patch.upstream, change.path)] = change.after
        # In path order, as git writes a commit's files.
        changes.sort(key=lambda change: change.path)
        rendered[patch.name] = format_patch(MESSAGES[patch.name], changes, series.index(patch.name) + 1, len(series))
    return rendered


def main(argv: list[str] | None = None) -> int:
    import argparse

    from zero_mismatch_plugin.fork_patches import load_manifest

    parser = argparse.ArgumentParser(description="render the .patch files from their source edits")
    parser.add_argument("--write", action="store_true", help="write them (default: report which differ)")
    args = parser.parse_args(argv)
    manifest = load_manifest()
    stale = 0
    for name, diff in render_all(manifest).items():
        target = manifest.by_name(name).diff_path
        if target.exists() and target.read_text(encoding="utf-8") == diff:
            continue
        stale += 1
        if args.write:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(diff, encoding="utf-8")
            print(f"wrote {target}")
        else:
            print(f"differs from its edits: {target}")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    raise SystemExit(main())
