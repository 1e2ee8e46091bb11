# Two commands set everything up on a fresh machine (Python 3.11 + Java 17):
#   make demo   - synthetic log -> build -> expand on local Spark with Delta
#                 (make demo-remote: the same with every output on a MiniDFSCluster)
#   make test   - ruff, then the test suite
# Both create .venv from the lock file if missing, fetch Delta's jars and the
# petastorm side environment. Nothing needs installing by hand.

PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
UV_VERSION := 0.13.9
STAMP := $(VENV)/.installed
PETA := .venv-petastorm
PETA_STAMP := $(PETA)/.installed
DEMO ?= demo

.PHONY: demo demo-remote test setup jars lock clean bench compat

setup: $(STAMP) $(PETA_STAMP) jars

$(STAMP): requirements.lock requirements-nodeps.lock pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv==$(UV_VERSION)
	$(BIN)/uv pip sync -q --python $(BIN)/python requirements.lock
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps -r requirements-nodeps.lock
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps -e .
	touch $(STAMP)

# petastorm needs pyarrow 14 / numpy 1.26: its own small environment, used by
# the tests as a second, independent reader of our shards.
$(PETA_STAMP): requirements-petastorm.lock $(STAMP)
	test -x $(PETA)/bin/python || $(PY) -m venv $(PETA)
	$(BIN)/uv pip sync -q --python $(PETA)/bin/python requirements-petastorm.lock
	$(BIN)/uv pip install -q --python $(PETA)/bin/python --no-deps petastorm==0.12.1
	touch $(PETA_STAMP)

jars: $(STAMP)
	$(BIN)/userwise jars >/dev/null
	$(BIN)/python -m userwise.pipelines.tools.hdfs_store >/dev/null  # the HDFS minicluster (tests/remote, make demo-remote)
	$(BIN)/python -m userwise.pipelines.tools.s3_store >/dev/null  # Spark's S3 connector, 13 MB (s3a://; tests/remote/test_s3_store.py)

# pytest exits 5 when it collected no test: that is a failure here, never a pass.
# Two pytest-xdist workers, a test file per worker at a time (module fixtures such as a
# chain of daily runs or a standalone cluster are built once). In one process the Spark
# tests left a quarter of two cores idle (JVM start-ups, small jobs): 18 minutes, against
# 14 with two workers. TEST_WORKERS=0 runs everything in one process.
# ruff (lint and import order, pyproject's [tool.ruff]) runs first; its failure fails the target.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/ruff check .
	@$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest ran no test" >&2; exit 1; fi; exit $$rc

demo: setup
	$(BIN)/python -m userwise.pipelines.tools.demo --output $(DEMO)

# The demo from cluster storage: a MiniDFSCluster under $(DEMO)/hdfs holds the logs, the
# tables, the reports and the shards; stage pulls node 0 into $(DEMO)/nvme.
demo-remote: setup
	$(BIN)/python -m userwise.pipelines.tools.demo --output $(DEMO) --remote hdfs

bench: setup
	$(BIN)/python benchmarks/build_bench.py

# The loader against the oldest versions the metadata admits, outside the suite: the wheel
# that `userwise ship` builds into dist/, with the [loader] extra, in a fresh .venv-compat
# (no Spark), every requirement of the core and the loader at its floor in pyproject.toml
# (torch 2.6, pyarrow 16, numpy 2.0, numba 0.60, ...), pytest and psutil at the lock's
# versions; then tests/loader. No sdist is built (--no-build). COMPAT_VERSIONS=lock installs the lock's versions instead, e.g. on the
# newest supported Python: make compat COMPAT_VERSIONS=lock COMPAT_PY=python3.13
COMPAT := .venv-compat
COMPAT_PY ?= $(PY)
COMPAT_VERSIONS ?= floors
compat: $(STAMP)
	$(BIN)/userwise ship
	rm -rf $(COMPAT)
	$(COMPAT_PY) -m venv --without-pip $(COMPAT)
	$(BIN)/python -m tests.support.metadata $(COMPAT_VERSIONS) --extra loader --locked pytest psutil > $(COMPAT)/constraints.txt
	$(BIN)/uv pip install -q --no-build --python $(COMPAT)/bin/python -c $(COMPAT)/constraints.txt \
		"$$(ls dist/userwise-*.whl)[loader]" pytest psutil
	$(COMPAT)/bin/python -I -c "import importlib.util as u, importlib.metadata as m, sys; \
		assert u.find_spec('pyspark') is None, 'pyspark in $(COMPAT)'; \
		print('compat:', sys.version.split()[0], *(f'{n}=={m.version(n)}' for n in \
		('userwise', 'torch', 'pyarrow', 'numpy', 'numba', 'pyyaml', 'xxhash', 'fsspec')))"
	$(COMPAT)/bin/python -m pytest -q -p no:cacheprovider tests/loader -m "not spark"

# Regenerate the lock files after changing pyproject.toml.
lock: $(STAMP)
	$(BIN)/uv pip compile -q --python $(BIN)/python --extra all pyproject.toml -o requirements.lock
	$(BIN)/uv pip compile -q --python $(PETA)/bin/python requirements-petastorm.in -o requirements-petastorm.lock

clean:
	rm -rf $(VENV) $(PETA) $(COMPAT) $(DEMO) .pytest_cache
