#!/usr/bin/env bash
# Run HERE (the CPU machine, with package registries) before a GPU session: fills the git-ignored folders that
# `scripts/gpu_run.sh` needs on the GPU machine, which has PyTorch, Triton and transformers but no internet.
#
#   .whl/          the Python packages the GPU image lacks, as CPython 3.12 manylinux wheels (~10 MiB)
#   .gpu_model/a   .gpu_model/b   the embedded model's GGUF (98 MB) in two halves: one device call carries at
#                  most 64 MiB, so the halves travel in two calls and are joined there (`gpu_run.sh model-a`,
#                  then `gpu_run.sh model-b ...` within the machine's warm window)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu_model/' .git/info/exclude 2>/dev/null || echo '/.gpu_model/' >> .git/info/exclude

# What engine_server, ladle_kernels, benchmarks and the tests import beyond the GPU image's packages (see the device
# tool's KINDS.md): pinned to what the project's CPU environment uses where the version matters. grpcio itself is
# the image's: its 7 MB wheel would take the first call's carry (with the model's first half) over 64 MiB.
WHEELS=(gguf structlog "grpcio-health-checking==1.85.1" "grpcio-reflection==1.85.1"
        "protobuf>=7.35.1,<8" xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection)
rm -rf .whl && mkdir -p .whl
for wheel in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$wheel"
done
du -sh .whl

gguf=$(.venv/bin/python - <<'PY'
from engine_server.loader.resolve import default_gguf_path
print(default_gguf_path())
PY
)
rm -rf .gpu_model && mkdir -p .gpu_model
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
head -c "$half" "$gguf" > .gpu_model/a
tail -c +"$((half + 1))" "$gguf" > .gpu_model/b
echo "$(basename "$gguf")" > .gpu_model/name
sha256sum "$gguf" | cut -d' ' -f1 > .gpu_model/sha256
ls -la .gpu_model
