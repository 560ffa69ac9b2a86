"""What the graft tests (prompt lookup and the datastore grafted onto a drafter's tree) share:
the presets that take a graft, the fitted drafters of each kind, and their inner proposers."""
from __future__ import annotations

import torch

from draftsmith.decode.draft import DraftModelProposer
from draftsmith.decode.proposers import make_proposer
from tests.drafters import fitted_drafter, fitted_heads, noisy_copy
from tests.laws import DECODE_CONF, assert_cache_is_prefill, tree_paths
from tests.tiny import tiny_llama

# every drafter's tree preset, a new one included; the draft-free proposers take no graft
GRAFTED_PRESETS = sorted(p.stem for p in DECODE_CONF.glob("*.yaml") if p.stem not in {"prompt-lookup", "lookahead"})


class CheckedDraft(DraftModelProposer):
    """After every acceptance the draft cache is a fresh prefill of the text it holds: all it had
    drafted of the accepted path (grafted tokens it never saw are fed with the next root)."""

    checks = 0

    def propose(self, root, hidden, ids):
        self.ids, self.size = list(ids), None
        tree = super().propose(root, hidden, ids)
        self.size = tree.size
        return tree

    def accept(self, tree, path, next_token, hidden):
        super().accept(tree, path, next_token, hidden)
        drafted = [u for u in path[1:] if u < self.size]  # the draft's own nodes: a prefix of the path
        assert path[1 : 1 + len(drafted)] == drafted
        text = self.ids + tree.tokens[path[1:]].tolist() + [next_token]
        assert len(self.ids) <= self.cached <= len(self.ids) + len(drafted) < len(text)
        assert_cache_is_prefill(self.model, self.cache, text[: self.cached])
        self.checks += 1


def graft_drafters():
    """-> (a tiny fp64 verifier, {"eagle1", "eagle3" (reduced vocabulary), "medusa", "draft"} fitted to it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_llama(eos_token_id=None).requires_grad_(False)
        drafters = {"eagle1": fitted_drafter(model, "eagle1"),
                    "eagle3": fitted_drafter(model, "eagle3", ttt=2, draft_vocab_size=64),
                    "medusa": fitted_heads(model), "draft": noisy_copy(model, 0.008)}
    finally:
        torch.set_num_threads(threads)
    return model, drafters


def inner_proposer(model, drafters, case: str):
    """The drafter's own proposer a graft wraps: eagle1-dynamic, eagle3-chain, medusa, draft-heuristic..."""
    embed, lm_head = model.get_input_embeddings(), model.lm_head
    if case == "medusa":
        return make_proposer("medusa", heads=drafters["medusa"], paths=tree_paths("medusa-small"))
    if case == "draft-heuristic":  # its cache is checked against a fresh prefill after every step
        return CheckedDraft(drafters["draft"], model.config.vocab_size, num_tokens=2, length_schedule="heuristic",
                            max_tokens=4)
    variant, tree = case.split("-")
    kwargs = dict(depth=2, top_k=3, total_tokens=6) if tree == "dynamic" else dict(paths=[[0], [0, 0]])
    return make_proposer("eagle", drafter=drafters[variant], embed_tokens=embed, lm_head=lm_head, **kwargs)
