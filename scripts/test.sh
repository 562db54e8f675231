#!/usr/bin/env bash
# The test command (README, CI): build, run every test (GPU tests skip without a GPU), fuzz the
# parsers of untrusted input for a bounded time, check formatting.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Test-only references from PyPI: Hugging Face tokenizers (tests/tokenizer/compare_hf.py), Jinja2,
# which Hugging Face renders chat templates with (tests/chat_template/render_reference.py), and the
# official OpenAI client, which talks to `tpmoe serve` (tests/serve/test_openai_client.py).
python3 -m pip install -q tokenizers==0.22.1 jinja2==3.1.6 openai==1.109.1
jobs=$(nproc)
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 600

# The CPU-only build (what a machine without the CUDA toolkit makes) must build every target too;
# without the toolkit the build above already was that one.
if command -v nvcc >/dev/null && [ "${TPMOE_SKIP_CPU_ONLY_BUILD:-0}" != 1 ]; then
  cmake -S . -B build-cpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTPMOE_CUDA=OFF >/dev/null
  cmake --build build-cpu -j "$jobs"
  echo "cpu-only build: every target built"
fi

# libFuzzer targets (clang, ASan + UBSan): the parsers of untrusted input - the safetensors header,
# config.json, request bodies, and model replies read for tool calls and reasoning. An input that
# takes more than 10 s is a finding too (a hang).
fuzz_seconds=${TPMOE_FUZZ_SECONDS:-60}
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DTPMOE_FUZZ=ON >/dev/null
cmake --build build-fuzz -j "$jobs"
for target in safetensors_header config api_request reply_parsers; do
  corpus=$(mktemp -d)
  cp fuzz/corpus/"$target"/* "$corpus"/
  echo "fuzz_$target: ${fuzz_seconds}s"
  ./build-fuzz/fuzz_"$target" -max_total_time="$fuzz_seconds" -timeout=10 -print_final_stats=0 "$corpus" 2>&1 | tail -n 2
  rm -rf "$corpus"
done

# Formatting is checked, not applied.
git ls-files '*.cpp' '*.h' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror
echo "all checks passed"
