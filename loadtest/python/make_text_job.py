#!/usr/bin/env python3
"""Makes a text job offline: a corpus, a WordPiece tokenizer.json trained on
it, a small BERT-like encoder (TorchScript) and PyTorch's own outputs.

    make_text_job.py OUT [--rows N] [--seed S] [--dim D] [--max-length L]
                         [--format csv|jsonl|parquet|all] [--batch B]
                         [--output pooled|hidden]

Writes into OUT:
  corpus.<fmt>       (each format with --format all) id,text rows: varied lengths, some empty strings,
                     non-ASCII text and a few very long rows (truncated at
                     --max-length)
  tokenizer.json     WordPiece trained on the corpus with Python's `tokenizers`
  encoder.pt         torch.jit.script of forward(input_ids, attention_mask):
                     a TransformerEncoder with seeded random weights; returns
                     the masked mean of its last hidden state [rows, D]
                     (--output pooled, the default) or the hidden state
                     itself [rows, L, D] (--output hidden)
  expected_ids.jsonl {"id", "ids"} per row: Python's token ids (truncated at
                     --max-length, special tokens added, no padding)
  expected.csv       id,score_0..score_{D-1}: PyTorch's pooled output for
                     every row, run in mini-batches of --batch rows padded to
                     each mini-batch's longest row (pad id 0, mask 0)

Everything is seeded, so the same arguments make the same files.
"""

import argparse
import csv
import json
import os
import random

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

WORDS = (
    "the a of to and in is was for on that with as by at from this be are it an or "
    "model batch fleet worker queue item row score data text token vector review ticket "
    "search embed order ship delay refund great terrible fast slow price quality support "
    "customer product service night morning happy sad blue green red coffee tea river "
    "mountain city train plane bridge window garden music film book paper letter"
).split()
NON_ASCII = ["café", "naïve", "Zürich", "smörgåsbord", "日本語", "东京", "Ελληνικά", "😀", "señor", "übung"]


def sentence(rng, n):
    words = []
    for _ in range(n):
        if rng.random() < 0.06:
            words.append(rng.choice(NON_ASCII))
        else:
            words.append(rng.choice(WORDS))
    text = " ".join(words)
    if rng.random() < 0.3:
        text = text.capitalize() + rng.choice([".", "!", "?", ","])
    return text


def corpus(rows, seed):
    rng = random.Random(seed)
    texts = []
    for i in range(rows):
        r = rng.random()
        if r < 0.02:
            texts.append("")
        elif r < 0.04:
            texts.append(sentence(rng, rng.randint(300, 600)))  # longer than max_length
        elif r < 0.5:
            texts.append(sentence(rng, rng.randint(1, 12)))
        else:
            texts.append(sentence(rng, rng.randint(12, 60)))
    return texts


def train_tokenizer(texts, vocab):
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return tok


class Encoder(torch.nn.Module):
    def __init__(self, vocab, dim, layers, max_len, pooled):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_len, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=dim * 2, dropout=0.0, batch_first=True)
        # No nested-tensor fast path: it would drop padded positions and
        # make outputs depend on the padding in a way eval() hides.
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pooled = pooled

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.tok(input_ids) + self.pos(positions)
        h = self.encoder(x, src_key_padding_mask=attention_mask == 0)
        if not self.pooled:
            return h
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp(min=1.0)


def padded(batch_ids):
    width = max(len(ids) for ids in batch_ids)
    ids = torch.zeros((len(batch_ids), width), dtype=torch.int64)
    mask = torch.zeros((len(batch_ids), width), dtype=torch.int64)
    for r, row in enumerate(batch_ids):
        ids[r, : len(row)] = torch.tensor(row, dtype=torch.int64)
        mask[r, : len(row)] = 1
    return ids, mask


def write_corpus(out, fmt, ids, texts):
    path = os.path.join(out, f"corpus.{fmt}")
    if fmt == "csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["id", "text"])
            for i, t in zip(ids, texts):
                w.writerow([i, t])
    elif fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for i, t in zip(ids, texts):
                f.write(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": ids, "text": texts}), path, row_group_size=2000)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--format", choices=["csv", "jsonl", "parquet", "all"], default="csv")
    ap.add_argument("--output", choices=["pooled", "hidden"], default="pooled")
    ap.add_argument("--no-expected", action="store_true", help="skip PyTorch's outputs (benchmarks)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(a.seed)
    texts = corpus(a.rows, a.seed)
    ids = [f"doc-{i:07d}" for i in range(a.rows)]
    for fmt in ["csv", "jsonl", "parquet"] if a.format == "all" else [a.format]:
        write_corpus(a.out, fmt, ids, texts)

    tok = train_tokenizer(texts, a.vocab)
    tok.save(os.path.join(a.out, "tokenizer.json"))
    tok = Tokenizer.from_file(os.path.join(a.out, "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(a.max_length)
    encoded = [e.ids for e in tok.encode_batch(texts)]
    with open(os.path.join(a.out, "expected_ids.jsonl"), "w", encoding="utf-8") as f:
        for i, e in zip(ids, encoded):
            f.write(json.dumps({"id": i, "ids": e}) + "\n")

    model = Encoder(tok.get_vocab_size(), a.dim, a.layers, a.max_length, a.output == "pooled").eval()
    scripted = torch.jit.script(model)
    scripted.save(os.path.join(a.out, "encoder.pt"))
    if a.no_expected:
        return
    with torch.no_grad(), open(os.path.join(a.out, "expected.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id"] + [f"score_{j}" for j in range(a.dim)])
        for lo in range(0, a.rows, a.batch):
            x, m = padded(encoded[lo : lo + a.batch])
            y = model(x, m)
            if y.dim() == 3:
                mm = m.unsqueeze(-1).to(y.dtype)
                y = (y * mm).sum(1) / mm.sum(1).clamp(min=1.0)
            for r, row in enumerate(y.tolist()):
                w.writerow([ids[lo + r]] + [repr(v) for v in row])


if __name__ == "__main__":
    main()
