# mlm developer tasks. `just setup` is idempotent; every other recipe runs it first.
# On a CPU machine torch is pinned to the CPU wheel (TORCH_SPEC); a machine that already has
# a torch in .venv keeps it.

set shell := ["bash", "-euo", "pipefail", "-c"]

python := env_var_or_default("PYTHON", "python3")
torch_spec := env_var_or_default("TORCH_SPEC", "torch==2.13.0")
venv := ".venv"
bin := venv / "bin"

# Create .venv and install mlm with its test tools (fast when already done).
setup:
    #!/usr/bin/env bash
    set -euo pipefail
    if [ ! -x {{bin}}/python ]; then {{python}} -m venv {{venv}}; fi
    if ! {{bin}}/python -c "import torch" 2>/dev/null; then
        {{bin}}/pip install -q "{{torch_spec}}"
    fi
    stamp={{venv}}/.mlm-installed
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        {{bin}}/pip install -q -e ".[dev]"
        touch "$stamp"
    fi

# End-to-end demo on the embedded default (the tiny pipeline, CPU).
demo: setup
    PATH="$PWD/{{bin}}:$PATH" bash pipelines/tiny/run.sh

# Fine-tune an imported Hugging Face model on conversations, export it back (pipelines/sft).
sft: setup
    PATH="$PWD/{{bin}}:$PATH" bash pipelines/sft/run.sh

# The whole test suite (CPU; GPU tests skip without CUDA), with the 25 slowest listed.
test *ARGS: setup
    {{bin}}/python -m pytest -q --durations=25 {{ARGS}}

# The edit loop: tests/unit only (one process each, no multi-rank runs; under 3 minutes on 2 cores).
test-fast *ARGS: setup
    {{bin}}/python -m pytest -q --durations=10 tests/unit {{ARGS}}

# Lint and format check.
lint: setup
    {{bin}}/ruff check .
    {{bin}}/ruff format --check .

# Benchmarks recorded in bench/RESULTS.md.
bench: setup
    {{bin}}/python bench/data_build.py
    {{bin}}/python bench/sample_index.py
    {{bin}}/python bench/train_step.py
    {{bin}}/python bench/parallel_overhead.py
    {{bin}}/python bench/pipeline_bubble.py
    {{bin}}/python bench/convert.py
    {{bin}}/python bench/serve.py
    {{bin}}/python bench/moe.py
    {{bin}}/python bench/context_parallel.py
    {{bin}}/python bench/sft.py

# Every CUDA path against its reference and the headline GPU figures in one report
# (bench/gpu_check.py; no setup: a GPU image runs it with its own python3). `--dry-run`: the same
# sections on CPU with tiny shapes (the test suite runs it).
gpu-check *ARGS:
    bash bench/gpu_check.sh {{ARGS}}

# The wheels gpu-check installs on a GPU image that lacks them, into .gpu-wheels/ (size printed).
gpu-wheels *ARGS:
    bash bench/gpu_wheels.sh {{ARGS}}
