#!/usr/bin/env bash
# Install check: build the wheel as the README says, install it next to verl in a fresh
# environment, and use it from there: `zmrl selfcheck` (verl loads the plugin through its entry
# point) and a recipe composed from the wheel's own package data.
#
# No second download of the pinned stack: the fresh environment sees .venv's packages through a
# site directory of links to them, leaving out this project's editable install (its .pth finder,
# its dist-info). The wheel is built and installed offline (--no-build-isolation uses .venv's
# setuptools; --no-index fails if the wheel needs anything the pinned set lacks). Every command
# runs from a scratch directory, so nothing can be imported from the checkout by accident; the
# script asserts that the package, its entry points and `zmrl` all come from the wheel.
#
# Usage: bash scripts/check_wheel_install.sh   (after scripts/setup_env.sh; ZMRL_VENV overrides .venv)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ZMRL_VENV:-$here/.venv}"
started=$SECONDS
scratch="$(mktemp -d "${TMPDIR:-/tmp}/zmrl-wheel-check.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
unset PYTHONPATH

step() { echo "wheel check: $* ($((SECONDS - started)) s)"; }

step "building the wheel"
# From a copy of the checkout's files (tracked and not ignored), so the build leaves nothing behind.
mkdir "$scratch/src"
git -C "$here" ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' file; do
  if [[ -f "$here/$file" ]]; then mkdir -p "$scratch/src/$(dirname "$file")" && cp "$here/$file" "$scratch/src/$file"; fi
done
"$venv/bin/python" -m pip wheel "$scratch/src" --no-deps --no-build-isolation -q -w "$scratch/dist"
wheel="$(ls "$scratch"/dist/zero_mismatch_plugin-*.whl)"

step "a fresh environment next to the pinned set in $venv"
fresh="$scratch/env"
"$venv/bin/python" -m venv --without-pip "$fresh"
fresh_site="$("$fresh/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
pinned_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
shared="$scratch/pinned-site-packages"
mkdir "$shared"
for entry in "$pinned_site"/*; do
  case "$(basename "$entry")" in
    *zero_mismatch_plugin*) ;;  # the editable install of this checkout: not part of the pinned set
    *) ln -s "$entry" "$shared/" ;;
  esac
done
# A site directory (not a plain path) so the pinned packages' own .pth files still apply.
echo "import site; site.addsitedir('$shared')" > "$fresh_site/zz-zmrl-pinned-set.pth"

step "installing the wheel (offline; its requirements must already be met by the pinned set)"
(cd "$scratch" && "$venv/bin/python" -m pip --python "$fresh/bin/python" install -q --no-index "$wheel")

step "asserting the package, its entry points and zmrl come from the wheel"
(cd "$scratch" && "$fresh/bin/python" "$here/scripts/assert_installed_from.py" "$fresh_site" "$here" "$fresh/bin/zmrl")

step "zmrl selfcheck from the wheel"
(cd "$scratch" && "$fresh/bin/zmrl" selfcheck)

step "composing recipes from the wheel"
(cd "$scratch" && "$fresh/bin/zmrl" recipes show reinforce_zero zmrl.architecture=Qwen2ForCausalLM > "$scratch/shown.yaml")
grep -q "adv_estimator: reinforce_zero" "$scratch/shown.yaml"
command="$(cd "$scratch" && "$fresh/bin/zmrl" recipes run reinforce_zero zmrl.architecture=Qwen2ForCausalLM --dry-run)"
case "$command" in
  *"--config-path=$fresh_site/zero_mismatch_plugin/tools/recipes "*) echo "  $command" ;;
  *) echo "wheel check: the launch command does not use the wheel's recipes: $command" >&2; exit 1 ;;
esac

step "PASS"
