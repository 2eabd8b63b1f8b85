#!/usr/bin/env bash
# `just gpu-wheels [DIR]`: downloads the wheels of bench/gpu_wheels.txt for the GPU image's Python
# (GPU_PYTHON, default 3.12) and platform (manylinux x86_64) into DIR (default .gpu-wheels,
# git-ignored), and prints the folder's size: a device call carries at most 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.gpu-wheels}
if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=${PYTHON:-python3}; fi
mapfile -t wheels < <(grep -v '^\s*#' bench/gpu_wheels.txt | grep -v '^\s*$')
rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
    --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 --platform any \
    -d "$dest.tmp" "${wheels[@]}"
got=$(ls "$dest.tmp"/*.whl | wc -l)
if [ "$got" -ne "${#wheels[@]}" ]; then
    echo "error: $got wheels downloaded for ${#wheels[@]} requirements in bench/gpu_wheels.txt" >&2
    exit 1
fi
rm -rf "$dest" && mv "$dest.tmp" "$dest"
bytes=$(du -sb "$dest" | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "$dest: $got wheels, $mib MiB (for Python ${GPU_PYTHON:-3.12}, manylinux x86_64; a device call carries 64 MiB)"
if [ "$bytes" -gt $((64 * 1048576)) ]; then
    echo "error: $dest is over 64 MiB; trim bench/gpu_wheels.txt" >&2
    exit 1
fi
