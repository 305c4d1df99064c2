#!/usr/bin/env python3
"""What a user would write to embed a corpus in Python, timed, next to the
model's forward alone on pre-tokenized, pre-padded tensors.

    text_loop.py DIR [--batch B] [--threads T] [--max-length L] [--json FILE]

DIR holds corpus.csv, tokenizer.json and encoder.pt (make_text_job.py).
Prints one JSON object (and writes it to --json):

  python_loop_rows_per_s   read the texts, then per mini-batch of B rows in
                           input order: tokenizers' encode_batch (truncated,
                           padded to the batch's longest), torch.no_grad()
                           forward, rows written to a CSV file
  ceiling_rows_per_s       forward alone over the corpus pre-tokenized and
                           sorted by length, each mini-batch pre-padded to its
                           longest row (the compute ceiling)
  unsorted_rows_per_s      forward alone, input order, each mini-batch padded
                           to its longest (dynamic padding without sorting)
  max_length_rows_per_s    forward alone, input order, every row padded to
                           --max-length (no dynamic padding)
  ceiling_no_optimize_rows_per_s
                           the ceiling with TorchScript's graph executor
                           optimization off (torch._C._set_graph_executor_optimize)
  tokens_real / tokens_padded_*   tokens in the rows / in each padding
"""

import argparse
import csv
import json
import os
import time

import torch
from tokenizers import Tokenizer


def batches(ids, batch, pad_to=None):
    out = []
    for lo in range(0, len(ids), batch):
        rows = ids[lo : lo + batch]
        width = pad_to or max(len(r) for r in rows)
        x = torch.zeros((len(rows), width), dtype=torch.int64)
        m = torch.zeros((len(rows), width), dtype=torch.int64)
        for r, row in enumerate(rows):
            x[r, : len(row)] = torch.tensor(row, dtype=torch.int64)
            m[r, : len(row)] = 1
        out.append((x, m))
    return out


def forward_rate(model, padded, rows, repeats=3, first=None):
    """Median rows/s of `repeats` passes after the first (warm: every shape
    specialized); the first pass's rate goes to first["rate"] when given."""
    rates = []
    with torch.no_grad():
        # Warm-up: the profiling executor specializes on the first calls of
        # each shape; the first whole pass meets every shape once.
        t = time.perf_counter()
        for x, m in padded:
            model(x, m)
        if first is not None:
            first["rate"] = rows / (time.perf_counter() - t)
        for _ in range(repeats):
            t = time.perf_counter()
            for x, m in padded:
                model(x, m)
            rates.append(rows / (time.perf_counter() - t))
    rates.sort()
    return rates[len(rates) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    corpus = os.path.join(a.dir, "corpus.csv")
    model = torch.jit.load(os.path.join(a.dir, "encoder.pt")).eval()

    # The user's loop, end to end.
    t0 = time.perf_counter()
    with open(corpus, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))[1:]
    ids = [r[0] for r in rows]
    texts = [r[1] for r in rows]
    tok = Tokenizer.from_file(os.path.join(a.dir, "tokenizer.json"))
    tok.enable_truncation(a.max_length)
    tok.enable_padding(pad_id=tok.token_to_id("[PAD]") or 0)
    with torch.no_grad(), open(os.path.join(a.dir, "python-loop.csv"), "w", newline="") as out:
        w = csv.writer(out)
        for lo in range(0, len(texts), a.batch):
            enc = tok.encode_batch(texts[lo : lo + a.batch])
            x = torch.tensor([e.ids for e in enc], dtype=torch.int64)
            m = torch.tensor([e.attention_mask for e in enc], dtype=torch.int64)
            y = model(x, m)
            for i, row in zip(ids[lo : lo + a.batch], y.tolist()):
                w.writerow([i] + row)
    loop = len(texts) / (time.perf_counter() - t0)

    tok.no_padding()
    encoded = [e.ids for e in tok.encode_batch(texts)]
    n = len(encoded)
    by_length = sorted(encoded, key=len)
    sorted_b = batches(by_length, a.batch)
    unsorted_b = batches(encoded, a.batch)
    full_b = batches(encoded, a.batch, pad_to=a.max_length)
    cold = {}
    result = {
        "rows": n,
        "batch": a.batch,
        "threads": a.threads,
        "python_loop_rows_per_s": loop,
        "ceiling_rows_per_s": forward_rate(model, sorted_b, n, first=cold),
        "unsorted_rows_per_s": forward_rate(model, unsorted_b, n),
        "max_length_rows_per_s": forward_rate(model, full_b, n, repeats=1),
        "ceiling_first_pass_rows_per_s": cold["rate"],
        "tokens_real": sum(len(r) for r in encoded),
        "tokens_padded_sorted": sum(x.numel() for x, _ in sorted_b),
        "tokens_padded_unsorted": sum(x.numel() for x, _ in unsorted_b),
        "tokens_padded_max_length": sum(x.numel() for x, _ in full_b),
    }
    torch._C._set_graph_executor_optimize(False)
    model = torch.jit.load(os.path.join(a.dir, "encoder.pt")).eval()
    result["ceiling_no_optimize_rows_per_s"] = forward_rate(model, sorted_b, n)
    print(json.dumps(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
