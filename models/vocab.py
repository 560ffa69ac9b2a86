"""Reduced draft vocabularies (EAGLE-3's draft->target map), shared by every drafter.

A drafter that predicts only the N most frequent target tokens of its training data pays an
N x h output projection instead of V x h. `d2t` (N,) maps draft ids to verifier ids and is
saved with the drafter; `t2d` (V,) is its inverse with -1 for tokens outside the draft vocab.
"""
from __future__ import annotations

import torch

from draftsmith.models.errors import DraftsmithError

IGNORE_INDEX = -100  # label of an unsupervised position (HF / torch cross_entropy convention)


def label_counts(labels_per_example, vocab_size: int) -> torch.Tensor:
    """(V,) how often each verifier id is a supervised target (label != IGNORE_INDEX) in the data."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for labels in labels_per_example:
        labels = torch.as_tensor(labels)
        counts += torch.bincount(labels[labels != IGNORE_INDEX], minlength=vocab_size)
    return counts


def draft_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """counts (V,) -> d2t (size,): the `size` most frequent ids, in increasing id order (ties
    broken by the lower id; unseen tokens fill up in id order)."""
    order = torch.sort(-counts.double(), stable=True).indices  # (V,) most frequent first
    return order[:size].sort().values


def check_draft_vocab_size(size, vocab_size: int) -> int | None:
    """method.draft_vocab_size of every drafter: None (the whole vocabulary) or an int in
    1..vocab_size, else a one-line DraftsmithError naming the field."""
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= vocab_size:
        raise DraftsmithError(f"method.draft_vocab_size={size}: must be in [1, {vocab_size}] (the verifier's "
                              f"vocabulary), or null for the whole vocabulary; e.g. method.draft_vocab_size=8192")
    return size


def is_draft_vocab(d2t: torch.Tensor, vocab_size: int) -> bool:
    """Whether d2t is what draft_vocab returns: a non-empty, strictly increasing (N,) list of
    integer ids below vocab_size."""
    return (d2t.dim() == 1 and d2t.numel() > 0 and not d2t.is_floating_point() and d2t.dtype != torch.bool
            and int(d2t.min()) >= 0
            and int(d2t.max()) < vocab_size and bool((d2t[1:] > d2t[:-1]).all()))


def target_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """d2t (N,) -> t2d (V,): the draft id of each verifier id, -1 where there is none."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    t2d[d2t] = torch.arange(d2t.numel(), device=d2t.device)
    return t2d
