VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: venv test run bench calibrate clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,report,t5]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# the main job on the embedded emoji16 bundle: local Ray, examples/prompts.parquet, ./outputs/
run: $(STAMP)
	$(PY) -m jobs.generate $(ARGS)

calibrate: $(STAMP)
	$(PY) -m jobs.bench --calibrate

clean:
	rm -rf $(VENV) outputs
