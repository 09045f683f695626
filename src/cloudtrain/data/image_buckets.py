"""Aspect-ratio buckets for text-to-image training (SDXL): sizes near one target area, each image assigned to the
bucket whose aspect ratio is nearest its own, and an epoch order in which every optimizer step's rows (all its
micro-batches on every process) come from one bucket, so every batch stacks into one shape.

The order is a function of the seed and the epoch alone, as cloudtrain.data.processing.EpochShuffleSampler's:
a resumed run rebuilds it without sampler state, and accelerate's sharding (micro-batch b to process
b % processes) keeps each step within its bucket. See docs/text-to-image.md.
"""

import math
from collections.abc import Iterator, Sequence

import torch

from cloudtrain.data.processing import whole_steps

MAX_RATIO = 4.0  # no bucket longer than 4:1: past that the sides get too thin to learn from


def bucket_sizes(area: int, step: int, max_ratio: float = MAX_RATIO) -> list[tuple[int, int]]:
    """(width, height) pairs, both multiples of `step`, each as tall as fits in `area` (the target resolution
    squared) for its width, and the same turned a quarter (portrait as landscape), with aspect ratios up to
    `max_ratio` either way; sorted by ratio."""
    sizes = set()
    width = step
    while width * step <= area:
        height = area // width // step * step
        if height >= step and max(width / height, height / width) <= max_ratio:
            sizes.update({(width, height), (height, width)})
        width += step
    return sorted(sizes, key=lambda size: size[0] / size[1])


def nearest_bucket(size: tuple[int, int], buckets: Sequence[tuple[int, int]]) -> int:
    """The bucket whose aspect ratio is nearest the image's (width, height), measured in log ratio so that 2:1
    and 1:2 are equally far from 1:1; ties go to the larger area."""
    ratio = math.log(size[0] / size[1])
    return min(
        range(len(buckets)),
        key=lambda i: (abs(math.log(buckets[i][0] / buckets[i][1]) - ratio), -buckets[i][0] * buckets[i][1]),
    )


def assign(sizes: Sequence[tuple[int, int]], buckets: Sequence[tuple[int, int]]) -> list[int]:
    """Each image's bucket, by `nearest_bucket`."""
    return [nearest_bucket(size, buckets) for size in sizes]


class BucketSampler(torch.utils.data.Sampler):
    """Row numbers in whole steps of `step_rows` (the global batch: per-device batch x processes x
    accumulation), each step from one bucket: per epoch, each bucket's rows are permuted, cut into steps (the
    last one completed with the bucket's own first rows, so no step mixes buckets and no process waits), and
    the steps are shuffled. Everything is drawn from seed + epoch."""

    def __init__(self, row_buckets: Sequence[int], step_rows: int, seed: int):
        self.row_buckets, self.step_rows, self.seed, self.epoch = list(row_buckets), step_rows, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def steps(self) -> list[list[int]]:
        """The epoch's steps, each a list of `step_rows` row numbers from one bucket."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        steps: list[list[int]] = []
        for bucket in sorted(set(self.row_buckets)):
            rows = [i for i, b in enumerate(self.row_buckets) if b == bucket]
            shuffled = [rows[i] for i in torch.randperm(len(rows), generator=generator).tolist()]
            order = whole_steps(shuffled, self.step_rows)
            steps += [order[i : i + self.step_rows] for i in range(0, len(order), self.step_rows)]
        return [steps[i] for i in torch.randperm(len(steps), generator=generator).tolist()]

    def __iter__(self) -> Iterator[int]:
        return iter([row for step in self.steps() for row in step])

    def __len__(self) -> int:
        counts = [self.row_buckets.count(b) for b in set(self.row_buckets)]
        return sum(math.ceil(n / self.step_rows) * self.step_rows for n in counts)
