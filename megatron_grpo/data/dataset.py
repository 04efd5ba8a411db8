"""The prompt dataset and its resumable sampler.

``load_prompt_dataset(config.data, tokenizer)`` reads, validates and tokenizes the whole file
once at start-up (so a bad line 9,000 fails before step 1, not after an hour).
``PromptSampler`` hands out ``prompts_per_step`` prompts per step in a seeded shuffled order,
epoch after epoch; a batch that crosses an epoch boundary takes the rest of one epoch and the
start of the next, so every prompt is seen once per epoch. Its position is a few integers
(``state_dict``) stored with the checkpoint: a resumed run draws exactly the prompts the
uninterrupted run would have drawn. Every rank builds the same sampler and so draws the
same batch, with no communication.
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import numpy as np

from megatron_grpo.data.prompts import Prompt, build_prompts
from megatron_grpo.data.records import DataError, read_records


class PromptDataset:
    """An immutable list of tokenized ``Prompt``s read from one file."""

    def __init__(self, prompts: list[Prompt], source: str):
        if not prompts:
            raise DataError(f"{source}: the dataset is empty (no records)")
        self.prompts = prompts
        self.source = source

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]

    def fingerprint(self) -> str:
        """Hash of every prompt's ids and answer: detects a dataset changed under a resumed run."""
        h = hashlib.sha256()
        for p in self.prompts:
            h.update(np.asarray(p.prompt_ids, dtype=np.int64).tobytes())
            h.update(b"\0" + p.answer.encode() + b"\0")
        return h.hexdigest()[:16]

    def max_prompt_tokens(self) -> int:
        """Length of the longest prompt in tokens."""
        return max(len(p.prompt_ids) for p in self.prompts)


def load_prompt_dataset(data_cfg, tokenizer, path: str | None = None, key: str = "data.train_file") -> PromptDataset:
    """Read ``data_cfg.train_file`` (a ``DataConfig``), or ``path`` (named by config ``key``:
    an eval set) with the same keys and template, and tokenize it; DataError on any bad record."""
    records = read_records(path or data_cfg.train_file, data_cfg.prompt_key, data_cfg.answer_key, key)
    prompts = build_prompts(
        records,
        tokenizer,
        prompt_key=data_cfg.prompt_key,
        answer_key=data_cfg.answer_key,
        apply_chat_template=data_cfg.apply_chat_template,
        system_prompt=data_cfg.system_prompt,
        max_prompt_length=data_cfg.max_prompt_length,
    )
    return PromptDataset(prompts, str(path or data_cfg.train_file))


def epoch_order(num_prompts: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Prompt indices of one epoch, shape [num_prompts]: a permutation seeded by (seed, epoch)."""
    if not shuffle:
        return np.arange(num_prompts)
    return np.random.default_rng([seed, epoch]).permutation(num_prompts)


class PromptSampler:
    """Batches of ``prompts_per_step`` prompts, seeded-shuffled per epoch, with a resumable position."""

    def __init__(self, dataset: PromptDataset, prompts_per_step: int, seed: int, shuffle: bool = True):
        assert prompts_per_step >= 1, prompts_per_step  # validated by RolloutConfig
        self.dataset = dataset
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # prompts of `epoch` already handed out
        self._order = epoch_order(len(dataset), seed, 0, shuffle)

    def _advance_epoch(self) -> None:
        self.epoch += 1
        self.position = 0
        self._order = epoch_order(len(self.dataset), self.seed, self.epoch, self.shuffle)

    def next_indices(self) -> list[int]:
        """Dataset indices of the next batch (length prompts_per_step)."""
        out: list[int] = []
        while len(out) < self.prompts_per_step:
            if self.position == len(self._order):
                self._advance_epoch()
            take = min(self.prompts_per_step - len(out), len(self._order) - self.position)
            out.extend(int(i) for i in self._order[self.position : self.position + take])
            self.position += take
        return out

    def next_batch(self) -> list[Prompt]:
        """The next ``prompts_per_step`` prompts."""
        return [self.dataset[i] for i in self.next_indices()]

    def __iter__(self) -> Iterator[list[Prompt]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """Position as plain ints/strings (JSON- and torch.save-able)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.dataset),
            "fingerprint": self.dataset.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; DataError if it was saved for a different dataset or seed."""
        src = self.dataset.source
        if state["num_prompts"] != len(self.dataset) or state["fingerprint"] != self.dataset.fingerprint():
            raise DataError(
                f"{src}: the checkpoint's data position is for a different dataset "
                f"({state['num_prompts']} prompts, fingerprint {state['fingerprint']}; now {len(self.dataset)}, "
                f"{self.dataset.fingerprint()}); restore the original file or set checkpoint.resume: never"
            )
        if state["seed"] != self.seed or state["shuffle"] != self.shuffle:
            raise DataError(
                f"{src}: the checkpoint's data order used trainer.seed={state['seed']}, data.shuffle="
                f"{state['shuffle']} but the config has {self.seed}, {self.shuffle}; resuming would change the prompts"
            )
        if not 0 <= state["position"] <= len(self.dataset) or state["epoch"] < 0:
            raise DataError(f"{src}: corrupt data position in checkpoint: {state}")
        self.epoch = state["epoch"]
        self.position = state["position"]
        self._order = epoch_order(len(self.dataset), self.seed, self.epoch, self.shuffle)
