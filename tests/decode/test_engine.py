"""decode/engine.py: losslessness of the fused loop, end to end through a real HF Llama.

- greedy identity: every method's output equals ``model.generate(do_sample=False)`` token for
  token (EOS, stop strings and max_new_tokens included), with Medusa heads good enough to
  accept several tokens per step and bad enough to be rejected often;
- sampling law: the first 3 tokens drawn through the engine follow the exactly enumerated law
  of the verifier (chi-square + total variation), for a chain and a tree, with temperature,
  top-k and top-p; a deliberately broken acceptance rule fails the same test.
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from scipy.stats import chisquare

from draftsmith.decode import sampling
from draftsmith.decode.engine import generate, summarize
from draftsmith.decode.proposers import PROPOSERS, make_proposer
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from tests.tiny import tiny_llama

CONF = Path(__file__).resolve().parents[2] / "conf" / "decode"
TREES = ["chain4", "medusa-small", "medusa-default"]


def tree_paths(name: str) -> list[list[int]]:
    return yaml.safe_load((CONF / f"{name}.yaml").read_text())["paths"]


# ---------------------------------------------------------------------------------------------
# greedy identity


def fitted_heads(model, num_heads: int = 4, steps: int = 100, seed: int = 0) -> MedusaHeads:
    """Medusa heads briefly fitted to the model's own greedy continuations of random prompts.

    Random (non-zero) ResBlocks, lm_heads copied from the verifier, 100 Adam steps: right often
    enough for multi-token acceptance (tau ~2), wrong often enough that rejection paths run.
    """
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, 100, (32, 4), generator=g)  # same range as the test prompts
    with torch.no_grad():
        seqs = model.generate(prompts, do_sample=False, max_new_tokens=40, eos_token_id=None)  # (32, 44)
        hidden = model.model(input_ids=seqs).last_hidden_state  # (32, 44, H)
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(model.config.hidden_size, vocab, num_heads=num_heads),
                        verifier_lm_head=model.lm_head).to(model.dtype)
    for block in heads.blocks:
        torch.nn.init.normal_(block.layers[0].weight, std=0.05)
    opt = torch.optim.Adam(heads.parameters(), lr=3e-3)
    span = seqs.shape[1] - num_heads - 2
    for _ in range(steps):
        logits = heads(hidden[:, :span])  # (K, 32, span, V)
        loss = sum(F.cross_entropy(logits[k].reshape(-1, vocab), seqs[:, k + 2 : k + 2 + span].reshape(-1))
                   for k in range(num_heads))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval().requires_grad_(False)


class RecordingRule:
    """Wraps an acceptance rule to record the accepted paths (to prove what the test ran)."""

    def __init__(self, rule):
        self.rule, self.paths = rule, []

    def __call__(self, *args, **kwargs):
        path, nxt = self.rule(*args, **kwargs)
        self.paths.append(path)
        return path, nxt


@pytest.fixture(scope="module")
def greedy_setup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before the per-test one_thread fixture
    try:
        model = tiny_llama(eos_token_id=None)  # no default EOS: each test picks one that occurs
        heads = fitted_heads(model)
    finally:
        torch.set_num_threads(threads)
    proposers = {"vanilla": None}
    for name in TREES:
        proposers[name] = make_proposer("medusa", heads=heads, paths=tree_paths(name))
    return model, proposers


def prompt(seed: int, length: int = 5) -> torch.Tensor:
    return torch.randint(4, 100, (1, length), generator=torch.Generator().manual_seed(seed))


def reference(model, ids, **kw) -> list[int]:
    out = model.generate(ids, do_sample=False, **kw)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("method", ["vanilla", *TREES])
def test_greedy_identity(greedy_setup, method, monkeypatch):
    model, proposers = greedy_setup
    recorder = RecordingRule(sampling.ACCEPTANCE_RULES["greedy"])
    monkeypatch.setitem(sampling.ACCEPTANCE_RULES, "greedy", recorder)
    outs = []
    for seed, n in [(100, 40), (101, 40), (102, 7), (103, 1), (104, 2)]:
        ids = prompt(seed)
        out = generate(model, ids, proposer=proposers[method], max_new_tokens=n)
        assert out.tokens == reference(model, ids, max_new_tokens=n), (method, seed)
        assert len(out.tokens) == n and out.stop_reason == "length" and not out.lossy
        outs.append(out)
    stats = summarize(outs[:2])  # the two 40-token runs
    if method == "vanilla":
        assert stats["tau"] == 1.0
    else:
        assert stats["tau"] > 1.2, stats  # multi-token acceptance happens...
        assert any(s.accepted == 0 for o in outs for s in o.steps)  # ...and so does rejection
    if method != "vanilla" and method != "chain4":
        # a non-first child of the root was accepted (the cache keep is not a prefix) and
        # decoding went on from that compacted cache
        assert len(recorder.paths) == sum(len(o.steps) for o in outs)
        last_steps, end = set(), 0
        for o in outs:
            end += len(o.steps)
            last_steps.add(end - 1)
        assert any(len(p) > 1 and p[1] != 1 and i not in last_steps for i, p in enumerate(recorder.paths))
    if method == "medusa-default":
        assert any(s.accepted >= 3 for o in outs for s in o.steps)


@pytest.mark.parametrize("method", ["vanilla", "chain4", "medusa-small"])
def test_greedy_identity_eos(greedy_setup, method):
    model, proposers = greedy_setup
    ids = prompt(105)
    free = reference(model, ids, max_new_tokens=30)
    for eos in ([free[11]], [free[0]], [free[20], free[6]]):  # ids that occur; first occurrence wins
        ref = reference(model, ids, max_new_tokens=30, eos_token_id=eos)
        assert len(ref) < 30 and ref[-1] in eos
        out = generate(model, ids, proposer=proposers[method], max_new_tokens=30, eos_token_id=eos)
        assert out.tokens == ref and out.stop_reason == "eos"
    # the default EOS is the model's generation_config one, as in HF generate
    model.generation_config.eos_token_id = free[9]
    try:
        out = generate(model, ids, proposer=proposers[method], max_new_tokens=30)
        assert out.tokens == reference(model, ids, max_new_tokens=30) and out.tokens[-1] == free[9]
    finally:
        model.generation_config.eos_token_id = None


@pytest.mark.parametrize("method", ["vanilla", "chain4", "medusa-default"])
def test_greedy_identity_stop_strings(greedy_setup, tokenizer, method):
    model, proposers = greedy_setup
    ids = prompt(106)
    free = reference(model, ids, max_new_tokens=40)
    # two consecutive generated characters (ids 4..103 are printable chars of the tokenizer)
    i = next(i for i in range(8, 38) if all(4 <= t < 100 for t in free[i : i + 2]))
    stop = tokenizer.decode(free[i : i + 2])
    assert len(stop) == 2
    for stops in ([stop], [stop, "@@never"], [tokenizer.decode(free[i + 1])]):
        ref = reference(model, ids, max_new_tokens=40, stop_strings=stops, tokenizer=tokenizer)
        assert len(ref) < 40
        out = generate(model, ids, proposer=proposers[method], max_new_tokens=40,
                       stop_strings=stops, tokenizer=tokenizer)
        assert out.tokens == ref and out.stop_reason == "stop_string"


def test_typical_acceptance_is_marked_lossy(greedy_setup):
    model, proposers = greedy_setup
    out = generate(model, prompt(107), proposer=proposers["medusa-small"], max_new_tokens=12,
                   temperature=0.7, acceptance="typical")
    assert out.lossy and out.acceptance == "typical" and len(out.tokens) == 12
    assert summarize([out])["lossy"]
    out = generate(model, prompt(107), proposer=proposers["medusa-small"], max_new_tokens=12,
                   temperature=0.7, generator=torch.Generator().manual_seed(0))
    assert not out.lossy and out.acceptance == "rejection"


def test_unknown_keys_list_the_valid_ones(greedy_setup):
    model, _ = greedy_setup
    with pytest.raises(ValueError, match=f"valid: {', '.join(sorted(PROPOSERS))}$"):
        make_proposer("eagle9")
    assert set(PROPOSERS) >= {"vanilla", "medusa", "eagle", "draft", "prompt_lookup", "lookahead"}
    with pytest.raises(ValueError, match="valid: auto, coupled, greedy, rejection, typical"):
        generate(model, prompt(0), acceptance="fast")
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt(0), acceptance="rejection")
    with pytest.raises(ValueError, match="batch size 1"):
        generate(model, torch.zeros(2, 3, dtype=torch.long))
    heads = MedusaHeads(MedusaConfig(32, 128, num_heads=2))
    with pytest.raises(ValueError, match="Medusa drafter has 2 heads"):
        make_proposer("medusa", heads=heads, paths=tree_paths("chain4"))


# ---------------------------------------------------------------------------------------------
# sampling law

V = 8  # vocabulary of the law tests: V**3 = 512 cells for the first 3 tokens
LAW_PROMPT = torch.tensor([[1, 5, 2]])
# 8k samples: TV 0.023-0.032 on seeds 1-3 against the scaled bound of ~0.046 (null_tv); the broken
# rules below fail the chi-square test at 600 and 1,200 samples
LAW_SAMPLES = 8_000


def law_model(logit_scale: float):
    """A 2-layer fp64 Llama over 8 tokens whose logits are scaled up so the law is peaked
    (a near-uniform law would hide a wrong rule and make the TV bound pure noise)."""
    model = tiny_llama(vocab_size=V, eos_token_id=None, pad_token_id=None, seed=3)
    model.lm_head.weight.data *= logit_scale
    return model


def random_heads(model, seed: int = 0) -> MedusaHeads:
    """Untrained heads with random (non-zero) ResBlocks: proposals vary with the state."""
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(model.config.hidden_size, V, num_heads=4),
                        verifier_lm_head=model.lm_head).to(model.dtype)
    for block in heads.blocks:
        torch.nn.init.normal_(block.layers[0].weight, std=0.3)
    return heads.eval().requires_grad_(False)


def exact_law(model, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """(V**3,) law of the first 3 new tokens, from the model's own conditionals (no cache)."""
    prefixes = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # (V*V, 2)
    seqs = torch.cat([LAW_PROMPT.expand(V * V, -1), prefixes], dim=1).to(model.device)  # (V*V, T+2)
    t = LAW_PROMPT.shape[1]
    with torch.no_grad():
        logits = model(input_ids=seqs).logits[:, t - 1 : t + 2]  # (V*V, 3, V)
    probs = sampling.logits_to_probs(logits, temperature, top_k, top_p)  # (V*V, 3, V)
    p1 = probs[0, 0]  # (V,)
    p2 = probs[::V, 1]  # (V, V): [a] -> law of the 2nd token after a
    p3 = probs[:, 2].reshape(V, V, V)  # [a, b] -> law of the 3rd token
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten()


def engine_counts(model, proposer, n, temperature, top_k, top_p, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V**3, dtype=torch.float64)
    for _ in range(n):
        a, b, c = generate(model, LAW_PROMPT, proposer=proposer, max_new_tokens=3, temperature=temperature,
                           top_k=top_k, top_p=top_p, generator=g, eos_token_id=()).tokens
        counts[(a * V + b) * V + c] += 1
    return counts


def null_tv(law: torch.Tensor, n: int, reps: int = 200, q: float = 0.99) -> float:
    """The q-quantile of the TV distance between n exact draws from `law` and `law`: a TV bound
    scaled to the sample size of each law test."""
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(law, n * reps, replacement=True, generator=g).view(reps, n)  # (reps, n)
    counts = torch.zeros(reps, law.numel(), dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(reps, n, dtype=torch.float64))  # (reps, V**3)
    return float(torch.quantile(0.5 * (counts / n - law).abs().sum(-1), q))


def law_test(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, float, float]:
    """(chi-square p-value with cells of expected < 5 merged, TV distance, mass on law-0 cells)."""
    n = counts.sum()
    expected = law * n
    impossible = float(counts[law == 0].sum() / n)
    big = expected >= 5
    small = (~big) & (law > 0)
    obs = [*counts[big].tolist(), float(counts[small].sum())]
    exp = [*expected[big].tolist(), float(expected[small].sum())]
    if exp[-1] < 5:  # merge the leftover bucket into the smallest regular cell
        j = min(range(len(exp) - 1), key=exp.__getitem__)
        obs[j] += obs.pop()
        exp[j] += exp.pop()
    exp_total = sum(exp)
    obs_total = sum(obs)
    exp = [e * obs_total / exp_total for e in exp]  # mass outside (impossible cells) is counted apart
    pvalue = float(chisquare(obs, exp).pvalue)
    tv = 0.5 * float((counts / n - law).abs().sum())
    return pvalue, tv, impossible


LAW_CASES = {
    # name: (tree, logit scale, temperature, top_k, top_p)
    "chain-T1-topk6": ("chain4", 25.0, 1.0, 6, 1.0),
    "tree-T0.7-topp0.9": ("medusa-small", 10.0, 0.7, 0, 0.9),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAW_CASES))
def test_sampling_law(case, monkeypatch):
    tree, scale, temperature, top_k, top_p = LAW_CASES[case]
    model = law_model(scale)
    law = exact_law(model, temperature, top_k, top_p)
    proposer = make_proposer("medusa", heads=random_heads(model), paths=tree_paths(tree))
    recorder = RecordingRule(sampling.ACCEPTANCE_RULES["rejection"])
    monkeypatch.setitem(sampling.ACCEPTANCE_RULES, "rejection", recorder)
    counts = engine_counts(model, proposer, LAW_SAMPLES, temperature, top_k, top_p, seed=1)
    pvalue, tv, impossible = law_test(counts, law)
    assert impossible == 0.0, "sampled a sequence the verifier's law gives probability 0"
    bound = 1.25 * null_tv(law, LAW_SAMPLES)
    assert pvalue > 1e-3, (pvalue, tv, bound)
    assert tv < bound, (pvalue, tv, bound)
    # the test exercised rejection, multi-token acceptance and (for trees) non-first siblings
    depths = [len(p) - 1 for p in recorder.paths]
    assert min(depths) == 0 and max(depths) >= 2
    if tree != "chain4":  # a non-first child of the root accepted: the cache keep is not a prefix
        assert any(len(p) > 1 and p[1] != 1 for p in recorder.paths)


def _children(parents: torch.Tensor) -> list[list[int]]:
    plist = parents.tolist()
    kids: list[list[int]] = [[] for _ in plist]
    for c, u in enumerate(plist[1:], start=1):
        kids[u].append(c)
    return kids


def residual_from_p_walk(tokens, parents, target_probs, draft_probs, sampled, generator):
    """BROKEN ON PURPOSE (blatant): after rejecting a deterministic child x it still draws
    from p instead of p with x removed, so drafted tokens are over-represented."""
    kids, tok = _children(parents), tokens.tolist()
    path, u = [0], 0
    while True:
        p = target_probs[u]
        for c in kids[u]:
            if torch.rand((), generator=generator, dtype=p.dtype) < p[tok[c]]:
                path.append(c)
                u = c
                break
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))


def stale_sibling_walk(tokens, parents, target_probs, draft_probs, sampled, generator):
    """BROKEN ON PURPOSE (subtle): the final residual draw is right, but later siblings are
    accepted with their ORIGINAL p(y) instead of the residual's p(y) / (1 - p(x)), so second
    and third candidates are under-represented."""
    kids, tok = _children(parents), tokens.tolist()
    path, u = [0], 0
    while True:
        p = target_probs[u]
        residual = p
        moved = False
        for c in kids[u]:
            if torch.rand((), generator=generator, dtype=p.dtype) < p[tok[c]]:  # bug: residual[x]
                path.append(c)
                u, moved = c, True
                break
            zeroed = residual.clone()
            zeroed[tok[c]] = 0.0
            if zeroed.sum() > 0:
                residual = zeroed / zeroed.sum()
        if not moved:
            return path, int(torch.multinomial(residual, 1, generator=generator))


@pytest.mark.slow
@pytest.mark.parametrize("broken, samples", [(residual_from_p_walk, 600), (stale_sibling_walk, 1_200)])
def test_sampling_law_catches_a_broken_rule(monkeypatch, broken, samples):
    tree, scale, temperature, top_k, top_p = LAW_CASES["tree-T0.7-topp0.9"]
    model = law_model(scale)
    law = exact_law(model, temperature, top_k, top_p)
    proposer = make_proposer("medusa", heads=random_heads(model), paths=tree_paths(tree))
    monkeypatch.setattr(sampling, "rejection_walk", broken)
    counts = engine_counts(model, proposer, samples, temperature, top_k, top_p, seed=1)
    pvalue, tv, _ = law_test(counts, law)
    assert pvalue < 1e-6, (pvalue, tv)


def test_sampling_without_a_generator_uses_torchs_default(greedy_setup):
    """generate(temperature > 0) needs no generator: torch's default one, seeded as usual."""
    model, proposers = greedy_setup
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(generate(model, prompt(108), proposer=proposers["medusa-small"], max_new_tokens=12,
                             temperature=0.9).tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 12
