# Build environment for batchfleet: libtorch comes from the project venv's PyTorch.
# Source it from the repository root: `. .ci/env.sh`.
BF_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
export VIRTUAL_ENV="$BF_ROOT/.venv"
export PATH="$BF_ROOT/.venv/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
