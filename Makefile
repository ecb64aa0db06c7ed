# extree: the two commands.  Both install what they need (scripts/setup-host.sh)
# and are idempotent.
#
#   make          build everything (core, QEMU with extree) and run the demo
#   make check    build everything and run every test (unit tests, iotests)
#   make bench    benchmarks (see docs/performance.rst)
#
# The real entry point is the top-level meson.build: these targets only set
# up the host and the meson build directory, then call meson.

CORE := build/core

.PHONY: all demo check setup core qemu bench clean libvirt

all: demo

setup:
	@scripts/setup-host.sh

$(CORE)/build.ninja: | setup
	meson setup $(CORE)

core: setup $(CORE)/build.ninja
	meson compile -C $(CORE)

qemu: core
	meson compile -C $(CORE) qemu

demo: qemu
	scripts/demo.sh

check: qemu
	scripts/check.sh

bench: qemu
	scripts/bench.sh $(BENCH_ARGS)

# libvirt 11.3 with patches/libvirt (docs/libvirt.rst); make check builds it
libvirt: setup
	scripts/build-libvirt.sh

clean:
	rm -rf build/core build/qemu build/iotests
