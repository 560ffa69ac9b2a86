"""Acceptance rules: walk a verified token tree, return the accepted path and the next token.

Conventions shared by every rule (see decode/tree.py): node 0 is the root (the last emitted
token, not yet in the KV cache), ``parents`` is in topological order, siblings are ordered by
index, ``tokens[i]`` is node i's token (``tokens[0]``, the root's, is never judged), and row i
of the target logits/probs is the verifier's next-token distribution after the path root..i.
Every rule returns ``(path, next_token)``: ``path`` the accepted node indices starting at 0,
``next_token`` the token emitted after the last accepted node (correction or bonus token). The
emitted tokens of the step are ``tokens[path[1:]] + [next_token]``; next_token is the next root.

greedy and rejection are lossless (greedy: identical to the verifier's argmax decoding;
rejection: the emitted tokens have exactly the verifier's sampling law). typical is LOSSY.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from draftsmith.decode.tree import ancestor_mask, path_to
from draftsmith.models.errors import DraftsmithError, choose


@dataclass(frozen=True)
class SamplingParams:
    """How the verifier's logits become the target law; validated once, here.

    temperature 0 = greedy (the argmax rule); > 0 samples from ``logits_to_probs``. top_k 0 and
    top_p 1 disable those (HF ``generate`` defaults top_k to 50; here it is off unless asked).
    posterior_threshold / posterior_alpha are for Medusa's typical acceptance (LOSSY) only.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    def __post_init__(self):
        if not self.temperature >= 0:
            raise DraftsmithError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise DraftsmithError(f"top_k={self.top_k}: must be an integer >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise DraftsmithError(f"top_p={self.top_p}: must be in (0, 1] (1 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """(..., V) logits in any dtype -> (..., V) processed sampling probabilities in float64.

    The verifier's law is defined from its logits as computed in its own dtype (bf16 logits are
    the bf16 model's output), but every step after that runs in float64: a bf16 softmax or
    cumsum over a 49k vocabulary puts the CDF on a 2^-8 grid, so only a few hundred tokens could
    ever be drawn. HF ``generate`` processes logits in fp32; float64 leaves no visible error.

    Rule, in HF ``generate``'s order: divide by ``temperature`` (> 0; greedy decoding is
    ``greedy_walk``, not temperature 0); if ``0 < top_k < V`` keep the tokens whose logit is
    >= the k-th largest (ties at the k-th value are all kept); softmax; if ``top_p < 1`` keep
    the smallest set of most likely tokens whose mass is >= top_p, i.e. a token is kept iff
    the mass of the tokens MORE likely than it is < top_p (so the top token is always kept,
    and tokens tied in probability are kept or cut together, as top-k keeps its ties);
    renormalise. The engine applies this same transform to the target p and the draft q.
    """
    if SamplingParams(temperature, top_k, top_p).greedy:  # validates all three
        raise DraftsmithError("temperature=0 is greedy decoding (greedy_walk); a sampling law needs temperature > 0")
    scores = logits.double() / temperature  # (..., V) float64 from here on
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # (..., 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # (..., V)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # (..., V)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # (..., V)
        # tokens of equal probability share the mass before their tie group: ties are all kept
        # or all cut (low-precision logits tie often), so the law does not depend on sort order
        idx = torch.arange(sorted_probs.shape[-1], device=probs.device).expand_as(sorted_probs)
        new_group = torch.ones_like(sorted_probs, dtype=torch.bool)
        new_group[..., 1:] = sorted_probs[..., 1:] != sorted_probs[..., :-1]
        group_start = torch.where(new_group, idx, 0).cummax(dim=-1).values  # (..., V)
        mass_before = mass_before.gather(-1, group_start)
        keep_sorted = mass_before < top_p
        keep_sorted[..., 0] = True  # the most likely token always survives
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # (..., V)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., V) -> (...) long: torch.argmax over the last axis, the first index on ties (as
    HF's greedy ``generate``), computed as ``max(dim=-1).indices``: torch documents the first maximal
    index for both, and tests/decode/test_sampling.py checks they agree on tie-heavy rows in every
    dtype. On a CPU in bf16 argmax is not vectorised: 16 rows of SmolLM2's 49,152 logits 1.32 ms
    against 0.24 (one row 0.17 against 0.03; fp32 alike, 0.23 against 0.20)."""
    return logits.max(dim=-1).indices


def _best_accepted_node(
    anc: torch.Tensor, ok: torch.Tensor, score: torch.Tensor | None = None
) -> int:
    """Deepest node whose whole root path passed ``ok``; ties -> larger score -> lower index.

    ``anc`` (n, n) is the tree's ancestor mask, ``ok`` (n,) bool whether each node's token
    passed its parent's test (ok[0] is ignored: the root is always accepted), ``score`` (n,)
    optionally breaks depth ties.
    """
    ok = ok.clone()
    ok[0] = True
    accepted = ~(anc & ~ok[None, :]).any(dim=-1)  # (n,) every node on the root path passed
    depth = anc.sum(dim=-1) - 1  # (n,)
    best_depth = depth.masked_fill(~accepted, -1).max()
    candidates = accepted & (depth == best_depth)  # (n,)
    if score is not None:
        s = score.masked_fill(~candidates, float("-inf"))
        candidates = candidates & (s == s.max())
    return int(candidates.nonzero()[0])  # lowest index among the remaining ties


def greedy_walk(
    tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor
) -> tuple[list[int], int]:
    """Lossless greedy rule: longest root path whose tokens are the verifier's argmax.

    Node i (i >= 1) passes iff ``tokens[i] == argmax(target_logits[parents[i]])``; the
    accepted path is the deepest node whose every node passed (the root always does), and
    ``next_token = argmax(target_logits[last])``. Argmax ties are broken by torch.argmax's
    first-index rule (the same as HF greedy ``generate``). Two siblings can only both pass if
    they carry the same token; then the deeper accepted subtree wins and, at equal depth, the
    lower node index (the emitted tokens are the same either way).

    tokens (n,) long, parents (n,) long, target_logits (n, V).
    """
    parents = torch.as_tensor(parents, dtype=torch.long, device=tokens.device)
    argmax = argmax_ids(target_logits)  # (n,)
    ok = torch.ones_like(tokens, dtype=torch.bool)  # (n,)
    ok[1:] = tokens[1:] == argmax[parents[1:]]
    last = _best_accepted_node(ancestor_mask(parents).to(ok.device), ok)
    return path_to(parents, last), int(argmax[last])


def typical_walk(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: float,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
) -> tuple[list[int], int]:
    """LOSSY: Medusa's typical acceptance (``evaluate_posterior``, typical, fast=True).

    With p = softmax(target_logits[parent] / temperature) and
    H(p) = -sum p log(p + 1e-5) (Medusa's entropy, epsilon included), node i passes iff
    ``p(tokens[i]) > min(posterior_threshold, posterior_alpha * exp(-H(p)))``. The accepted
    path is the deepest node whose whole root path passed; among equally deep ones Medusa
    keeps the highest likelihood sum(log p(token)) along the path (then the lowest index).
    ``next_token = argmax(target_logits[last])``, as Medusa's ``generate_candidates`` does in
    its default fast mode. The emitted text does NOT follow the verifier's law: every report
    that uses this rule must say so.

    tokens (n,) long, parents (n,) long, target_logits (n, V).
    """
    parents = torch.as_tensor(parents, dtype=torch.long, device=tokens.device)
    probs = torch.softmax(target_logits.double() / temperature, dim=-1)  # (n, V) float64
    entropy = -(probs * torch.log(probs + 1e-5)).sum(dim=-1)  # (n,)
    threshold = torch.minimum(
        torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy)
    )  # (n,)
    token_prob = torch.ones_like(entropy)  # (n,) p(token | parent), 1 for the root
    token_prob[1:] = probs[parents[1:], tokens[1:]]
    ok = torch.ones_like(tokens, dtype=torch.bool)  # (n,)
    ok[1:] = token_prob[1:] > threshold[parents[1:]]
    anc = ancestor_mask(parents).to(probs.device)  # (n, n)
    log_likelihood = torch.where(anc, torch.log(token_prob)[None, :], 0.0).sum(dim=-1)  # (n,)
    last = _best_accepted_node(anc, ok, score=log_likelihood)
    return path_to(parents, last), int(argmax_ids(target_logits[last]))


def _accept_prob(p_x: float, q_x: float) -> float:
    """Speculative sampling's acceptance probability of a drafted token: min(1, p(x) / q(x))."""
    return min(1.0, p_x / q_x)


def _accept(u: float, p_x: float, q_x: float) -> bool:
    """One acceptance decision: a uniform u in [0, 1) below min(1, p(x) / q(x))."""
    return u < _accept_prob(p_x, q_x)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Target law after rejecting a draft from q: norm(max(p - q, 0)), (V,) -> (V,) float64.

    It has no mass only when p <= q everywhere, i.e. p == q, where rejection has probability
    zero and happens only through rounding; then p is kept (any choice costs ~1e-16 in law).
    """
    p = p.double()
    r = (p - q.double()).clamp_(min=0.0)  # (V,)
    total = float(r.sum())
    return r.div_(total) if total > 0 else p


def without(q: torch.Tensor, removed: list[int]) -> torch.Tensor | None:
    """Law of the next sibling drawn without replacement: the ORIGINAL draft law q (V,) with
    every token drawn before (``removed``) zeroed, renormalised, in float64. None when nothing
    is left."""
    q = q.double().clone()  # (V,)
    q[removed] = 0.0
    mass = float(q.sum())
    return q.div_(mass) if mass > 0 else None


def _sample(p: torch.Tensor, u: float | torch.Tensor) -> int | torch.Tensor:
    """Inverse-CDF draw from p (V,) (any dtype; the CDF is built in float64) given a uniform u
    in [0, 1): a float gives an int, a tensor (m,) of uniforms gives (m,) long tokens.

    Token i is drawn iff cdf[i-1] <= u * total < cdf[i]: exactly probability p(i) / total. A
    zero-probability token is never drawn (it adds nothing to the cumulative sum).
    """
    cdf = torch.cumsum(p.double(), dim=0)  # (V,)
    scalar = not isinstance(u, torch.Tensor)
    u_t = torch.as_tensor(u, dtype=torch.float64, device=cdf.device).reshape(-1)  # (m,)
    tokens = torch.searchsorted(cdf, cdf[-1] * u_t, right=True)  # (m,)
    over = tokens >= p.numel()  # u * total rounded up to the total: take the last likely token
    if bool(over.any()):
        tokens[over] = int(p.nonzero()[-1])
    return int(tokens[0]) if scalar else tokens


def _uniforms(n: int, generator: torch.Generator | None, device) -> list[float]:
    """n float64 uniforms in [0, 1) from ``generator`` (None: torch's default generator)."""
    device = generator.device if generator is not None else device
    return torch.rand(n, generator=generator, dtype=torch.float64, device=device).tolist()


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from probs (V,) by inverse CDF with one float64 uniform from ``generator``."""
    return _sample(probs, _uniforms(1, generator, probs.device)[0])


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(B, V) laws -> (B,) tokens: `_sample`'s rule row by row, one float64 uniform per row from
    ``generator`` (zero mass is never drawn; u * total rounded up takes the last likely token)."""
    cdf = torch.cumsum(probs.double(), dim=-1)  # (B, V)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, generator=generator, device=probs.device)  # (B, 1)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]  # (B,)
    last = probs.shape[-1] - 1 - torch.flip(probs > 0, dims=[-1]).long().argmax(-1)  # (B,) last token with mass
    return torch.minimum(tokens, last)


def rejection_walk(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampled: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Lossless recursive rejection sampling over a tree (SpecInfer / EAGLE multi-draft).

    ``target_probs[u]`` (n, V) is the processed verifier law after root..u. The children of u
    were drafted either by SAMPLING (``sampled[u]``) one after another without replacement
    from ``draft_probs[u]`` (n, V), in index order, or DETERMINISTICALLY (e.g. Medusa top-k),
    which is the case q = delta(x) for each child x. ``sampled=None`` means every node is
    sampled when ``draft_probs`` is given; ``draft_probs=None`` means all deterministic. A chain
    drafted by a draft model is one sampled child per node (Leviathan et al.).

    At node u, with residual p = target_probs[u] and q = draft_probs[u], try each child c with
    token x in index order:
      accept with probability min(1, p(x) / q(x)), q = delta(x) for a deterministic child (so
      the probability is p(x)); on accept move to c and restart there with p = target_probs[c];
      on reject p <- norm(max(p - q, 0)) (for delta(x): p with x zeroed, renormalised) and, if
      sampled, q <- q with x zeroed, renormalised; if q has no mass left, stop trying children.
    When no child is accepted (or u is a leaf) next_token ~ the current residual p.

    Each step preserves the law: given x ~ q, accepting with min(1, p/q) and otherwise drawing
    from norm((p - q)+) yields exactly p, and the later children (whatever q they come from)
    are only ever used to draw from that residual. Every random number comes from
    ``generator`` (any device; None = torch's default generator): n float64 uniforms drawn up
    front, one per child (each child is tried at most once) and one (the root's slot) for
    next_token, drawn from p by inverse CDF. Every law (residuals, q without the tried tokens,
    the CDF) is computed in float64 whatever the dtype of the inputs.

    Returns (path, next_token); path starts at 0. Raises ValueError if a sampled child's token
    has draft probability 0 (it cannot have come from that q).
    """
    parents_list = torch.as_tensor(parents, dtype=torch.long).tolist()
    n = len(parents_list)
    children: list[list[int]] = [[] for _ in range(n)]
    for c, u in enumerate(parents_list[1:], start=1):
        children[u].append(c)
    tok = torch.as_tensor(tokens).tolist()
    if draft_probs is None:
        is_sampled = [False] * n
    elif sampled is None:
        is_sampled = [True] * n
    else:
        is_sampled = torch.as_tensor(sampled, dtype=torch.bool).tolist()
    # uniform[c] decides child c (each child is tried at most once), uniform[0] the next token
    uniform = _uniforms(n, generator, target_probs.device)

    path = [0]
    u = 0
    while True:
        p = target_probs[u].double()  # (V,) residual; rebound, never modified in place
        q = draft_probs[u].double() if is_sampled[u] else None  # (V,) law of the untried children
        q_orig, tried = q, []
        moved = False
        for c in children[u]:
            x = tok[c]
            q_x = 1.0 if q is None else float(q[x])  # a deterministic child has q = delta(x)
            if not q_x > 0:
                raise ValueError(
                    f"node {c} (token {x}) has draft probability 0 under draft_probs[{u}]: "
                    "it cannot have been sampled from it"
                )
            if _accept(uniform[c], float(p[x]), q_x):
                path.append(c)
                u = c
                moved = True
                break
            if q is None:
                delta = torch.zeros_like(p)  # (V,)
                delta[x] = 1.0
                p = _residual(p, delta)
            else:
                p = _residual(p, q)
                tried.append(x)
                q = without(q_orig, tried)
                if q is None:
                    break  # the draft law is exhausted: no further child can come from it
        if not moved:
            return path, _sample(p, uniform[0])


# The engine calls every rule the same way: rule(tree, logits, params, generator) -> (path,
# next_token), with tree a decode.proposers.DraftTree (tokens, parents, draft_probs, sampled),
# logits (n, V) in the verifier's dtype and params a SamplingParams. Each adapter below feeds
# its pure walk what it needs (the walks are looked up at call time, so a test can swap one).


def _greedy_rule(tree, logits, params, generator):
    return greedy_walk(tree.tokens, tree.parents, logits)


class PositionNoise:
    """Gumbel noise keyed by (a request's seed, the position of the token it draws): the
    randomness of coupled sampling. Position t's noise is the same whatever was drafted, however
    many tokens a step verified and whoever shared the batch, so the tokens are too."""

    def __init__(self, seed: int, base: int = 0):
        self.seed, self.base = int(seed), int(base)

    def at(self, base: int) -> "PositionNoise":
        """The noise of the positions from `base` on (a tree whose depth-0 node predicts position `base`)."""
        return PositionNoise(self.seed, base)

    def gumbel(self, depth: int, vocab: int, device) -> torch.Tensor:
        """(vocab,) float64 Gumbel(0, 1) noise of position base + depth."""
        position = self.base + depth
        g = torch.Generator(device="cpu").manual_seed((self.seed * 0x9E3779B97F4A7C15 + position) % (1 << 63))
        u = torch.rand(vocab, dtype=torch.float64, generator=g)
        return (-torch.log(-torch.log(u.clamp_min(1e-300)))).to(device)


def coupled_sample(probs: torch.Tensor, noise: torch.Tensor) -> int:
    """argmax of log p + Gumbel noise over the tokens with mass: an exact draw from probs (V,)."""
    return int(torch.where(probs > 0, probs.log() + noise, float("-inf")).argmax())


def coupled_walk(tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                 noise: PositionNoise) -> tuple[list[int], int]:
    """Lossless coupled sampling over a tree: the token after node u is the Gumbel-max draw of
    its target law with the noise of its position (its depth); a child is accepted iff it IS
    that token. Each position's token is an exact draw from the verifier's law (Gumbel-max),
    with noise independent across positions, so the output law is the verifier's; and it is the
    very token plain sampling with the same seed emits, whatever the drafts (a deterministic
    draft x is accepted with probability p(x), as in recursive rejection sampling).

    tokens (n,), parents (n,), target_probs (n, V) float64 (logits_to_probs)."""
    parents = torch.as_tensor(parents, dtype=torch.long, device=tokens.device)
    anc = ancestor_mask(parents).to(tokens.device)
    depths = (anc.sum(dim=-1) - 1).tolist()
    vocab = target_probs.shape[-1]
    noise_at = {d: noise.gumbel(d, vocab, target_probs.device) for d in sorted(set(depths))}
    drawn = torch.tensor([coupled_sample(target_probs[u], noise_at[d]) for u, d in enumerate(depths)],
                         device=tokens.device)  # (n,) the token each node's law draws next
    ok = torch.ones_like(tokens, dtype=torch.bool)
    ok[1:] = tokens[1:] == drawn[parents[1:]]
    last = _best_accepted_node(anc, ok)
    return path_to(parents, last), int(drawn[last])


def _coupled_rule(tree, logits, params, noise: PositionNoise):
    probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)  # (n, V) float64
    return coupled_walk(tree.tokens, tree.parents, probs, noise)


def _rejection_rule(tree, logits, params, generator):
    probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)  # (n, V) float64
    return rejection_walk(tree.tokens, tree.parents, probs, tree.draft_probs, tree.sampled, generator)


def _typical_rule(tree, logits, params, generator):
    return typical_walk(tree.tokens, tree.parents, logits, params.temperature, params.posterior_threshold,
                        params.posterior_alpha)


ACCEPTANCE_RULES: dict[str, Callable[..., tuple[list[int], int]]] = {
    "greedy": _greedy_rule,
    "rejection": _rejection_rule,
    "coupled": _coupled_rule,  # draws from PositionNoise (the engine passes it as the generator)
    "typical": _typical_rule,
}
NOISE_RULES = {"coupled"}  # rules whose randomness is keyed by position, not a generator stream
LOSSY_RULES = {"typical"}


def resolve_rule(acceptance: str, params: SamplingParams) -> str:
    """The rule a decode runs: "auto" is greedy at temperature 0 and rejection sampling above;
    a rule that cannot run with these settings is refused in one line."""
    choose({"auto": None, **ACCEPTANCE_RULES}, acceptance, "acceptance")
    if acceptance == "auto":
        return "greedy" if params.greedy else "rejection"
    if acceptance == "greedy" and not params.greedy:
        raise DraftsmithError("acceptance=greedy needs temperature=0 (use rejection or auto to sample)")
    if acceptance in ("rejection", "coupled", "typical") and params.greedy:
        raise DraftsmithError(f"acceptance={acceptance} needs temperature > 0 (temperature=0 is greedy)")
    if acceptance == "typical" and (params.top_k or params.top_p < 1):
        raise DraftsmithError(f"acceptance=typical (Medusa's, LOSSY) thresholds the untruncated law: it cannot honour "
                              f"top_k={params.top_k} / top_p={params.top_p}; set top_k=0 top_p=1, or use rejection")
    return acceptance


def get_rule(name: str) -> Callable[..., tuple[list[int], int]]:
    """The acceptance rule registered under ``name``; one line listing the valid names otherwise."""
    return choose(ACCEPTANCE_RULES, name, "acceptance")
