"""Train a tiny classifier on a shardkit dataset through the PyTorch adapter.

    python examples/train_torch.py out/imagefolder [--epochs 5]

A logistic regression on 8x8-pooled images: the point is the data path (uniform order every epoch,
sequential reads), not the model.
"""

from __future__ import annotations

import argparse
import logging

import torch

from shardkit.adapters.torch import ShardIterableDataset
from shardkit.formats import open_dataset

logging.basicConfig(level=logging.INFO, format="%(message)s")
log = logging.getLogger("train_torch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()

    with open_dataset(args.dataset) as ds:
        classes = len(ds.label_names or []) or int(ds.fields["label"].max()) + 1
    data = ShardIterableDataset(args.dataset, batch_size=args.batch_size, seed=0, layout="NCHW", scale="float")
    loader = data.loader(num_workers=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(8), torch.nn.Flatten(), torch.nn.Linear(3 * 64, classes))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for epoch in range(args.epochs):
        data.set_epoch(epoch)
        total, correct, loss_sum, first_keys = 0, 0, 0.0, None
        for batch in loader:
            x, y = batch["image"], batch["label"]
            first_keys = batch["key"][:4].tolist() if first_keys is None else first_keys
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += float(loss.detach()) * len(y)
            correct += int((logits.argmax(1) == y).sum())
            total += len(y)
        log.info("torch epoch %d: %d records, loss %.3f, train accuracy %.2f, first keys %s",
                 epoch, total, loss_sum / total, correct / total, first_keys)


if __name__ == "__main__":
    main()
