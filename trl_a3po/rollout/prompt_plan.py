"""Prompt plans: one process's generation batches (dataset rows) in exactly the order the synchronous trainer would
train them, so that the producer can generate them ahead. Built from a `PlanSource` the trainer fills in once, not
from the trainer itself."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import datasets
from accelerate.data_loader import BatchSamplerShard, prepare_data_loader
from torch.utils.data import BatchSampler, DataLoader
from trl.trainer.utils import repeat_iterable_dataset


@dataclass(frozen=True)
class PlanSource:
    """What a plan reads of the training setup (A3POTrainer fills it in: `_plan_source`)."""

    dataset: Any  # the train dataset (map-style, or a `datasets.IterableDataset`)
    sampler: Callable[[], Any]  # a fresh training sampler (map-style): GRPOTrainer's, with its seed and grouping
    collate: Callable | None  # the training collator (streamed datasets)
    rows_per_batch: int  # rows of one generation batch on one process: train batch size x steps_per_generation
    repeats: int  # the training dataloader yields each generation batch this many times in a row
    drop_last: bool
    shuffle: bool  # streamed datasets: TRL's buffered shuffle by `seed`
    seed: int
    num_generations: int
    generation_batch_size: int
    num_processes: int
    even_batches: bool
    split_batches: bool


def generation_batches(source: PlanSource, start: int, process_index: int) -> Iterator[tuple[int, list]]:
    """Process `process_index`'s generation batches as (index, rows), from `start` on, forever (epoch after epoch).

    The same sampler, seed and Accelerate sharding as the training dataloader (which yields each generation batch
    `repeats` times in a row); every process checks its share against it.
    """
    if isinstance(source.dataset, datasets.IterableDataset):
        yield from _streamed_generation_batches(source, start, process_index)
        return
    batches = BatchSamplerShard(
        BatchSampler(source.sampler(), source.rows_per_batch, drop_last=source.drop_last),
        num_processes=source.num_processes,
        process_index=process_index,
        split_batches=False,
        even_batches=source.even_batches,
    )
    per_epoch = len(batches) // source.repeats
    if per_epoch == 0:
        raise ValueError("the train dataset is smaller than one generation batch")
    # Like the Trainer on resume: a fresh sampler, skipping the batches already consumed in the current epoch.
    skip = start % per_epoch
    index = start
    for _epoch in itertools.count():
        for position, indices in enumerate(batches):
            if position % source.repeats:
                continue  # a repeat of the generation batch just yielded
            if skip:
                skip -= 1
                continue
            yield index, [source.dataset[i] for i in indices]
            index += 1


def _streamed_generation_batches(source: PlanSource, start: int, process_index: int):
    """`generation_batches` for an iterable dataset, which has no sampler to replay: a second reader of the same
    stream. TRL's `get_train_dataloader` transform (buffered shuffle by seed, `repeat_iterable_dataset`), sharded for
    `process_index` by Accelerate's own `prepare_data_loader` as the training dataloader is, one epoch after another
    (`set_epoch` reshuffles, as the Trainer's epoch loop does). Batches already trained on resume are read and skipped
    from the stream's start, as the Trainer skips them."""
    dataset = source.dataset
    if source.shuffle:
        dataset = dataset.shuffle(seed=source.seed)
    dataset = repeat_iterable_dataset(
        dataset,
        mini_repeat_count=source.num_generations,
        batch_size=source.generation_batch_size // source.num_generations,
        repeat_count=source.repeats,
    )
    loader = prepare_data_loader(
        DataLoader(dataset, batch_size=source.rows_per_batch, collate_fn=source.collate),
        num_processes=source.num_processes,
        process_index=process_index,
        split_batches=source.split_batches,
        even_batches=source.even_batches,
        dispatch_batches=False,  # TRL requires it for iterable datasets
    )
    index = 0
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        read = 0
        for position, rows in enumerate(loader):
            read += 1
            if position % source.repeats:
                continue  # a repeat of the generation batch just read
            if index >= start:
                yield index, rows
            index += 1
        if read == 0:
            raise ValueError("the train dataset streamed no complete generation batch")
