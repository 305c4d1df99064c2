#!/usr/bin/env bash
# `make gpu-bundle-check TORCH=2.11.0`: the bundle is portable. Builds it
# (.ci/gpu-bundle.sh), unpacks it into an empty folder beside a fresh
# virtual environment holding only torch==$TORCH, and there:
# - the launcher refuses, with the reason, a python3 without torch and a
#   torch of another version;
# - `bin/batchfleet --version` runs;
# - `bin/batchfleet-loadtest gpu-check --local` runs its jobs (on the CPU
#   where no GPU is visible), each checked against that PyTorch's output.
# Not in .ci/run: it downloads a second PyTorch.
set -euo pipefail
cd "$(dirname "$0")/.."
torch=${TORCH:-2.11.0}
export TORCH=$torch
.ci/gpu-bundle.sh
name="batchfleet-bundle-torch$torch"
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
if [ -f "dist/$name.tar.zst" ]; then
  archive="dist/$name.tar.zst"
  zstd -dc "$archive" | tar -C "$dir" -xf -
else
  archive="dist/$name.tar.gz"
  tar -C "$dir" -xzf "$archive"
fi
bundle="$dir/$name"
echo "gpu-bundle-check: a fresh virtual environment with torch==$torch only"
python3 -m venv "$dir/venv"
"$dir/venv/bin/pip" install -q "torch==$torch"
"$dir/venv/bin/pip" list 2>/dev/null | sed -n 's/^\(torch\) *\(.*\)/  \1 \2/p'
clean_path="/usr/local/bin:/usr/bin:/bin"

# A python3 without torch: refused with what to do.
python3 -m venv "$dir/bare"
if out=$(PATH="$dir/bare/bin:$clean_path" "$bundle/bin/batchfleet" --version 2>&1); then
  echo "error: the launcher ran without a torch package: $out" >&2; exit 1
fi
grep -q "no PyTorch found" <<<"$out" || { echo "error: unexpected refusal: $out" >&2; exit 1; }
echo "  without torch: refused ($out)"
# A torch of another version: refused, naming both.
if [ -x .venv/bin/python ]; then
  other=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
  if [ "$other" != "$torch" ]; then
    if out=$(BATCHFLEET_PYTHON=.venv/bin/python "$bundle/bin/batchfleet" --version 2>&1); then
      echo "error: the launcher ran against torch $other: $out" >&2; exit 1
    fi
    grep -q "built against PyTorch $torch" <<<"$out" || { echo "error: unexpected refusal: $out" >&2; exit 1; }
    echo "  with torch $other: refused"
  fi
fi

cd "$dir"
PATH="$dir/venv/bin:$clean_path" "$bundle/bin/batchfleet" --version
# shellcheck disable=SC2086 # GPU_CHECK_ARGS: several flags
PATH="$dir/venv/bin:$clean_path" "$bundle/bin/batchfleet-loadtest" gpu-check --local --json "$dir/figures.json" ${GPU_CHECK_ARGS:-}
echo "gpu-bundle-check: the bundle built against torch $torch runs against a fresh torch==$torch ($archive, $(stat -c %s "$OLDPWD/$archive") bytes)"
