# `make run`: set up and train the default job on 2 workers. `make test`: set up, build the docs, run every test.
# `make test-fast`: only the tests that start no job (markers unit and ranks). `make docs`: the documentation site
# into site/ (warnings are errors). `make conformance`: torch's own c10d tests against the ringtrain_shm backend.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# One compute thread per worker: workers are pinned one per core.
export OMP_NUM_THREADS ?= 1

.PHONY: install run test test-fast docs clean conformance

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# Pinned: these releases are on this machine's disk; an open range would download a newer multi-GB build.
	$(BIN)/python -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install --quiet -e '.[dev,docs]'
	# shm's native all-reduce (C++, ~30 s with g++): built now so no job waits; without a compiler, one warning line.
	$(BIN)/python -m ringtrain.comm.shm_native || true
	# DeepSpeed's CPU shm op, which `bench collectives` measures beside ringtrain's (~25 s with g++, cached in
	# ~/.cache/torch_extensions): built now rather than while the tests run; without it, one note.
	DS_ACCELERATOR=cpu $(BIN)/python -c "from ringtrain.bench import deepspeed_shm; deepspeed_shm.build()" >/dev/null 2>&1 || \
		echo "note: DeepSpeed's shm op did not build (bench collectives --algorithms deepspeed will say why)"
	# Open MPI, measured beside ringtrain by `ringtrain bench collectives --algorithms ...,openmpi` (optional):
	# Debian's packages where this runs as root with apt, then mpi4py built against them; else one note.
	command -v mpicc >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null 2>&1; } || true
	command -v mpicc >/dev/null && $(BIN)/python -m pip install --quiet -e '.[mpi]' || \
		echo "note: Open MPI not installed (bench --algorithms openmpi needs: apt-get install openmpi-bin libopenmpi-dev; pip install -e '.[mpi]')"
	touch $(STAMP)

run: install
	$(BIN)/ringtrain train configs/digits_mlp.toml --nproc 2 --run-dir runs/digits_mlp-$$(date +%Y%m%d-%H%M%S)

# --strict without --quiet: --quiet drops the warnings before --strict counts them, and the build passes.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

test: install
	# The documentation site first (~20 s, `make docs`: a broken link or anchor, or a page outside the nav, fails it;
	# not --quiet, which hides the warnings that --strict counts), then the tests in two phases. First every test
	# that may share the machine, three test processes side by side on the two cores (pytest-xdist), a module to
	# each: most of a test's time is waiting, so a third overlaps it. Then the tests marked exclusive, one after
	# another in one process: scattered among the others, each one stopped the two other test processes while it
	# ran and while the tests beside it finished (29 min of waiting a run).
	# The site and both phases always run; the target fails if any of them did.
	# Bytecode first: the suite starts ~900 Python processes, and where PYTHONDONTWRITEBYTECODE is set (as on
	# this project's machines) each one compiled ringtrain's modules afresh: 0.2 s of CPU a process (a 2-worker
	# job: 6.1 s of CPU with the bytecode, 6.7 s without, alternated four times).
	$(BIN)/python -m compileall -q ringtrain tests
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site; docs=$$?; \
	$(BIN)/python -m pytest -n 3 --dist loadscope -m "not exclusive"; shared=$$?; \
	$(BIN)/python -m pytest -m exclusive; alone=$$?; \
	test $$docs -eq 0 && test $$shared -eq 0 && test $$alone -eq 0

# The tests that start no job, host or CLI (cost markers unit and ranks, tests/conftest.py COSTS), with the shared
# phase's processes side by side; the few of them marked exclusive still run alone (the lock, not a phase).
test-fast: install
	$(BIN)/python -m pytest -n 3 --dist loadscope -m "unit or ranks"

# torch's own c10d tests (DistributedTest._DistTestBase, the set Gloo passes) against ringtrain_shm at 2, 3 and 4
# ranks (tests/conformance/: the driver, run.py, and the explained exclusions, exclusions.py). Long: every test
# forks its ranks afresh. Counts and failed tests go to conformance-results.json; its per-op share
# (tests/conformance/test_conformance_ops.py, ~35 s) runs in `make test`. A subset: make conformance CONFORMANCE_WORLD_SIZES=2 CONFORMANCE_K="all_reduce or broadcast".
CONFORMANCE_WORLD_SIZES ?= 2,3,4
CONFORMANCE_K ?=
conformance: install
	$(BIN)/python -m tests.conformance.run --world-sizes $(CONFORMANCE_WORLD_SIZES) --out conformance-results.json \
		$(if $(CONFORMANCE_K),-k "$(CONFORMANCE_K)")

clean:
	rm -rf $(VENV) runs site .pytest_cache .hypothesis
