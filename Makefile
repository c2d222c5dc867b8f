VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: venv test run bench calibrate scale chaos clean

$(STAMP): pyproject.toml infra/docker/requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	# the pinned versions first (the job image's), so tests run what ships, not the newest release a range admits
	$(PIP) install -q -r infra/docker/requirements.txt
	$(PIP) install -q -e '.[dev,report,t5]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# the main job on the embedded emoji16 bundle: local Ray, examples/prompts.parquet, ./outputs/
run: $(STAMP)
	$(PY) -m jobs.generate $(ARGS)

# the side-by-side benchmark (docs/bench.md): images/s of ar, eagle2 and adt with 1 and 8 images in
# flight, same prompts and seeds, engine alone; a few minutes on a laptop CPU. Override with
# BENCH_ARGS, e.g. make bench BENCH_ARGS="--batches 1,4,16,64 --passes 2"
BENCH_ARGS ?= --batches 1,8 --min-images 8 --passes 1 --temperatures 0
BENCH_OUT ?= outputs/bench
bench: $(STAMP)
	mkdir -p $(BENCH_OUT)
	rm -f $(BENCH_OUT)/throughput.json
	$(PY) -m jobs.bench --throughput $(BENCH_ARGS) --json $(BENCH_OUT)/throughput.json --chart $(BENCH_OUT)/throughput.png

# the pipeline's own ceiling (docs/pipeline.md, "Scale"): synthetic prompt sets through the real job
# with a null engine (jobs/scale.py), local folder then the loopback S3 server; one JSON line per size
SCALE_ROWS ?= 10000,100000,1000000
SCALE_OUT ?= outputs/scale
scale: $(STAMP)
	mkdir -p $(SCALE_OUT)
	$(PY) -m jobs.scale --rows $(SCALE_ROWS) --json $(SCALE_OUT)/scale.jsonl
	$(PY) -m jobs.scale --rows $(SCALE_ROWS) --json $(SCALE_OUT)/scale.jsonl --s3 moto

calibrate: $(STAMP)
	$(PY) -m jobs.bench --calibrate

clean:
	rm -rf $(VENV) outputs

# faults injected into the real job on a multi-node Ray cluster on this machine (jobs/chaos.py,
# docs/deploy.md): a seeded RNG kills actors, nodes, the S3 server and the driver; every run
# must end with every prompt exactly once
CHAOS_ARGS ?= --runs 20 --seed 0
chaos: $(STAMP)
	$(PY) -m jobs.chaos $(CHAOS_ARGS)
