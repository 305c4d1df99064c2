#!/usr/bin/env python3
"""Write the files PyTorch users most often mistake for TorchScript, for
containment and validation tests.

    python make_wrong_models.py --base DIR/model.pt --out-dir DIR

From the TorchScript model at --base (its weights), writes:
  state_dict.pt  torch.save(model.state_dict()): weights only
  pickled.pt     torch.save(model): the whole module, pickled with its Python class
  exported.pt2   torch.export.save(torch.export.export(model, example)): a .pt2 package
Each is a zip archive, as TorchScript is; none can be run by libtorch's TorchScript loader.
"""
import argparse
import os

import torch


class Mlp(torch.nn.Module):
    """A plain (not scripted) module holding the base model's parameters."""

    def __init__(self, state):
        super().__init__()
        self.weights = torch.nn.ParameterDict(
            {k.replace(".", "_"): torch.nn.Parameter(v.clone()) for k, v in state.items()}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=1, keepdim=True) * 0.0 + sum(p.sum() for p in self.weights.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    base = torch.jit.load(args.base)
    state = base.state_dict()
    torch.save(state, os.path.join(args.out_dir, "state_dict.pt"))
    module = Mlp(state)
    torch.save(module, os.path.join(args.out_dir, "pickled.pt"))
    features = next(iter(state.values())).shape[-1]
    program = torch.export.export(module, (torch.randn(2, features),))
    torch.export.save(program, os.path.join(args.out_dir, "exported.pt2"))
    print(f"wrote state_dict.pt, pickled.pt, exported.pt2 to {args.out_dir}")


if __name__ == "__main__":
    main()
