#!/usr/bin/env bash
# Fetches vLLM's own test suite (tests/ of the vLLM 0.33.0 sdist, or of the version given as
# the first argument: 0.33.0, 0.32.0 or 0.30.0) into the cache and prints the cached tree's path:
#   tests/vllm_upstream/fetch_sdist.sh [VERSION]
# ${HSCACHE_CACHE:-$HOME/.cache/hscache}/vllm-VERSION-src, holding the
# sdist's tests/ and pyproject.toml (pytest configuration) and nothing else — in particular
# not the sdist's vllm/ source tree, which would shadow the installed package.
# Nothing of vLLM is copied into the repository.
#
# How: the wheel has no tests, and the sdist's build cannot run here (its metadata step
# needs torch and CUDA tooling), so `pip download --no-clean` fetches the sdist through pip's
# own index configuration, checks its sha256 (--require-hashes), unpacks it, fails at the
# metadata step as expected, and leaves the unpacked tree in its temp dir, where we take it.
# pip runs from a throwaway venv (no torch there) so that the metadata step fails fast and
# the same way on every machine.
set -euo pipefail

VLLM_VERSION="${1:-0.33.0}"
case "$VLLM_VERSION" in
    0.33.0) VLLM_SDIST_SHA256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112 ;;
    0.32.0) VLLM_SDIST_SHA256=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad ;;
    0.30.0) VLLM_SDIST_SHA256=5f8f4e890c042ffa1c3e103f81c35e2d96f60a0a175ac43a4adbae7006bef62b ;;
    *)
        echo "[hscache] no sdist hash pinned for vLLM $VLLM_VERSION (0.33.0, 0.32.0 or 0.30.0)" >&2
        exit 2
        ;;
esac

cache="${HSCACHE_CACHE:-$HOME/.cache/hscache}"
dest="$cache/vllm-$VLLM_VERSION-src"
if [[ -f "$dest/.complete" ]]; then
    echo "$dest"
    exit 0
fi

python="${HSCACHE_PYTHON:-}"
if [[ -z "$python" ]]; then
    if command -v python3.11 >/dev/null 2>&1; then python=python3.11; else python=python3; fi
fi

mkdir -p "$cache"
exec 9>"$cache/.vllm-$VLLM_VERSION-sdist.lock"
flock 9
if [[ -f "$dest/.complete" ]]; then
    echo "$dest"
    exit 0
fi
work="$(mktemp -d "$cache/.vllm-sdist.XXXXXX")"
trap 'rm -rf "$work"' EXIT
t0=$SECONDS
echo "[hscache] fetching the vLLM $VLLM_VERSION sdist (~50 MB) for its tests" >&2

"$python" -m venv "$work/venv"
echo "vllm==$VLLM_VERSION --hash=sha256:$VLLM_SDIST_SHA256" >"$work/req.txt"
mkdir -p "$work/tmp"
# Expected to fail at "Preparing metadata"; success is judged by what it leaves behind.
TMPDIR="$work/tmp" timeout 900 "$work/venv/bin/python" -m pip --disable-pip-version-check \
    download --no-deps --no-binary :all: --no-build-isolation --no-clean --no-input \
    --require-hashes -r "$work/req.txt" -d "$work/dl" >"$work/pip.log" 2>&1 || true

src=""
for d in "$work"/tmp/pip-download-*/vllm_*; do
    if [[ -f "$d/PKG-INFO" && -f "$d/tests/v1/core/utils.py" ]]; then src="$d"; fi
done
if [[ -z "$src" ]] || ! grep -qx "Version: $VLLM_VERSION" "$src/PKG-INFO"; then
    echo "[hscache] could not obtain the vLLM $VLLM_VERSION sdist; pip said:" >&2
    tail -n 30 "$work/pip.log" >&2
    exit 1
fi

rm -rf "$dest.partial" "$dest"
mkdir -p "$dest.partial"
cp -a "$src/tests" "$src/pyproject.toml" "$src/PKG-INFO" "$dest.partial/"
touch "$dest.partial/.complete"
mv -T "$dest.partial" "$dest"
echo "[hscache] vLLM tests cached at $dest ($((SECONDS - t0)) s)" >&2
echo "$dest"
