#!/usr/bin/env python3
"""Write a TorchScript model that computes what another does but holds
MiB of extra weights, for tests of a worker's memory.

    python make_heavy_model.py --base DIR/model.pt --out DIR/heavy.pt --mib 512 [--fill 1.5]

The written module runs the base model and adds `ballast[0] * 0` to its
output, so its predictions equal the base model's; `ballast` is one float32
parameter of --mib MiB, filled with --fill (another fill, another digest).
"""
import argparse

import torch


class Heavy(torch.nn.Module):
    def __init__(self, base: torch.jit.ScriptModule, mib: int, fill: float):
        super().__init__()
        self.base = base
        self.ballast = torch.nn.Parameter(torch.full((mib << 18,), fill), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.ballast[0] * 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mib", type=int, required=True)
    ap.add_argument("--fill", type=float, default=1.0)
    args = ap.parse_args()
    model = Heavy(torch.jit.load(args.base), args.mib, args.fill).eval()
    torch.jit.script(model).save(args.out)
    print(f"wrote {args.out}: {args.base} with {args.mib} MiB of weights more")


if __name__ == "__main__":
    main()
