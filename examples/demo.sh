#!/usr/bin/env bash
# The main job on the bundled real corpora: convert -> info -> verify -> sample -> train through the
# PyTorch and TensorFlow adapters. Outputs go to out/ (re-running resumes / reuses finished datasets).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out

echo "== convert (COCO photos, class folders, speech) =="
shardkit convert datasets/coco -o out/coco
shardkit convert datasets/imagefolder -o out/imagefolder --split train --size 64
shardkit convert datasets/speech -o out/speech --kind audio --split all --sample-rate 16000 --duration 1.0

echo "== info: what a dataset holds, and where any record came from =="
shardkit info out/coco
shardkit info out/coco --record 3
shardkit info out/speech --record 0

echo "== show: look at the records (COCO boxes drawn; audio waveforms and spectrograms) =="
shardkit show out/coco --random 12 --seed 0 -o out/coco-show.png
shardkit show out/speech --random 4 --seed 0 -o out/speech-show.png --wav out/speech-wav

echo "== verify =="
shardkit verify out/coco
shardkit verify out/imagefolder
shardkit verify out/speech

echo "== sample: exactly uniform order, sequential reads, RAM + SSD tiers =="
shardkit sample out/coco --tiers ram,ssd --ram-size 6records --ssd-size 12records --batch-size 4 \
    --epochs 3 --seed 0 --order-out out/coco-order.npy
python - <<'PY'
import numpy as np
order = np.load("out/coco-order.npy")
print(f"emitted order, shape {order.shape} (epochs x records):")
print(order)
assert all(sorted(row) == list(range(order.shape[1])) for row in order), "each epoch must be a permutation"
print("every epoch is a permutation of all records")
PY

echo "== train through the PyTorch adapter (ShardIterableDataset) =="
python examples/train_torch.py out/imagefolder --epochs 3

echo "== train through the TensorFlow adapter (tf.data + model.fit) =="
python examples/train_tf.py out/imagefolder --epochs 3
echo "== done: datasets in out/ =="
