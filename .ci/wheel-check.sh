#!/usr/bin/env bash
# The wheel as a user gets it: installs dist/batchfleet-*.whl (make wheel)
# into a fresh virtual environment with pip (torch comes from its pip
# dependency), checks that the binaries find libtorch only through their
# $ORIGIN-relative rpath, that the commands are on the venv's PATH and run,
# then runs .ci/wheel_check.py with the venv's Python: a Parquet job whose
# model is an object on a local S3 server (moto), --local and on two workers
# started from the venv's batchfleet-worker, read back with the package and
# with pandas, against PyTorch's predictions.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
whl=$(ls dist/batchfleet-*.whl 2>/dev/null | head -1)
[ -n "$whl" ] || { echo "error: no dist/batchfleet-*.whl; run make wheel" >&2; exit 1; }
.ci/ensure-services.sh >/dev/null
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
echo "== pip install $whl into a fresh venv"
start=$SECONDS
"$work/venv/bin/pip" install --quiet --disable-pip-version-check "$whl"
echo "installed in $((SECONDS - start)) s"
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
for b in batchfleet batchfleet-worker batchfleet-loadtest; do
  rpath=$(readelf -d "$site/batchfleet/_bin/$b" | sed -n 's/.*R\(UN\)\?PATH.*\[\(.*\)\]/\2/p')
  [ "$rpath" = '$ORIGIN/../../torch/lib' ] || { echo "error: $b has rpath '$rpath'" >&2; exit 1; }
done
echo "== the commands, from the venv's bin/ alone"
env -i HOME="$HOME" PATH="$work/venv/bin:/usr/bin:/bin" batchfleet --version
env -i HOME="$HOME" PATH="$work/venv/bin:/usr/bin:/bin" batchfleet-worker --version
env -i HOME="$HOME" PATH="$work/venv/bin:/usr/bin:/bin" batchfleet-loadtest --help >/dev/null
echo "== a Parquet job whose model is in S3 (a local moto server), through the package, --local and on a fleet"
job="$work/job"
.venv/bin/python loadtest/python/make_job.py --out "$job" --rows 20000 --files 2 --format parquet \
  --item-rows 2500 --name wheel >/dev/null
port=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
.venv/bin/moto_server -H 127.0.0.1 -p "$port" >/dev/null 2>&1 &
moto=$!
trap 'kill $moto 2>/dev/null; rm -rf "$work"' EXIT
export AWS_ENDPOINT_URL="http://127.0.0.1:$port" AWS_ALLOW_HTTP=true AWS_ACCESS_KEY_ID=testing \
  AWS_SECRET_ACCESS_KEY=testing AWS_REGION=us-east-1
for _ in $(seq 100); do curl -fs "$AWS_ENDPOINT_URL" >/dev/null && break; sleep 0.1; done
mkdir "$job/models" && mv "$job/model.pt" "$job/models/"
.venv/bin/python loadtest/python/s3_put.py --endpoint "$AWS_ENDPOINT_URL" --bucket wheel-models \
  --prefix churn "$job/models" >/dev/null
rm -r "$job/models"
(cd "$work" && env -u BATCHFLEET_BIN_DIR -u VIRTUAL_ENV PATH="$work/venv/bin:/usr/bin:/bin:/usr/sbin:/sbin" \
  BATCHFLEET_CACHE_DIR="$work/cache" "$work/venv/bin/python" "$root/.ci/wheel_check.py" \
  --job "$job" --model s3://wheel-models/churn/model.pt)
