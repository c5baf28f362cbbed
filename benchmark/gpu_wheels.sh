#!/usr/bin/env bash
# Download, on a machine with a package index, the wheels that benchmark/gpu_check.sh needs on a
# CUDA machine without one: the runtime dependencies of activationscope that its image lacks,
# for CPython 3.12 (PYVER) on manylinux x86_64, one version of each, without their own dependencies
# (the image has numpy, packaging, typing-extensions, pyyaml, pyarrow, fsspec, tqdm, pytest,
# pytest-timeout and hypothesis). gpu_check.sh installs every wheel of the folder with
# `pip install --no-index --no-deps --target`. Run from anywhere: bash benchmark/gpu_wheels.sh
#
#   PY      python whose pip downloads (default: .venv/bin/python if present, else python3)
#   WHEELS  folder to fill (default: .whl at the repository root, ignored by git)
#   PYVER   the Python version of the wheels (default 3.12, the CUDA machine's; another one serves a
#           dry run of gpu_check.sh with another python)
#
# The versions are those of the development environment (zarr 3.1.x as pyproject.toml asks).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WHEELS=${WHEELS:-.whl}
PYVER=${PYVER:-3.12}
PACKAGES=(zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0)
mkdir -p "$WHEELS"
# one version of each: a wheel of another version of the same package, left from an earlier
# download, would make the install there refuse the whole folder
for spec in "${PACKAGES[@]}"; do
  name=${spec%%==*}; version=${spec#*==}; stem=${name//-/_}
  for f in "$WHEELS"/*.whl; do
    [ -e "$f" ] || continue
    base=$(basename "$f")
    if [[ ${base,,} == "${stem,,}"-* && $base != "$stem-$version-"* && $base != "${name}-$version-"* ]]; then
      echo "removing $base (another version of $name)"; rm -f "$f"
    fi
  done
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$WHEELS" "${PACKAGES[@]}"
ls -l "$WHEELS"/*.whl
n=$(ls "$WHEELS"/*.whl | wc -l)
[ "$n" -eq "${#PACKAGES[@]}" ] || { echo "expected ${#PACKAGES[@]} wheels in $WHEELS, found $n" >&2; exit 1; }
echo "total: $(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1) bytes in $n wheels (the working tree that travels must stay under 64 MiB)"
