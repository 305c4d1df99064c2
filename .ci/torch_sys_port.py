#!/usr/bin/env python3
"""Ports the torch-sys crate to the libtorch of another PyTorch release.

    python .ci/torch_sys_port.py --src <torch-sys-0.26.0> --dst <folder> --torch-dir <site-packages/torch>

torch-sys wraps every ATen operator of the PyTorch release its version
targets (torch-sys 0.26: PyTorch 2.13) in `libtch/torch_api_generated.cpp`.
Against an older libtorch the wrappers of operators that release lacks, or
whose signature changed, do not compile. This copies the crate to `--dst`,
checks the generated file against `--torch-dir`'s headers (`g++
-fsyntax-only`, as torch-sys's build compiles it), and replaces the body of
each wrapper that does not compile by one that fails at run time, naming
the operator and the PyTorch it needs (torch-sys's `PROTECT` turns the
exception into an `Err` of the `f_*` method). Every `atg_*` symbol stays
defined, so the crate links; batchfleet calls none of the wrappers replaced
(the script prints them). Repeats until the file compiles; anything else that
does not compile stops it with g++'s errors.

`make gpu-bundle` points cargo at the copy with `--config
patch.crates-io.torch-sys.path=...`; the workspace build is unchanged.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

GENERATED = os.path.join("libtch", "torch_api_generated.cpp")
ERROR = re.compile(r"torch_api_generated\.cpp:(\d+):\d+: error:")
START = re.compile(r"^[A-Za-z_][\w \*]*\b(atg_\w+)\(")


def syntax_errors(path: str, torch_dir: str) -> tuple[set[int], str]:
    include = os.path.join(torch_dir, "include")
    cmd = [
        os.environ.get("CXX", "g++"),
        "-std=c++17",
        "-fsyntax-only",
        "-fmax-errors=0",
        "-w",
        "-D_GLIBCXX_USE_CXX11_ABI=" + os.environ.get("LIBTORCH_CXX11_ABI", "1"),
        "-DGLOG_USE_GLOG_EXPORT",
        "-I" + include,
        "-I" + os.path.join(include, "torch", "csrc", "api", "include"),
        path,
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(path))
    lines = {int(m.group(1)) for m in ERROR.finditer(run.stderr)}
    if run.returncode != 0 and not lines:
        sys.exit(f"error: {path} does not compile against {torch_dir}, outside its wrappers:\n{run.stderr[-4000:]}")
    return lines, run.stderr


def functions(lines: list[str]) -> list[tuple[int, int, str]]:
    """(first line, last line, name) of each wrapper, 0-based, inclusive."""
    found = []
    i = 0
    while i < len(lines):
        m = START.match(lines[i])
        if m and lines[i].rstrip().endswith("{"):
            j = i + 1
            while j < len(lines) and lines[j].rstrip() != "}":
                j += 1
            found.append((i, j, m.group(1)))
            i = j
        i += 1
    return found


def stub(signature: str, name: str, torch: str) -> list[str]:
    return [
        signature,
        "  PROTECT(",
        f'    throw std::runtime_error("{name}: this operator is not in the libtorch of PyTorch {torch} that this build links");',
        "  )",
        "}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True, help="torch-sys's source (from cargo's registry)")
    ap.add_argument("--dst", required=True, help="where the ported copy goes (replaced)")
    ap.add_argument("--torch-dir", required=True, help="the torch package: include/ and lib/ inside")
    ap.add_argument("--torch-version", default="?", help="named in the stubs' errors")
    args = ap.parse_args()

    if os.path.exists(args.dst):
        shutil.rmtree(args.dst)
    shutil.copytree(args.src, args.dst)
    path = os.path.abspath(os.path.join(args.dst, GENERATED))
    replaced: list[str] = []
    for _ in range(5):
        bad, stderr = syntax_errors(path, args.torch_dir)
        if not bad:
            break
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        hit = [(a, b, name) for a, b, name in functions(lines) if any(a <= n - 1 <= b for n in bad)]
        covered = {n for n in bad if any(a <= n - 1 <= b for a, b, _ in hit)}
        if covered != bad:
            sys.exit(f"error: errors outside any wrapper at lines {sorted(bad - covered)}:\n{stderr[-4000:]}")
        for a, b, name in sorted(hit, reverse=True):
            lines[a : b + 1] = stub(lines[a], name, args.torch_version)
            replaced.append(name)
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines))
    else:
        sys.exit(f"error: {path} still does not compile after five passes")
    print(f"torch-sys ported to PyTorch {args.torch_version}: {len(replaced)} wrapper(s) fail at run time:")
    for name in sorted(replaced):
        print(f"  {name}")


if __name__ == "__main__":
    main()
