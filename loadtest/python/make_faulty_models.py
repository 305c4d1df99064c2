#!/usr/bin/env python3
"""Wrap a TorchScript model into faulty variants, for failure-handling tests.

    python make_faulty_models.py --base DIR/model.pt --out-dir DIR

Writes, next to each other (same predictions as the base model otherwise):
  poison.pt  raises "poison sentinel" on any row whose first feature is -999
  flaky.pt   raises "flaky backend: try again" on its first 2 calls in a process
  hang.pt    spins for a very long time on any row whose first feature is -777
  slow.pt    like poison.pt, and spends about --slow-ms milliseconds per call
  oom.pt     raises a CUDA-style "out of memory" error on batches of more than 16 rows
  stuck.pt   spins about --stuck-s seconds on every call, whatever the rows
  hungry.pt  takes --hungry-mib MiB of memory on a batch of exactly 2 rows (the
             two sample rows validation tries), nothing more on any other
"""
import argparse
import os
import time

import torch


class Faulty(torch.nn.Module):
    def __init__(self, inner, poison: bool, fail_first: int, hang_iters: int, spin_iters: int, max_rows: int = 0, hungry_floats: int = 0):
        super().__init__()
        self.inner = inner
        self.poison = poison
        self.fail_first = fail_first
        self.calls = 0
        self.hang_iters = hang_iters
        self.spin_iters = spin_iters
        self.max_rows = max_rows
        self.hungry_floats = hungry_floats

    def spin(self, n: int) -> torch.Tensor:
        acc = torch.zeros(1)
        for _ in range(n):
            acc = acc + 1.0
        return acc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls <= self.fail_first:
            raise RuntimeError("flaky backend: try again")
        if self.max_rows > 0 and x.size(0) > self.max_rows:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated for a batch of more than max_rows rows)")
        if self.hungry_floats > 0 and x.size(0) == 2:
            big = torch.ones(self.hungry_floats)
            return self.inner(x) + big[0] * 0.0
        if self.poison and bool((x[:, 0] == -999.0).any()):
            raise RuntimeError("poison sentinel in input")
        if self.hang_iters > 0 and bool((x[:, 0] == -777.0).any()):
            self.spin(self.hang_iters)
        if self.spin_iters > 0:
            self.spin(self.spin_iters)
        return self.inner(x)


def iters_per_ms() -> float:
    probe = torch.jit.script(Faulty(torch.nn.Identity(), False, 0, 0, 0))
    n = 200_000
    start = time.perf_counter()
    probe.spin(n)
    return n / ((time.perf_counter() - start) * 1000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--slow-ms", type=float, default=150.0)
    ap.add_argument("--hang-s", type=float, default=60.0)
    ap.add_argument("--stuck-s", type=float, default=20.0)
    ap.add_argument("--hungry-mib", type=int, default=2560)
    args = ap.parse_args()
    base = torch.jit.load(args.base)
    rate = iters_per_ms()
    variants = {
        "poison.pt": Faulty(base, True, 0, 0, 0),
        "flaky.pt": Faulty(base, False, 2, 0, 0),
        "hang.pt": Faulty(base, False, 0, int(rate * args.hang_s * 1000), 0),
        "slow.pt": Faulty(base, True, 0, 0, int(rate * args.slow_ms)),
        "oom.pt": Faulty(base, False, 0, 0, 0, 16),
        "stuck.pt": Faulty(base, False, 0, 0, int(rate * args.stuck_s * 1000)),
        "hungry.pt": Faulty(base, False, 0, 0, 0, 0, args.hungry_mib * (1 << 20) // 4),
    }
    for name, module in variants.items():
        torch.jit.save(torch.jit.script(module), os.path.join(args.out_dir, name))
    print(f"wrote {', '.join(variants)} to {args.out_dir} ({rate:.0f} spin iterations/ms)")


if __name__ == "__main__":
    main()
