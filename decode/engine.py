"""The engine: continuous batching of lossless speculative decoding, one verifier forward a step.

Every method (plain decoding, Medusa, EAGLE-1/3 with static or EAGLE-2 dynamic trees, draft
models, prompt lookup, the datastore and the grafts, lookahead) runs through ``Engine``; the
batch-1 ``generate`` is an engine with one row.

    engine = Engine(model, max_num_seqs=16)
    seq = engine.add(prompt_ids, proposer=..., max_new_tokens=128, temperature=0.7, generator=g)
    while engine.busy:
        engine.step()          # every live row advances; seq.out grows; seq.done when it stops

One step:
    decode:  each decoding row's proposer proposes a tree (a row whose budget is 0 this step
             verifies its root alone: plain decoding is the empty tree); the trees are padded to
             one width N and verified in ONE forward (decode/forward.py) over the static cache;
             lm_head over the real nodes; each row's acceptance rule (its own sampling
             parameters and generator) -> (path, next token); every row's accepted path is
             compacted in the cache by one fixed-size gather; the proposers get the hidden
             states of their nodes ("fused": no second verifier pass).
    prefill: rows still reading their prompt feed their next chunk (at most ``prefill_chunk``
             tokens a step in all; each chunk a step of its own shape in the decoding rows'
             forward), so a long prompt never stalls the running rows; a row whose
             prompt is read takes its first token from the last position's logits and decodes
             from the next step on.
Rows join (``add``) and leave (stop, ``cancel``) at any step; a finished row's cache row is
given to another by one copy. Decoding rows hold cache rows 0..B-1 (the forward reads views,
no gather); rows in prefill hold the top rows.

How many draft tokens each row verifies is the budget policy's choice (decode/budget.py:
``fixed`` = every proposer's whole tree, ``adaptive`` = maximise the batch's expected tokens
per second from the measured cost of a forward and each row's acceptance; budget 0 skips
the proposer: plain decoding, at no extra cost).

Lossless: at temperature 0 every row's output equals the verifier's greedy ``generate`` on that
prompt alone, token for token (in the forward's dtype); at temperature > 0 every emitted token
follows the verifier's law after temperature / top-k / top-p (decode.sampling.logits_to_probs),
drawn from the row's own generator. ``acceptance="typical"`` (Medusa's typical acceptance) is
LOSSY and marks the output ``lossy=True``.
"""

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel
from transformers.generation.stopping_criteria import StopStringCriteria

from draftsmith.decode import sampling
from draftsmith.decode.budget import BUDGETS, FixedBudget, make_budget
from draftsmith.decode.cache import check_compactable, new_cache
from draftsmith.decode.forward import make_forward
from draftsmith.decode.proposers import DraftTree, Proposer, VanillaProposer
from draftsmith.decode.sampling import SamplingParams
from draftsmith.decode.tree import ancestor_mask
from draftsmith.models.errors import DraftsmithError, choose

# Attention implementations known to add a 4D float mask to the scores as given (engine.forward=hf).
TREE_MASK_ATTENTION = ("eager", "sdpa", "grouped")
SLOT_BUCKET = 64  # the attended length S is rounded up to a multiple of this (fewer distinct shapes)


def width_bucket(n: int) -> int:
    """The padded tree width of a step: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(0, (n - 1).bit_length())


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


@dataclass(eq=False)
class Request:
    """One sequence the engine decodes: its settings and its progress (``out``, ``steps``)."""

    prompt: list[int]
    proposer: Proposer
    params: SamplingParams
    rule_name: str
    stop: "_StopChecker"
    generator: torch.Generator | None = None
    on_tokens: Callable[[list[int]], bool | None] | None = None
    capture: tuple[int, ...] = ()  # verifier layers whose states the proposer needs (EAGLE-3)
    cancel_requested: bool = False  # Engine.cancel: stop at the next step
    noise: sampling.PositionNoise | None = None  # acceptance=coupled: the request's position-keyed noise
    # progress
    row: int = -1  # cache row
    cache_len: int = 0  # tokens in the cache (the root never is)
    fed: int = 0  # prompt tokens read
    root: int | None = None  # the last emitted token: node 0 of the next tree
    hidden_last: torch.Tensor | None = None  # (H,) the state whose logits gave the root
    ids: list[int] = field(default_factory=list)  # prompt + emitted
    out: list[int] = field(default_factory=list)  # emitted tokens
    steps: list = field(default_factory=list)  # StepStats, one per verification
    done: bool = False
    error: BaseException | None = None  # a proposer that raised: this request fails alone
    prompt_hidden: list = field(default_factory=list)  # (t, H) chunks of the prompt's states
    prompt_layers: list = field(default_factory=list)  # (t, L*H) chunks (capture)
    t_start: float = 0.0
    prefill_s: float = 0.0
    total_s: float = 0.0

    @property
    def decoding(self) -> bool:
        return self.root is not None and not self.done

    def result(self) -> "GenerationOutput":
        return GenerationOutput(tokens=self.out, steps=self.steps, lossy=self.rule_name in sampling.LOSSY_RULES,
                                acceptance=self.rule_name, proposer=self.proposer.name, stop_reason=self.stop.reason,
                                prefill_s=self.prefill_s, total_s=self.total_s, prompt_len=len(self.prompt))


class Engine:
    """Continuous batching of speculative decoding over one verifier (see the module docstring).

    model: the HF causal LM (or a models.verifier.Verifier). max_num_seqs: rows decoded
    together. max_len: cache slots per row (prompt + new tokens + one tree; grown when a row
    needs more). forward: fast | hf | auto (decode/forward.py); invariant, compile, weights: its modes.
    prefill_chunk: prompt tokens read per step in all. budget: a decode.budget policy (None = fixed: every proposer's whole tree).
    """

    def __init__(self, model, *, max_num_seqs: int = 1, max_len: int = 1024, forward: str = "auto",
                 prefill_chunk: int = 512, budget=None, invariant=False, compile: str = "none",
                 weights: str = "auto"):
        if not isinstance(model, PreTrainedModel) and isinstance(getattr(model, "model", None), PreTrainedModel):
            model = model.model  # a models.verifier.Verifier
        if max_num_seqs < 1 or max_len < 2 or prefill_chunk < 1:
            raise DraftsmithError(f"max_num_seqs={max_num_seqs}, max_len={max_len}, prefill_chunk={prefill_chunk}: "
                                  f"each must be >= 1 (max_len >= 2)")
        check_architecture(model)
        self.model, self.lm_head = model, model.get_output_embeddings()
        self.device = self.lm_head.weight.device
        self.forward = make_forward(model, forward, max_num_seqs + 1, max_len, invariant, compile, weights)  # + a spare row
        if self.forward.name == "hf" and getattr(model.config, "_attn_implementation", None) not in TREE_MASK_ATTENTION:
            raise DraftsmithError(f"attn_implementation={model.config._attn_implementation!r} cannot take the engine's "
                                  f"4D masks; load the verifier with attn_implementation='sdpa'")
        self.max_num_seqs, self.prefill_chunk = max_num_seqs, prefill_chunk
        self.budget = FixedBudget() if budget is None else budget
        self.last_step: dict = {}  # the last decoding step: rows, width, rows that drafted, verify seconds
        self.prefix: list[int] = []  # set_prefix: tokens whose keys / values sit in the spare row
        self.prefix_hidden: torch.Tensor | None = None  # (P, H)
        self.decoding: list[Request] = []  # cache rows 0..B-1, in this order
        self.prefilling: list[Request] = []  # rows reading their prompt (top cache rows)
        self.waiting: list[Request] = []  # not yet given a cache row
        self.finished: list[Request] = []  # done since the last step() returned them
        self.lock = threading.Lock()  # add / cancel from other threads

    # ------------------------------------------------------------------ requests

    def add(self, prompt: Sequence[int], *, proposer: Proposer | None = None, max_new_tokens: int = 128,
            temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, acceptance: str = "auto",
            eos_token_id=None, stop_strings=None, tokenizer=None, generator: torch.Generator | None = None,
            posterior_threshold: float = 0.09, posterior_alpha: float = 0.3,
            on_tokens: Callable[[list[int]], bool | None] | None = None) -> Request:
        """Queue a request; it joins the batch at the next step with a free row."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise DraftsmithError("the prompt is empty: give at least one token")
        if max_new_tokens < 1:
            raise DraftsmithError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        params = SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                                posterior_threshold=posterior_threshold, posterior_alpha=posterior_alpha)
        rule_name = sampling.resolve_rule(acceptance, params)
        proposer = VanillaProposer(self.device) if proposer is None else proposer
        request = Request(prompt=prompt, proposer=proposer, params=params, rule_name=rule_name,
                          stop=_stop_checker(self.model, max_new_tokens, eos_token_id, stop_strings, tokenizer),
                          generator=generator, on_tokens=on_tokens, capture=tuple(_feature_layers(proposer, self.model)),
                          ids=list(prompt), t_start=time.perf_counter())
        if rule_name in sampling.NOISE_RULES:  # one draw from the request's generator seeds every position
            device = generator.device if generator is not None else "cpu"
            request.noise = sampling.PositionNoise(int(torch.randint(2**62, (), generator=generator, device=device)))
        self._reserve(request, len(prompt) + max_new_tokens)
        with self.lock:
            self.waiting.append(request)
        return request

    def set_prefix(self, tokens: Sequence[int]) -> None:
        """Read `tokens` once into the spare cache row: every later request whose prompt starts with
        them (and is longer) gets their keys / values by one copy and reads only the rest (a chat
        template's system prompt, shared by every self-distillation prompt). Requests whose proposer
        needs layer states (EAGLE-3) read their whole prompt."""
        self.prefix, self.prefix_hidden = [int(t) for t in tokens], None
        if not self.prefix:
            return
        spare = self.max_num_seqs
        self._reserve(None, len(self.prefix))
        tree = chain_tree(self.prefix, self.device)
        inputs = batch_inputs([tree], [0], tree.size, self.device)
        length = _slot_bucket(tree.size, self.forward.cache.max_len)
        with torch.inference_mode():
            hidden, _ = self.forward(inputs.tokens, inputs.positions, inputs.slots, inputs.allowed(length),
                                     torch.tensor([spare], device=self.device), length)
        self.prefix_hidden = hidden[0]  # (P, H)

    def _share_prefix(self, request: Request) -> None:
        P = len(self.prefix)
        if P and not request.capture and len(request.prompt) > P and request.prompt[:P] == self.prefix:
            self.forward.cache.move_row(self.max_num_seqs, request.row, P)
            request.fed = request.cache_len = P
            request.prompt_hidden.append(self.prefix_hidden)

    def cancel(self, request: Request) -> None:
        """Stop a request at the next step (stop_reason "cancelled"); its row is freed."""
        request.cancel_requested = True

    def reset(self) -> None:
        """Drop every row (after a failed step): the engine is empty and can take new requests."""
        with self.lock:
            self.decoding, self.prefilling, self.waiting, self.finished = [], [], [], []

    @property
    def busy(self) -> bool:
        return bool(self.decoding or self.prefilling or self.waiting)

    def _reserve(self, request: Request | None, tokens: int) -> None:
        """Grow the cache when a request may need more slots than a row has (prompt + new tokens
        + the widest tree)."""
        need = tokens + 2 * SLOT_BUCKET
        cache = self.forward.cache
        if need > cache.max_len:
            cache.grow(need)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Advance every live row by one verification (decoding rows) or one prompt chunk
        (prefilling rows); -> the requests that finished (or were cancelled) in this step."""
        with self.lock:
            self._admit()
        self._release()  # cancelled since the last step: gone before any work
        chunks = self._chunks() if self.prefilling else None
        if self.decoding:
            self._decode(chunks)  # the prompt chunks ride in the decoding rows' forward
        elif chunks is not None:
            self._prefill(chunks)
        self._release()
        out, self.finished = self.finished, []
        return out

    def _admit(self) -> None:
        while self.waiting and len(self.decoding) + len(self.prefilling) < self.max_num_seqs:
            request = self.waiting.pop(0)
            used = {r.row for r in self.prefilling}
            request.row = max(r for r in range(self.max_num_seqs) if r not in used and r >= len(self.decoding))
            self._share_prefix(request)
            self.prefilling.append(request)

    def _release(self) -> None:
        """Finished and cancelled rows leave (to self.finished); the last decoding row takes a
        freed decoding row's cache row."""
        done = [r for r in self.decoding + self.prefilling if r.done or r.cancel_requested]
        for request in done:
            if not request.done:
                request.stop.reason, request.done = "cancelled", True
            request.total_s = time.perf_counter() - request.t_start
            if request in self.prefilling:
                self.prefilling.remove(request)
                continue
            index = self.decoding.index(request)
            last = self.decoding.pop()
            if last is not request:  # the last row moves into the hole: rows stay 0..B-1
                self.forward.cache.move_row(last.row, request.row, last.cache_len)
                last.row = request.row
                self.decoding[index] = last
        self.finished += done

    # ------------------------------------------------------------------ decoding rows

    def _decode(self, chunks: "_Chunks | None" = None) -> None:
        """One verification of every decoding row; `chunks` (prompt chunks of rows still reading
        their prompt) ride in the same forward: the weights are read once for both."""
        rows = self.decoding
        t0 = time.perf_counter()
        budgets = self.budget.choose(rows)
        batched = self._propose_batched(rows, budgets)  # rows whose drafters propose together
        trees, proposed, propose_s = [], [], []
        for b, (request, budget) in enumerate(zip(rows, budgets)):
            t = time.perf_counter()
            tree, ran = batched[b] if b in batched else self._propose(request, budget)
            trees.append(tree)
            proposed.append(ran)
            propose_s.append(batched.seconds.get(b, 0.0) + time.perf_counter() - t)
        sync_device(self.device)
        t1 = time.perf_counter()
        width = width_bucket(max(t.size for t in trees))
        inputs = batch_inputs(trees, [r.cache_len for r in rows], width, self.device, self.forward.cache.max_len)
        length = _slot_bucket(max(r.cache_len for r in rows) + width, self.forward.cache.max_len)
        capture = sorted({i for r in rows for i in r.capture} | set(chunks.capture if chunks else ()))
        steps = [(inputs.tokens, inputs.positions, inputs.slots, inputs.allowed(length), len(rows), length)]
        outs = self.forward.many(steps + (chunks.steps if chunks else []), capture)
        hidden, captured = outs[0]
        real = hidden[inputs.real]  # (sum n, H)
        logits = self.forward.logits(real)  # (sum n, V)
        sync_device(self.device)
        t2 = time.perf_counter()
        order = torch.arange(width, device=self.device).repeat(len(rows), 1)  # (B, N)
        starts = torch.tensor([0] + [t.size for t in trees], device=self.device).cumsum(0)  # each row's first node
        greedy = self._plain_greedy(rows, trees, logits, starts)  # root-only greedy rows, in one argmax
        results, moved = [], False
        work_s = list(propose_s)  # each row's own work: its proposal, its rule, its proposer's update
        for b, (request, tree) in enumerate(zip(rows, trees)):
            if b in greedy:
                results.append(([0], greedy[b]))
                continue
            t = time.perf_counter()
            start, n = int(starts[b]), tree.size
            rule = sampling.get_rule(request.rule_name)  # looked up per call, so a test can swap a rule in
            randomness = request.noise.at(len(request.ids)) if request.noise is not None else request.generator
            path, next_token = rule(tree, logits[start:start + n], request.params, randomness)
            if path != list(range(len(path))):  # a chain prefix stays where it is
                order[b, : len(path)] = torch.as_tensor(path, device=self.device)
                moved = True
            results.append((path, next_token))
            work_s[b] += time.perf_counter() - t
        if moved:  # (every row's path a chain prefix: nothing to move)
            base = torch.tensor([r.cache_len for r in rows], device=self.device)
            self.forward.cache.compact(len(rows), base, order)
        layer_of = {layer: j for j, layer in enumerate(capture)}
        for b, (request, tree, ran, (path, next_token)) in enumerate(zip(rows, trees, proposed, results)):
            t = time.perf_counter()
            n = tree.size
            extra = {}
            if request.capture and list(request.capture) == capture:  # every captured layer, in order: no copy
                extra["layer_hidden"] = captured[b, :n]  # (n, L*H)
            elif request.capture:
                H = hidden.shape[-1]
                parts = [captured[b, :n, layer_of[i] * H:(layer_of[i] + 1) * H] for i in request.capture]
                extra["layer_hidden"] = torch.cat(parts, dim=-1)  # (n, L*H)
            self._accept(request, tree, path, next_token, hidden[b, :n], extra, ran)
            work_s[b] += time.perf_counter() - t
        sync_device(self.device)
        t3 = time.perf_counter()
        for request, tree, (path, _) in zip(rows, trees, results):
            request.steps[-1] = StepStats(num_nodes=tree.size, accepted=len(path) - 1,
                                          emitted=request.steps[-1].emitted, time_s=t3 - t0, propose_s=t1 - t0,
                                          verify_s=t2 - t1, accept_s=t3 - t2)
        # (a step that carried prompt chunks is no sample of the verifier's time for its trees)
        self.budget.observe(rows, trees, [path for path, _ in results], inputs.tokens.numel(),
                            None if chunks else t2 - t1, work_s)
        self.last_step = {"rows": len(rows), "width": width, "drafting": sum(proposed), "verify_s": t2 - t1,
                          "prompt_tokens": sum(len(tokens) for _, tokens in chunks) if chunks else 0}
        if chunks:
            self._read(chunks, outs[1:], capture)

    @staticmethod
    def _plain_greedy(rows, trees, logits, starts) -> dict[int, int]:
        """{row: next token} of the rows verifying their root alone under the greedy rule: one
        argmax over their logits (what the greedy rule computes row by row, widened exactly as it
        is, first index on ties)."""
        if sampling.ACCEPTANCE_RULES.get("greedy") is not sampling._greedy_rule:
            return {}  # a test swapped the rule in: every row goes through it
        plain = [b for b, (r, t) in enumerate(zip(rows, trees)) if t.size == 1 and r.rule_name == "greedy"]
        if not plain:
            return {}
        index = starts[torch.tensor(plain, device=logits.device)]
        return dict(zip(plain, sampling.argmax_ids(logits[index]).tolist()))

    def _propose_batched(self, rows: list[Request], budgets: list) -> "_Batched":
        """{row: (tree, True)} for the drafting rows whose proposers share a batch_key: one
        propose_batch call per group (a Medusa drafter: the heads of every row in one call)."""
        groups: dict = {}
        for b, (request, budget) in enumerate(zip(rows, budgets)):
            batch_key = getattr(request.proposer, "batch_key", None)  # a duck-typed proposer may lack the hook
            key = batch_key() if batch_key is not None and budget != 0 else None
            if key is not None:
                groups.setdefault(key, []).append(b)
        out = _Batched()
        for members in groups.values():
            if len(members) < 2:
                continue
            t = time.perf_counter()
            proposers = [rows[b].proposer for b in members]
            try:
                trees = type(proposers[0]).propose_batch(proposers, [rows[b].root for b in members],
                                                         [rows[b].hidden_last for b in members],
                                                         [rows[b].ids for b in members])
            except Exception:  # noqa: BLE001 - each row proposes alone, and one that raises fails alone
                continue
            share = (time.perf_counter() - t) / len(members)
            for b, tree in zip(members, trees):
                budget = budgets[b]
                if budget is not None and tree.size > budget + 1 and getattr(rows[b].proposer, "cuttable", True):
                    tree = truncate(tree, budget + 1)
                out[b] = (tree, True)
                out.seconds[b] = share
        return out

    def _propose(self, request: Request, budget: int | None) -> tuple[DraftTree, bool]:
        """The row's tree for this step, cut to `budget` drafted nodes (0: the root alone, the
        proposer not run); -> (tree, whether the proposer ran)."""
        if budget == 0:
            return root_tree(request.root, self.device), False
        try:
            tree = request.proposer.propose(request.root, request.hidden_last, request.ids)
        except Exception as e:  # this request fails alone, naming the cause; the batch goes on
            request.error, request.stop.reason, request.done = e, "error", True
            return root_tree(request.root, self.device), False
        if budget is not None and tree.size > budget + 1 and getattr(request.proposer, "cuttable", True):
            tree = truncate(tree, budget + 1)
        return tree, True

    def _accept(self, request: Request, tree: DraftTree, path: list[int], next_token: int, hidden: torch.Tensor,
                extra: dict, ran: bool) -> None:
        request.cache_len += len(path)
        accepted = tree.tokens[path[1:]].tolist() if len(path) > 1 else []
        n_before = len(request.out)
        if not request.done:
            request.done = request.stop.extend(request.out, request.ids, accepted + [next_token])
            if request.on_tokens is not None and request.on_tokens(request.out[n_before:]) is False and not request.done:
                request.done, request.stop.reason = True, "cancelled"
            try:
                (request.proposer.accept if ran else request.proposer.skip)(tree, path, next_token, hidden, **extra)
            except Exception as e:
                request.error, request.stop.reason, request.done = e, "error", True
        request.root, request.hidden_last = next_token, hidden[path[-1]]  # (H,)
        request.steps.append(StepStats(num_nodes=tree.size, accepted=len(path) - 1,
                                       emitted=len(request.out) - n_before, time_s=0.0))

    # ------------------------------------------------------------------ prefilling rows

    def _chunks(self) -> "_Chunks":
        """This step's prompt chunks: each prefilling row's next tokens (oldest first),
        prefill_chunk tokens in all, each chunk a forward step of its own shape (1, n) over its
        cache row: the products read the weights once for all of them (FastLlama.many), and no
        chunk is padded to the longest (one (rows, longest) step would compute ~30% more positions
        than 16 of MT-bench's first turns have, and read a wave of them ~1.4x slower)."""
        budget, chunks = self.prefill_chunk, _Chunks()
        for request in self.prefilling:
            take = min(budget, len(request.prompt) - request.fed)
            if take <= 0:
                break
            chunks.append((request, request.prompt[request.fed: request.fed + take]))
            budget -= take
        max_len = self.forward.cache.max_len
        for request, tokens in chunks:
            n = len(tokens)
            inputs = batch_inputs([chain_tree(tokens, self.device)], [request.fed], n, self.device, max_len)
            length = _slot_bucket(request.fed + n, max_len)
            rows = torch.tensor([request.row], device=self.device)
            chunks.steps.append((inputs.tokens, inputs.positions, inputs.slots, inputs.allowed(length), rows, length))
        chunks.capture = sorted({i for r, _ in chunks for i in r.capture})
        return chunks

    def _prefill(self, chunks: "_Chunks") -> None:
        """The prompt chunks alone (no row is decoding)."""
        self._read(chunks, self.forward.many(chunks.steps, chunks.capture), chunks.capture)

    def _read(self, chunks: "_Chunks", outs: list[tuple], capture: list[int]) -> None:
        """The chunks are in the cache (outs: each chunk's (hidden (1, n, H), captured layers (1, n, L*H)
        or None)): the rows whose prompt is complete get their first token and start decoding."""
        layer_of = {layer: j for j, layer in enumerate(capture)}
        for (request, tokens), (hidden, captured) in zip(chunks, outs):
            n = len(tokens)
            request.fed += n
            request.cache_len = request.fed
            request.prompt_hidden.append(hidden[0, :n])
            if request.capture:
                H = hidden.shape[-1]
                request.prompt_layers.append(torch.cat(
                    [captured[0, :n, layer_of[i] * H:(layer_of[i] + 1) * H] for i in request.capture], dim=-1))
        for request, _ in chunks:  # (after every row's cache length is updated: rows may exchange places)
            if request.fed == len(request.prompt):
                self._first(request)

    def _first(self, request: Request) -> None:
        """The prompt is read: the first token from its last logits, the proposer's prefill,
        and the row moves to the decoding rows (cache row B)."""
        hidden = torch.cat(request.prompt_hidden)  # (T, H)
        extra = {"layer_hidden": torch.cat(request.prompt_layers)} if request.capture else {}
        request.prompt_hidden, request.prompt_layers = [], []
        first = _first_token(self.forward.logits(hidden[-1:])[0], request.rule_name, request.params,
                             request.noise.at(len(request.prompt)) if request.noise is not None else request.generator)
        samples = getattr(request.proposer, "samples_drafts", None)  # a duck-typed proposer may lack the hook
        try:
            if samples is not None and samples(request.params):  # the draft's own draws follow the request's generator
                device = request.generator.device if request.generator is not None else "cpu"
                request.proposer.seed_draws(int(torch.randint(2**62, (), generator=request.generator, device=device)))
            request.proposer.prefill(torch.tensor(request.prompt, device=self.device), hidden, request.params, **extra)
        except Exception as e:
            request.error, request.stop.reason = e, "error"
        request.done = request.error is not None or request.stop.extend(request.out, request.ids, [first])
        if request.on_tokens is not None and request.on_tokens(request.out[:]) is False and not request.done:
            request.done, request.stop.reason = True, "cancelled"
        sync_device(self.device)
        request.prefill_s = time.perf_counter() - request.t_start
        request.root, request.hidden_last = first, hidden[-1]
        self.prefilling.remove(request)
        target = len(self.decoding)
        if request.row != target:
            other = next((r for r in self.prefilling if r.row == target), None)
            if other is None:
                self.forward.cache.move_row(request.row, target, request.cache_len)
            else:  # another row still reading its prompt holds it: they exchange rows
                self.forward.cache.swap_rows(request.row, target, max(request.cache_len, other.cache_len))
                other.row = request.row
            request.row = target
        self.decoding.append(request)


class _Chunks(list):
    """A step's prompt chunks, [(request, tokens)], with their forward step and captured layers."""

    def __init__(self):
        super().__init__()
        self.steps: list[tuple] = []  # per chunk (tokens, positions, slots, allowed, rows, length): FastLlama.many's steps
        self.capture: list[int] = []  # the layers the chunks' rows capture


class _Batched(dict):
    """Trees proposed by groups ({row: (tree, True)}) and each row's share of the time."""

    def __init__(self):
        super().__init__()
        self.seconds: dict[int, float] = {}


@dataclass
class BatchInputs:
    """A step's padded (B, N) inputs (see decode/forward.py)."""

    tokens: torch.Tensor  # (B, N)
    positions: torch.Tensor  # (B, N)
    slots: torch.Tensor  # (B, N)
    ancestors: torch.Tensor  # (B, N, N) bool; a pad node sees itself only
    cache_lens: torch.Tensor  # (B,)
    real: torch.Tensor  # (B, N) bool: real nodes (not padding)

    def allowed(self, length: int) -> torch.Tensor:
        """(B, N, length) bool: a node sees its row's cached slots, its ancestors and itself."""
        B, N = self.tokens.shape
        cols = torch.arange(length, device=self.tokens.device)
        allowed = (cols[None, None, :] < self.cache_lens[:, None, None]).expand(B, N, length).clone()
        allowed.scatter_(2, self.slots[:, None, :].expand(B, N, N), self.ancestors)
        return allowed


def batch_inputs(trees: list[DraftTree], cache_lens: list[int], width: int, device,
                 max_len: int | None = None) -> BatchInputs:
    """Pad every row's tree to `width` nodes: tokens, depth positions, cache slots, ancestors.
    max_len: the cache's slots per row; a pad node whose slot would fall past it (a short row
    beside a wide one near the end of its reservation) writes to the row's last slot instead,
    which no real node of the row reaches (Engine._reserve keeps 2 * SLOT_BUCKET spare)."""
    B = len(trees)
    tokens = torch.zeros(B, width, dtype=torch.long, device=device)
    ancestors = torch.eye(width, dtype=torch.bool, device=device).repeat(B, 1, 1)  # (B, N, N)
    real = torch.zeros(B, width, dtype=torch.bool, device=device)
    for b, tree in enumerate(trees):
        n = tree.size
        tokens[b, :n] = tree.tokens
        anc = tree.buffers.ancestors if tree.buffers is not None else _ancestors(tree)
        ancestors[b, :n, :n] = anc.to(device)
        real[b, :n] = True
    lens = torch.tensor(cache_lens, dtype=torch.long, device=device)
    depths = ancestors.sum(-1) - 1  # (B, N); a pad node: depth 0
    slots = lens[:, None] + torch.arange(width, device=device)[None]
    if max_len is not None:
        slots = slots.clamp(max=max_len - 1)  # only pad nodes reach it
    return BatchInputs(tokens, lens[:, None] + depths, slots, ancestors, lens, real)


def _ancestors(tree: DraftTree) -> torch.Tensor:
    if tree.is_chain:
        n = tree.size
        return torch.ones(n, n, dtype=torch.bool).tril_()
    return ancestor_mask(tree.parents.cpu())


def _slot_bucket(need: int, max_len: int) -> int:
    return min(max_len, -(-need // SLOT_BUCKET) * SLOT_BUCKET)


def root_tree(root: int, device) -> DraftTree:
    """The tree of a plain step: the root alone."""
    return DraftTree(tokens=torch.tensor([root], dtype=torch.long, device=device),
                     parents=torch.tensor([-1], dtype=torch.long, device=device), is_chain=True)


def chain_tree(tokens: list[int], device) -> DraftTree:
    n = len(tokens)
    return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                     parents=torch.arange(-1, n - 1, dtype=torch.long, device=device), is_chain=True)


def truncate(tree: DraftTree, n: int) -> DraftTree:
    """The tree's first n nodes (topological order: a valid tree); sampled siblings left out are
    children never tried, which the rejection walk allows."""
    keep = slice(0, n)
    return DraftTree(tokens=tree.tokens[keep], parents=tree.parents[keep],
                     draft_probs=None if tree.draft_probs is None else tree.draft_probs[keep],
                     sampled=None if tree.sampled is None else tree.sampled[keep])


_ENGINES: "weakref.WeakKeyDictionary[PreTrainedModel, list]" = weakref.WeakKeyDictionary()
_ENGINES_LOCK = threading.Lock()


def _batch1_engine(model: PreTrainedModel, forward: str, tokens: int, invariant=False,
                   weights: str = "auto", budget: str = "fixed") -> "Engine":
    """A one-row engine for this model, reused across calls (its cache grows to the longest); an
    adaptive budget calibrates its step cost once, when the engine is made."""
    kind = (forward, invariant, weights, budget)
    with _ENGINES_LOCK:
        pool = _ENGINES.setdefault(model, [])
        for engine in pool:
            if engine.kind == kind and not engine.busy and not engine.in_use:
                engine.in_use = True
                return engine
    engine = Engine(model, max_num_seqs=1, max_len=max(256, tokens + 2 * SLOT_BUCKET), forward=forward,
                    prefill_chunk=1 << 30, invariant=invariant, weights=weights)
    engine.budget = make_budget(budget, engine.forward, max_num_seqs=1)
    engine.kind, engine.in_use = kind, True
    with _ENGINES_LOCK:
        _ENGINES.setdefault(model, []).append(engine)
    return engine


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
    forward: str = "auto",
    invariant=False,
    weights: str = "auto",
    budget: str = "fixed",
) -> "GenerationOutput":
    """Decode up to ``max_new_tokens`` tokens after ``input_ids`` with speculative decoding: an
    Engine with one row (the prompt read in one forward).

    Args:
      input_ids: (1, T) prompt.
      proposer: from ``decode.proposers.make_proposer``; None = plain decoding (the baseline,
        through the same loop with a one-node tree).
      temperature: 0 = greedy. > 0 samples from logits_to_probs(logits, temperature, top_k,
        top_p) (top_k=0 and top_p=1 disable those; note HF's generate defaults top_k=50).
      acceptance: "auto" (greedy if temperature == 0 else rejection), "greedy", "rejection"
        (recursive rejection sampling, lossless), "coupled" (lossless, and the tokens plain
        sampling with the same generator's seed emits, whatever the drafts: sampling.coupled_walk),
        or "typical" (Medusa, LOSSY: sets lossy).
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
      forward: the verifier forward, decode/forward.py (fast | hf | auto).
      invariant: the fast forward's shape-invariant mode (false | true | rows | float64;
        decode/forward.py): every token's logits are those of a plain step, bit for bit, whatever
        the tree (greedy output = plain greedy output, and with acceptance="coupled" sampled
        output = plain sampling's, in bf16 too).
      weights: the fast forward's linear weights (auto | packed | plain; decode/forward.py packs).
      budget: how many of the proposer's draft tokens a step verifies (decode/budget.py): "fixed",
        its whole tree every step; "adaptive", the tokens that maximise tokens per second from the
        forward's cost T(n), measured once on this machine, and the row's acceptance so far (0: a
        plain step, where a verify of many tokens costs more than the drafts return).

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
    sampling.resolve_rule(acceptance, params)
    check_architecture(model)
    choose(BUDGETS, budget, "engine.budget")
    engine = _batch1_engine(model, forward, input_ids.shape[1] + max_new_tokens, invariant, weights, budget)
    try:
        request = engine.add(input_ids[0].tolist(), proposer=proposer, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, top_k=top_k, acceptance=acceptance,
                             eos_token_id=eos_token_id, stop_strings=stop_strings, tokenizer=tokenizer,
                             generator=generator, posterior_threshold=posterior_threshold,
                             posterior_alpha=posterior_alpha, on_tokens=on_tokens)
        with torch.inference_mode():
            while engine.busy:
                engine.step()
    finally:
        engine.reset()
        engine.in_use = False
    if request.error is not None:
        raise request.error
    return request.result()



def sync_device(device: torch.device) -> None:
    """Wait for the GPU's queued kernels, so that the clock splits a step into propose / verify /
    accept as they ran (CUDA launches return at once); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_token(logits: torch.Tensor, rule_name: str, params: SamplingParams, generator) -> int:
    """The token after the prompt from its last logits (V,), as the verifier alone picks it."""
    if rule_name == "coupled":  # generator: the request's PositionNoise at the first position
        probs = sampling.logits_to_probs(logits, params.temperature, params.top_k, params.top_p)  # (V,)
        return sampling.coupled_sample(probs, generator.gumbel(0, probs.shape[-1], probs.device))
    if rule_name == "rejection":
        probs = sampling.logits_to_probs(logits, params.temperature, params.top_k, params.top_p)  # (V,)
        return sampling.sample(probs, generator)  # float64 inverse CDF
    return int(sampling.argmax_ids(logits))  # greedy; typical also takes the argmax (Medusa's fast mode)


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


def _feature_layers(proposer: Proposer, model: PreTrainedModel) -> list[int]:
    """Verifier layers (0-based) whose outputs the proposer needs besides the final hidden state."""
    layers = [int(i) for i in getattr(proposer, "feature_layers", None) or ()]
    n = model.config.num_hidden_layers
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise DraftsmithError(f"{proposer.name} proposer asks for verifier layers {bad}; the verifier has {n} (0..{n - 1})")
    return layers
