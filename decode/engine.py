"""The fused speculative decoding loop: propose -> verify in ONE pass -> accept -> compact.

Every method (plain decoding, Medusa, EAGLE-1/3 with static or EAGLE-2 dynamic trees, draft
models, prompt lookup, lookahead) runs through ``generate``:

    prefill: one forward of the verifier's decoder over the prompt (decode.cache.new_cache)
             -> first token from the last position's logits (argmax or a sample) = first root
    step:    tree = proposer.propose(root, hidden before the root, ids)
             ONE decoder forward over tree.tokens with the tree mask and depth positions on
             the cache -> hidden (n, H); logits = lm_head(hidden) (n, V)
             acceptance rule -> (path, next_token); emitted = tokens[path[1:]] + [next_token]
             cache compacted to prompt + ... + root + accepted nodes; next_token is the next
             root (not in the cache); hidden[path[-1]] feeds the next proposal.
    A proposer with ``feature_layers`` (EAGLE-3) also gets those verifier layers' states of the
    prompt / tree nodes (``layer_hidden=``) in prefill / accept, from the same forwards.

"Fused": the hidden states the proposer needs for the next step come from the same
verification forward; there is never a second verifier pass.

Lossless: with temperature 0 the output equals the verifier's greedy ``generate`` token for
token; with temperature > 0 the emitted tokens follow exactly the verifier's law after
temperature / top-k / top-p (decode.sampling.logits_to_probs). ``acceptance="typical"``
(Medusa's typical acceptance) is LOSSY and marks the output ``lossy=True``.
"""

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel
from transformers.generation.stopping_criteria import StopStringCriteria

from draftsmith.decode import sampling
from draftsmith.decode.cache import check_compactable, compact_cache, new_cache
from draftsmith.decode.proposers import DraftTree, Proposer, VanillaProposer
from draftsmith.decode.sampling import SamplingParams
from draftsmith.models.errors import DraftsmithError

# Attention implementations known to add a 4D float mask to the scores as given.
TREE_MASK_ATTENTION = ("eager", "sdpa", "grouped")


@dataclass
class StepStats:
    """One verifier forward (prefill excluded)."""

    num_nodes: int  # tree nodes verified, root included
    accepted: int  # drafted tokens accepted (depth of the accepted path)
    emitted: int  # tokens emitted this step after EOS/stop/length truncation
    time_s: float  # wall time of the whole step
    propose_s: float = 0.0
    verify_s: float = 0.0  # verifier forward + lm_head
    accept_s: float = 0.0  # acceptance rule + cache compaction + stop checks + proposer.accept


@dataclass
class GenerationOutput:
    tokens: list[int]  # new tokens only (stop token included)
    steps: list[StepStats]
    lossy: bool  # True iff a lossy acceptance rule (typical) produced the tokens
    acceptance: str  # the rule actually used
    proposer: str
    stop_reason: str  # "eos" | "stop_string" | "length" | "cancelled" (on_tokens returned False)
    prefill_s: float = 0.0
    total_s: float = 0.0
    prompt_len: int = 0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verifier forward after the prefill (1.0 for plain decoding)."""
        if not self.steps:
            return float("nan")
        return sum(s.emitted for s in self.steps) / len(self.steps)


@dataclass
class _StopChecker:
    """Truncates emitted tokens exactly where HF ``generate`` would stop."""

    eos: frozenset[int]
    max_new_tokens: int
    stop_criteria: StopStringCriteria | None = None
    window: int = 0
    reason: str = field(default="length")

    def extend(self, out: list[int], ids: list[int], new: Iterable[int]) -> bool:
        """Append tokens to ``out`` and ``ids`` one by one; True once generation must stop."""
        for tok in new:
            out.append(tok)
            ids.append(tok)
            if tok in self.eos:
                self.reason = "eos"
                return True
            if self.stop_criteria is not None:
                tail = torch.tensor(ids[-self.window :], dtype=torch.long)[None]  # (1, w)
                if bool(self.stop_criteria(tail, None)[0]):
                    self.reason = "stop_string"
                    return True
            if len(out) >= self.max_new_tokens:
                self.reason = "length"
                return True
        return False


def _eos_set(model: PreTrainedModel, eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        gen_cfg = getattr(model, "generation_config", None)
        eos_token_id = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
        if eos_token_id is None:
            return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    if isinstance(eos_token_id, torch.Tensor):
        return frozenset(int(t) for t in eos_token_id.flatten().tolist())
    return frozenset(int(t) for t in eos_token_id)


def check_architecture(model: PreTrainedModel) -> None:
    """Refuse, before any work and in one line naming the setting, a verifier the engine cannot
    decode exactly: logits post-processed after lm_head, or a KV cache that cannot drop the
    rejected tree nodes (active sliding-window layers, recurrent state)."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    softcap = getattr(cfg, "final_logit_softcapping", None)
    scale = getattr(cfg, "logit_scale", None)
    if softcap is not None or scale not in (None, 1, 1.0):
        raise DraftsmithError(
            f"{type(model).__name__} post-processes its logits (config.final_logit_softcapping={softcap}, "
            f"config.logit_scale={scale}); the engine's lm_head(hidden) would differ from model(...).logits"
        )
    try:
        check_compactable(new_cache(model.config))
    except TypeError as e:
        raise DraftsmithError(f"{type(model).__name__} (config.model_type={cfg.model_type!r}): {e}") from None


def generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    proposer: Proposer | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    acceptance: str = "auto",
    eos_token_id: int | Sequence[int] | None = None,
    stop_strings: str | Sequence[str] | None = None,
    tokenizer=None,
    generator: torch.Generator | None = None,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
) -> GenerationOutput:
    """Decode up to ``max_new_tokens`` tokens after ``input_ids`` with speculative decoding.

    Batch size 1 only. ``model`` is the HF causal LM (``verifier.model``); it is run through
    its own decoder (``model.get_decoder()``) and output embeddings on ``decode.cache.new_cache``.

    Args:
      input_ids: (1, T) prompt.
      proposer: from ``decode.proposers.make_proposer``; None = plain decoding (the baseline,
        through the same loop with a one-node tree).
      temperature: 0 = greedy. > 0 samples from logits_to_probs(logits, temperature, top_k,
        top_p) (top_k=0 and top_p=1 disable those; note HF's generate defaults top_k=50).
      acceptance: "auto" (greedy if temperature == 0 else rejection), "greedy", "rejection"
        (recursive rejection sampling, lossless), or "typical" (Medusa, LOSSY: sets lossy).
      eos_token_id: int or list; None = ``model.generation_config.eos_token_id``; () = none.
        Generation stops after the first EOS, which is included, as in HF generate.
      stop_strings / tokenizer: stop after the token that completes a stop string (HF's
        StopStringCriteria, run on prompt + generated ids, so the same matches as generate).
      generator: torch.Generator for every random draw (sampling and acceptance); None uses
        torch's default generator (seed it with torch.manual_seed for reproducible samples).
      posterior_threshold / posterior_alpha: typical acceptance only.
      on_tokens: called with each step's emitted tokens as soon as they are accepted (the first
        token after the prefill, then every verification); returning False stops generation
        with stop_reason "cancelled" (a client that went away, a timeout).

    The verifier's generation_config logits processors (repetition penalty, etc.) are not
    applied: compare against HF generate with them off.
    """
    if not isinstance(model, PreTrainedModel) and isinstance(getattr(model, "model", None), PreTrainedModel):
        model = model.model  # a models.verifier.Verifier
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise DraftsmithError(f"input_ids must be (1, T): batch size 1 only, got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise DraftsmithError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    params = SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                            posterior_threshold=posterior_threshold, posterior_alpha=posterior_alpha)  # validated
    rule_name = sampling.resolve_rule(acceptance, params)
    rule = sampling.get_rule(rule_name)  # looked up per call, so a test can swap a rule in
    check_architecture(model)
    proposer = VanillaProposer(input_ids.device) if proposer is None else proposer
    stop = _stop_checker(model, max_new_tokens, eos_token_id, stop_strings, tokenizer)
    decoder, lm_head, dtype = model.get_decoder(), model.get_output_embeddings(), model.dtype
    tree_mask_ok = getattr(model.config, "_attn_implementation", None) in TREE_MASK_ATTENTION
    layers = _feature_layers(proposer, model)

    with torch.inference_mode():
        t_start = time.perf_counter()
        cache = new_cache(model.config)
        hidden, extra = _decoder_forward(decoder, layers, input_ids=input_ids, cache=cache, use_cache=True)  # (T, H)
        first = _first_token(lm_head(hidden[-1]), rule_name, params, generator)
        samples = getattr(proposer, "samples_drafts", None)  # a duck-typed proposer may lack the hook
        if samples is not None and samples(params):  # the draft's own draws follow this call's generator
            device = generator.device if generator is not None else "cpu"
            proposer.seed_draws(int(torch.randint(2**62, (), generator=generator, device=device)))
        proposer.prefill(input_ids[0], hidden, params, **extra)
        cache_len = input_ids.shape[1]  # tokens in the cache; the root never is
        ids: list[int] = input_ids[0].tolist()  # prompt + emitted (root included)
        out: list[int] = []
        steps: list[StepStats] = []
        done = stop.extend(out, ids, [first])
        if on_tokens is not None and on_tokens(out[:]) is False and not done:
            done, stop.reason = True, "cancelled"
        sync_device(input_ids.device)
        prefill_s = time.perf_counter() - t_start
        root, hidden_last = first, hidden[-1]  # (H,): the state whose logits gave the root

        while not done:
            t0 = time.perf_counter()
            tree: DraftTree = proposer.propose(root, hidden_last, ids)
            sync_device(input_ids.device)
            t1 = time.perf_counter()
            if tree.is_chain:  # causal = the chain's tree mask: the model's own mask, any attention
                mask, position_ids = None, None
            elif not tree_mask_ok:
                raise DraftsmithError(
                    f"attn_implementation={model.config._attn_implementation!r} cannot take a tree mask; "
                    "load the verifier with attn_implementation='sdpa' or decode with a chain"
                )
            else:
                mask, position_ids = tree.verify_inputs(cache_len, dtype)  # (1, 1, n, L + n), (1, n)
            hidden, extra = _decoder_forward(
                decoder, layers, input_ids=tree.tokens[None], attention_mask=mask, position_ids=position_ids,
                cache=cache, use_cache=True,
            )  # (n, H)
            logits = lm_head(hidden)  # (n, V)
            sync_device(input_ids.device)
            t2 = time.perf_counter()

            path, next_token = rule(tree, logits, params, generator)  # the acceptance rule
            compact_cache(cache, cache_len, path)
            cache_len += len(path)
            accepted = tree.tokens[path[1:]].tolist() if len(path) > 1 else []
            n_before = len(out)
            done = stop.extend(out, ids, accepted + [next_token])
            if on_tokens is not None and on_tokens(out[n_before:]) is False and not done:
                done, stop.reason = True, "cancelled"
            proposer.accept(tree, path, next_token, hidden, **extra)
            root, hidden_last = next_token, hidden[path[-1]]  # (H,)
            sync_device(input_ids.device)
            t3 = time.perf_counter()
            steps.append(StepStats(
                num_nodes=tree.size, accepted=len(path) - 1, emitted=len(out) - n_before,
                time_s=t3 - t0, propose_s=t1 - t0, verify_s=t2 - t1, accept_s=t3 - t2,
            ))

    return GenerationOutput(
        tokens=out, steps=steps, lossy=rule_name in sampling.LOSSY_RULES, acceptance=rule_name,
        proposer=proposer.name, stop_reason=stop.reason, prefill_s=prefill_s,
        total_s=time.perf_counter() - t_start, prompt_len=input_ids.shape[1],
    )


def sync_device(device: torch.device) -> None:
    """Wait for the GPU's queued kernels, so that the clock splits a step into propose / verify /
    accept as they ran (CUDA launches return at once); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _feature_layers(proposer: Proposer, model: PreTrainedModel) -> list[int]:
    """Verifier layers (0-based) whose outputs the proposer needs besides the final hidden state."""
    layers = [int(i) for i in getattr(proposer, "feature_layers", None) or ()]
    n = model.config.num_hidden_layers
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise DraftsmithError(f"{proposer.name} proposer asks for verifier layers {bad}; the verifier has {n} (0..{n - 1})")
    return layers


def _decoder_forward(decoder, layers: list[int], **kwargs) -> tuple[torch.Tensor, dict]:
    """One verifier decoder forward -> (final hidden (n, H), extra proposer inputs).

    With ``layers`` the extra dict holds ``layer_hidden`` (n, L*H): those layers' outputs,
    concatenated in order, indexed as models.verifier.Verifier.features does (what EAGLE-3
    trained on). Without, no hidden states are collected (plain and Medusa decoding)."""
    if not layers:
        return decoder(**kwargs).last_hidden_state[0], {}  # (n, H)
    out = decoder(**kwargs, output_hidden_states=True)
    hidden = out.last_hidden_state[0]  # (n, H)
    return hidden, {"layer_hidden": torch.cat([out.hidden_states[i + 1][0] for i in layers], dim=-1)}  # (n, L*H)


def _first_token(logits: torch.Tensor, rule_name: str, params: SamplingParams, generator) -> int:
    """The token after the prompt from its last logits (V,), as the verifier alone picks it."""
    if rule_name == "rejection":
        probs = sampling.logits_to_probs(logits, params.temperature, params.top_k, params.top_p)  # (V,)
        return sampling.sample(probs, generator)  # float64 inverse CDF
    return int(logits.argmax())  # greedy; typical also takes the argmax (Medusa's fast mode)


def _stop_checker(model, max_new_tokens, eos_token_id, stop_strings, tokenizer) -> _StopChecker:
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    criteria = None
    if stop_strings:
        if tokenizer is None:
            raise DraftsmithError("stop_strings need the tokenizer (tokenizer=...)")
        criteria = StopStringCriteria(tokenizer, list(stop_strings))
    return _StopChecker(
        eos=_eos_set(model, eos_token_id),
        max_new_tokens=max_new_tokens,
        stop_criteria=criteria,
        window=getattr(criteria, "maximum_token_len", 0),
    )


def summarize(outputs: Sequence[GenerationOutput]) -> dict:
    """Aggregate over generations: tau (emitted per verifier forward, prefill excluded),
    tokens_per_s (new tokens / total wall time, prefill included), and step timings."""
    steps = [s for o in outputs for s in o.steps]
    n_tokens = sum(len(o.tokens) for o in outputs)
    total_s = sum(o.total_s for o in outputs)
    n_steps = len(steps)
    mean = (lambda xs: sum(xs) / len(xs)) if n_steps else (lambda xs: float("nan"))
    return {
        "tau": mean([s.emitted for s in steps]),
        "tokens_per_s": n_tokens / total_s if total_s > 0 else float("nan"),
        "num_tokens": n_tokens,
        "num_steps": n_steps,
        "num_generations": len(outputs),
        "mean_accepted": mean([s.accepted for s in steps]),
        "mean_nodes": mean([s.num_nodes for s in steps]),
        "mean_step_s": mean([s.time_s for s in steps]),
        "mean_propose_s": mean([s.propose_s for s in steps]),
        "mean_verify_s": mean([s.verify_s for s in steps]),
        "mean_accept_s": mean([s.accept_s for s in steps]),
        "prefill_s": sum(o.prefill_s for o in outputs),
        "total_s": total_s,
        "lossy": any(o.lossy for o in outputs),
    }
