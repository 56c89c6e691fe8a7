# Two entry points for a new user: `make demo` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
XLA_FLAGS_8 := --xla_force_host_platform_device_count=8

.PHONY: demo test test-emu test-emu-asan install build clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# With nvcc present, the `cuda` extra brings NVSHMEM so the internode kernels build too.
comma := ,
EXTRAS := test$(if $(shell command -v nvcc 2>/dev/null),$(comma)cuda)

# Build deps go into the venv so the extension builds without an isolated env.
$(STAMP): $(VPY) pyproject.toml CMakeLists.txt
	$(VPY) -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" "jax>=0.10.2" ninja cmake
	$(VPY) -m pip install -q --no-build-isolation -e '.[$(EXTRAS)]'
	touch $(STAMP)

install: $(STAMP)

# Rebuild the extension from the current sources (C++/CUDA edits).
build: $(STAMP)
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .
	$(VPY) -c "import jax_ep, json; print(json.dumps(jax_ep.build_info()))"

# Two pytest workers (pytest-xdist): most tests hold one core (the emulator's scheduler,
# XLA's compiles), so two share the 2-core CI machines. TEST_JOBS=0 runs in one process.
TEST_JOBS ?= 2
test: build
	XLA_FLAGS=$(XLA_FLAGS_8) $(VPY) -m pytest -q -x -n $(TEST_JOBS) tests

# The CUDA kernel sources on the emulated GPU (kernels/emu): the whole matrix.
test-emu: build
	XLA_FLAGS=$(XLA_FLAGS_8) $(VPY) -m pytest -q -x tests/emu

# The same under AddressSanitizer and UndefinedBehaviorSanitizer: a separate build of the
# emulated module only (build/emu-asan), loaded by the tests through JAX_EP_EMU_MODULE_DIR.
EMU_ASAN_DIR := build/emu-asan
test-emu-asan: $(STAMP)
	PATH=$(abspath $(VENV))/bin:$$PATH cmake -S . -B $(EMU_ASAN_DIR) -G Ninja -DJAX_EP_CUDA=OFF \
	  -DPython_EXECUTABLE=$(abspath $(VPY)) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DJAX_EP_EMU_SANITIZE=address,undefined -DJAX_EP_EMU_OCCUPANCY=table
	PATH=$(abspath $(VENV))/bin:$$PATH ninja -C $(EMU_ASAN_DIR) _jax_ep_emu
	JAX_EP_EMU_MODULE_DIR=$(abspath $(EMU_ASAN_DIR)) \
	  LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  XLA_FLAGS=$(XLA_FLAGS_8) $(VPY) -m pytest -q -x -p no:cacheprovider tests/emu

demo: $(STAMP)
	XLA_FLAGS=$(XLA_FLAGS_8) $(VPY) examples/train_moe.py --out runs/moe_demo

clean:
	rm -rf build $(VENV)
