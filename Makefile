# One entry point for humans and CI. `make demo` and `make test` work on a fresh clone.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.afl-installed
# torch and torchvision are pinned to the builds the test suite runs on (CHANGELOG.md); override
# TORCH_PINS to install others (for example a CUDA build at a site with a GPU).
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1

.PHONY: venv install demo test test-all lint typecheck proto proto-check clean images test-deploy

venv: $(STAMP)

# The Flower extra goes in with uv: flwr pins protobuf < 7, afl needs 7, and only uv applies the
# override in flower/overrides.txt (docs/flower.md §1).
$(STAMP): pyproject.toml Makefile flower/overrides.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q $(TORCH_PINS)
	$(BIN)/pip install -q -e '.[client,dp,lab,export,dev]' --config-settings editable_mode=strict
	$(BIN)/uv pip install -q --python $(BIN)/python --override flower/overrides.txt -r pyproject.toml --extra flower
	touch $@

# Strict editable installs link each file: re-link so new modules are importable and visible to mypy.
install: $(STAMP)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict

demo: install
	$(BIN)/afl demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	PATH="$(CURDIR)/$(BIN):$$PATH" scripts/check_proto_drift.sh

proto: install
	PATH="$(CURDIR)/$(BIN):$$PATH" scripts/gen_proto.sh

typecheck: install
	$(BIN)/mypy core crypto client server ops flower lab tests proto/afl/proto/wire.py

# -n auto: three pytest workers per two CPUs (pytest-xdist; tests/conftest.py says why);
# --dist loadfile keeps a module's tests, and the federation its module-scoped fixtures provision
# once, on one worker.
test: lint typecheck
	$(BIN)/pytest -m "not slow" -q -n auto --dist loadfile

test-all: lint typecheck
	$(BIN)/pytest -q -n auto --dist loadfile

# Container images from deploy/ (podman; docs/operations.md "Local federation with Docker
# Compose"): the base from Debian's packages when absent (mmdebstrap), then the coordinator's and
# the site's. CLIENT_BUILD_ARGS="--build-arg AFL_EXTRAS= --build-arg TORCH_INDEX=" builds the
# daemon-only site image (no torch).
BASE_IMAGE ?= localhost/afl-base:bookworm
CLIENT_BUILD_ARGS ?=
images:
	podman image exists $(BASE_IMAGE) || deploy/images/build-base.sh $(BASE_IMAGE)
	podman build --build-arg BASE_IMAGE=$(BASE_IMAGE) --ignorefile deploy/Dockerfile.server.dockerignore \
		-f deploy/Dockerfile.server -t afl-server:0.1.0 .
	podman build --build-arg BASE_IMAGE=$(BASE_IMAGE) $(CLIENT_BUILD_ARGS) \
		--ignorefile deploy/Dockerfile.client.dockerignore -f deploy/Dockerfile.client -t afl-client:0.1.0 .

# deploy/: the chart rendered and checked (docs/operations.md §15), then the images built and a
# masked federation run in them (slow; podman as root).
test-deploy: install
	$(BIN)/pytest -q tests/test_deploy_files.py tests/deploy

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
