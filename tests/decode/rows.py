"""Rows of every proposer kind for the batched-engine tests: their factories on one tiny
verifier, a schedule of requests joining at staggered steps, and scripted budgets."""
from __future__ import annotations

import torch

from draftsmith.decode.budget import StepCost
from draftsmith.decode.engine import Engine
from draftsmith.decode.proposers import make_proposer
from tests.drafters import fitted_drafter, fitted_heads, noisy_copy
from tests.tiny import tiny_llama

MEDUSA_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
# (proposer, prompt seed, prompt length, new tokens, step at which it joins)
SCHEDULE = [("eagle3", 1, 9, 24, 0), ("vanilla", 2, 5, 10, 0), ("medusa", 3, 21, 30, 0), ("draft", 4, 7, 16, 2),
            ("eagle1", 5, 12, 20, 3), ("prompt_lookup", 6, 30, 18, 5), ("lookahead", 7, 6, 14, 6),
            ("medusa", 8, 4, 12, 9)]


def row_factories():
    """-> (a tiny fp64 verifier, {kind: a function that builds a fresh proposer of that kind})."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_llama(eos_token_id=None)
        heads, eagle1, eagle3 = fitted_heads(model), fitted_drafter(model, "eagle1"), fitted_drafter(model, "eagle3")
        draft = noisy_copy(model, 0.02)
    finally:
        torch.set_num_threads(threads)
    embed, head = model.get_input_embeddings(), model.lm_head
    factories = {
        "vanilla": lambda: None,
        "medusa": lambda: make_proposer("medusa", heads=heads, paths=MEDUSA_TREE),
        "eagle1": lambda: make_proposer("eagle", drafter=eagle1, embed_tokens=embed, lm_head=head, depth=3, top_k=2,
                                        total_tokens=6),
        "eagle3": lambda: make_proposer("eagle", drafter=eagle3, embed_tokens=embed, lm_head=head,
                                        paths=[[0], [0, 0], [1], [0, 0, 0]]),
        "draft": lambda: make_proposer("draft", model=draft, vocab_size=128, num_tokens=3, tree_topk=[2]),
        "prompt_lookup": lambda: make_proposer("prompt_lookup", num_tokens=4, max_ngram=2, min_ngram=1),
        "lookahead": lambda: make_proposer("lookahead", lm_head=head, window=3, ngram=3, guess_set=3, seed=0),
    }
    return model, factories


def row_prompt(seed: int, length: int) -> list[int]:
    return torch.randint(4, 100, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_schedule(model, factories, schedule, max_num_seqs=3, add_kwargs=None, **engine_kwargs):
    """Add each request at its step; step until all are done -> (requests, the widest batch seen)."""
    engine = Engine(model, max_num_seqs=max_num_seqs, prefill_chunk=8, **engine_kwargs)
    requests, step, widest = {}, 0, 0
    while len(requests) < len(schedule) or engine.busy:
        for i, (kind, seed, length, new, at) in enumerate(schedule):
            if at == step:
                extra = add_kwargs(i) if add_kwargs else {}
                requests[i] = engine.add(row_prompt(seed, length), proposer=factories[kind](), max_new_tokens=new,
                                         eos_token_id=(), **extra)
        engine.step()
        widest = max(widest, len(engine.decoding))
        step += 1
    return [requests[i] for i in range(len(schedule))], widest


def bandwidth_bound(knee: int) -> StepCost:
    """A forward that costs the same up to `knee` tokens (reading the weights), then grows linearly."""
    return StepCost({n: 0.01 * max(1.0, n / knee) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)})


class Alternating:
    """A scripted budget: rows skip their proposer every other step, and other trees are cut to 2
    nodes past the root."""

    name = "alternating"

    def __init__(self):
        self.steps = 0

    def choose(self, rows):
        self.steps += 1
        return [0 if (self.steps + i) % 2 else 2 for i in range(len(rows))]

    def observe(self, *args):
        pass


def drafts_alone_and_together(model, template, prompts, new_tokens, monkeypatch, sampled=None):
    """Forks of `template` decode each prompt alone, then all of them as rows of one engine.

    -> (alone, together, widest): per prompt (its greedy output, the (tokens, parents) of every
    tree its proposer drafted), once alone and once in the batch; `widest` is the most rows one
    drafter forward served. A row's trees are recorded by spying on the proposer class's
    propose_batch (the solo path goes through it too). sampled(i): request i's sampling keywords
    (temperature, a fresh seeded generator), called once per run."""
    from draftsmith.decode.engine import generate

    cls, log = type(template), {}
    real = cls.propose_batch

    def spy(proposers, roots, hiddens, ids):
        trees = real(proposers, roots, hiddens, ids)
        for p, t in zip(proposers, trees):
            log.setdefault(id(p), []).append((t.tokens.tolist(), t.parents.tolist()))
        return trees

    monkeypatch.setattr(cls, "propose_batch", staticmethod(spy))
    rows_seen = []
    drafter = template.drafter if hasattr(template, "drafter") else template.decoder  # EAGLE | a draft model
    hook = drafter.register_forward_pre_hook(
        lambda module, args, kwargs: rows_seen.append((args[0] if args else kwargs["input_ids"]).shape[0]),
        with_kwargs=True)
    sampled = sampled or (lambda i: {})
    try:
        alone, forks = [], [template.fork() for _ in prompts]
        for i, (fork, p, new) in enumerate(zip(forks, prompts, new_tokens)):
            out = generate(model, torch.tensor([p]), proposer=fork, max_new_tokens=new, eos_token_id=(), **sampled(i))
            alone.append((out.tokens, log.pop(id(fork))))
        rows_seen.clear()
        forks = [template.fork() for _ in prompts]
        engine = Engine(model, max_num_seqs=len(prompts))
        requests = [engine.add(p, proposer=f, max_new_tokens=new, eos_token_id=(), **sampled(i))
                    for i, (f, p, new) in enumerate(zip(forks, prompts, new_tokens))]
        while engine.busy:
            engine.step()
        together = [(r.out, log.pop(id(f), [])) for r, f in zip(requests, forks)]
    finally:
        hook.remove()
    return alone, together, max(rows_seen)


def check_rows_draft_as_alone(model, template, prompts, new_tokens, monkeypatch, mask_module, sampled=None) -> list:
    """drafts_alone_and_together's checks: one drafter forward served all the rows, each row drafted
    exactly its trees alone (more than 3 steps) and emitted its tokens alone (at T = 0: the
    verifier's own greedy output); teeth: with `mask_module`'s additive_mask letting a token see
    every slot of its row (padding, other branches), the rows draft otherwise. -> together."""
    from tests.laws import reference

    alone, together, widest = drafts_alone_and_together(model, template, prompts, new_tokens, monkeypatch, sampled)
    assert widest == len(prompts)
    for p, n, (out_a, trees_a), (out_t, trees_t) in zip(prompts, new_tokens, alone, together):
        assert out_a == out_t and trees_a == trees_t and len(trees_a) > 3
        if sampled is None:
            assert out_a == reference(model, torch.tensor([p]), n, eos_token_id=None)
    monkeypatch.setattr(mask_module, "additive_mask", lambda allowed, dtype: torch.zeros(allowed.shape, dtype=dtype))
    _, broken, _ = drafts_alone_and_together(model, template, prompts, new_tokens, monkeypatch, sampled)
    assert [trees for _, trees in broken] != [trees for _, trees in together]
    return together
