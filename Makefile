# batchfleet — the two commands on a fresh machine: `make demo` and `make test`.
#
# libtorch comes from the PyTorch wheel in .venv; the build finds it through
# the venv's python (LIBTORCH_USE_PYTORCH=1) and embeds its path in the binaries.
SHELL := /bin/bash
export VIRTUAL_ENV := $(CURDIR)/.venv
export PATH := $(CURDIR)/.venv/bin:$(PATH)
export LIBTORCH_USE_PYTORCH := 1

.PHONY: demo test wheel wheel-check fuzz chaos soak-faults soak-fleet cluster-test redis-failover-test redis-cluster-test slurm-test scale bench gpu-check gpu-bundle gpu-bundle-check torch-pairing-test deploy-check dist venv services tools build release fmt lint clean

## demo: set everything up, run a 200k-row job on two workers, print the summary
demo: venv release
	.ci/demo.sh

## test: formatting, lints and every test (unit and integration) against real services
test: venv services tools
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo build --workspace --bins
	cargo test --workspace --all-targets
	BATCHFLEET_BIN_DIR=$(CURDIR)/target/debug python -m pytest -q -p no:cacheprovider coordinator/python/tests

## wheel: dist/batchfleet-<version>-py3-none-linux_<arch>.whl — the commands and the Python package; requires the exact torch it was built against (docs/python.md)
wheel: venv release
	python .ci/wheel.py

## wheel-check: installs the wheel into a fresh venv and runs a job with its commands and its package, --local and on a fleet
wheel-check: wheel services
	.ci/wheel-check.sh

## chaos: a 200k-row job while workers, the coordinator, RabbitMQ and Redis are killed/restarted; checks the invariants
chaos: venv services release
	target/release/batchfleet-loadtest chaos $(CHAOS_ARGS)

## soak-faults: 20 minutes of jobs of many models on workers restarted as a supervisor would, with crashing items, Redis restarted empty, queues deleted and forged dead letters replayed; checks every job (SOAK_ARGS="--duration 90s" for the short form)
soak-faults: venv services release
	target/release/batchfleet-loadtest soak --faults $(SOAK_ARGS)

SOAK_FLEET_WORKERS ?= 500
## soak-fleet: a simulated fleet of 500 real workers, many to a process, running 20 jobs of 10^6 one-row items in all together; prints per item the Redis commands and requests, AMQP messages and bytes, syncs and CPU by part, Redis's p99, spurious copies and the idle fleet's background Redis commands against docs/scaling.md's targets, and checks every job (SOAK_FLEET_WORKERS=100 SOAK_FLEET_ARGS="--processes 2 --jobs 10 --items 20000 --idle 5s" for the short form)
soak-fleet: venv services release
	target/release/batchfleet-loadtest soak --simulated $(SOAK_FLEET_WORKERS) $(SOAK_FLEET_ARGS)

## cluster-test: a 200k-row job on a three-node RabbitMQ cluster of its own while the queue's leader node is killed and restarted; checks exactly-once and reconnection
cluster-test: venv services release
	target/release/batchfleet-loadtest cluster $(CLUSTER_ARGS)

## redis-failover-test: jobs on a Redis primary + replica + 3 Sentinels of their own while the primary is killed, then while a failover loses its last writes; checks exactly-once and the counts
redis-failover-test: venv services release
	target/release/batchfleet-loadtest redis-failover $(REDIS_FAILOVER_ARGS)

## redis-cluster-test: two jobs on a Redis Cluster of three masters of their own; checks exactly-once and that each job's keys share one slot
redis-cluster-test: venv services release
	target/release/batchfleet-loadtest redis-cluster $(REDIS_CLUSTER_ARGS)

## slurm-test: a 200k-row job through docker/slurm's templates on a Slurm controller and node of its own (Debian's slurm-wlm, slurmdbd and munge, installed when missing) while one worker task reaches its time limit, one is preempted by signal and one by a higher-priority job, and one CPU task's worker is killed with SIGKILL (restarted in place), then a job whose item 2 kills every worker that runs it on a two-task array (the item failed as crash, both tasks still running); checks exactly-once, drains with exit 0, requeues, sacct's record, and that the daemons are gone at the end
slurm-test: venv services release
	.ci/ensure-slurm.sh
	target/release/batchfleet-loadtest slurm $(SLURM_ARGS)

## scale: items/s, Redis commands and bytes, AMQP messages and bytes, and CPU per item as the fleet grows to 32 workers — the inputs of docs/scaling.md (SCALE_ARGS=--quick for the CI form)
scale: venv services release
	target/release/batchfleet-loadtest scale $(SCALE_ARGS)

## bench: the fleet against the compute and I/O ceilings, the control plane and memory (a few minutes; BENCH_ARGS=--quick for the short form)
bench: venv services release
	target/release/batchfleet-loadtest bench $(BENCH_ARGS)

## fuzz: the model-archive reader under cargo-fuzz (libFuzzer + AddressSanitizer, nightly) for FUZZ_SECONDS (default 60) from real and truncated archives
fuzz: venv
	.ci/fuzz.sh

## gpu-check: on a machine with a GPU, the fleet against raw forward on it and the GPU's idle share (under four minutes); without one it says so (GPU_CHECK_ARGS=--local: no services; an MLP, a sentence encoder and an image CNN through run --local against host-fed and device-resident forward, in float32, float32 with TF32 and bfloat16, under six minutes; on the CPU for a minute or two where there is no GPU)
gpu-check: venv services release
	target/release/batchfleet-loadtest gpu-check $(GPU_CHECK_ARGS)

## gpu-bundle: dist/batchfleet-bundle-torch$(TORCH).tar.zst (and .tar.gz) — the binaries built against PyTorch $(TORCH)'s libtorch, for a machine that has that PyTorch and nothing else (docs/deploy.md)
gpu-bundle:
	.ci/gpu-bundle.sh

## gpu-bundle-check: builds the bundle (TORCH, default 2.11.0), unpacks it beside a fresh venv holding only that torch and runs its gpu-check --local there (downloads a second PyTorch; not in CI)
gpu-bundle-check:
	.ci/gpu-bundle-check.sh

## torch-pairing-test: the test suite against PyTorch $(TORCH)'s libtorch through the bundle's ported torch-sys (after make gpu-bundle TORCH=...; builds everything a second time; not in CI)
torch-pairing-test: services
	.ci/torch-pairing-test.sh

## deploy-check: docker/ validated without Docker (compose config, hadolint, kubernetes-validate, systemd-analyze)
deploy-check: venv release
	.ci/check-deploy.sh

## dist: the release tarball for VMs (dist/batchfleet-<version>-linux-<arch>.tar.gz + SHA256SUMS; docker/vm/cloud-init.yaml installs it)
dist: venv
	.ci/dist.sh

venv:
	.ci/ensure-venv.sh

services:
	.ci/ensure-services.sh

tools:
	.ci/ensure-tools.sh

build: venv
	cargo build --workspace

release: venv
	cargo build --release --workspace --bins

fmt:
	cargo fmt --all

lint: venv
	cargo clippy --workspace --all-targets -- -D warnings

clean:
	cargo clean
	rm -rf demo dist
