"""Write a small data folder in LEAF's exact FEMNIST format, from the embedded digits, to try the
command a user with LEAF's real files would type (docs/workloads.md):

    python experiments/leaf_femnist_like.py /tmp/leaf-femnist
    emulate --dataset leaf-femnist --data-root /tmp/leaf-femnist --partition natural \
            --model leaf-cnn --protocol fedavg --topology star --nodes 11 --rounds 10

The 1,797 digits are dealt in order to WRITERS pseudo-writers (the digits' real writers are not
recorded). Each 8x8 image is scaled to 28x28 (each pixel a 3x3 block, a 2-pixel border) and written
as LEAF writes FEMNIST: 784 numbers k/255 in [0, 1]. Each writer's samples are split as LEAF's
`split_data.py --by_sample` with --tf 0.9: a seeded 90% train, the rest test; two train and two test
files, as LEAF's niid sampling writes several.
"""
import json
import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

WRITERS = 10
TRAIN_FRACTION = 0.9


def femnist_pixels(image: np.ndarray) -> list[float]:
    """An 8x8 digit (0..16) as LEAF's 784 FEMNIST values k/255."""
    levels = np.round(image * 255 / 16).astype(int)
    big = np.pad(np.kron(levels, np.ones((3, 3), dtype=int)), 2)
    return (big.ravel() / 255).tolist()


def main(root: str) -> None:
    digits = load_digits()
    rng = np.random.default_rng(0)
    files = {split: [{}, {}] for split in ("train", "test")}
    for writer, members in enumerate(np.array_split(np.arange(len(digits.target)), WRITERS)):
        train = np.zeros(len(members), dtype=bool)
        train[rng.permutation(len(members))[:int(TRAIN_FRACTION * len(members))]] = True
        for split, chosen in (("train", members[train]), ("test", members[~train])):
            files[split][writer % 2][f"w{writer:03d}"] = {
                "x": [femnist_pixels(digits.images[i]) for i in chosen],
                "y": [int(digits.target[i]) for i in chosen]}
    for split, parts in files.items():
        (Path(root) / split).mkdir(parents=True, exist_ok=True)
        for k, users in enumerate(parts):
            content = {"users": list(users), "num_samples": [len(u["y"]) for u in users.values()],
                       "user_data": users}
            path = Path(root) / split / f"all_data_{k}_niid_1_keep_0_{split}_9.json"
            path.write_text(json.dumps(content))
    print(f"wrote {WRITERS} writers' files under {root}/train and {root}/test")


if __name__ == "__main__":
    main(sys.argv[1])
