import torch
import torch.nn.functional as F

from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.vocab import draft_vocab
from draftsmith.train.core.losses import simulated_tau
from draftsmith.train.medusa import head_targets, medusa_loss
from tests.tiny import tiny_llama


def _heads(model, mode="own", k=3):
    cfg = MedusaConfig(hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size,
                       num_heads=k, num_layers=1, lm_head=mode)
    return MedusaHeads(cfg, model.get_output_embeddings()).to(torch.float64)


def test_fresh_heads_equal_the_verifier_lm_head():
    model = tiny_llama()
    hidden = torch.randn(2, 5, model.config.hidden_size, dtype=torch.float64)
    for mode in ("own", "shared"):
        heads = _heads(model, mode)
        logits = heads(hidden, lm_head=model.get_output_embeddings())
        assert logits.shape == (3, 2, 5, model.config.vocab_size)
        # zero-init ResBlocks + lm_head copy: every head starts as the verifier's next-token head
        expected = model.get_output_embeddings()(hidden)
        for k in range(3):
            torch.testing.assert_close(logits[k], expected)


def test_shared_heads_hold_no_vocab_projection():
    model = tiny_llama()
    own, shared = _heads(model, "own"), _heads(model, "shared")
    h, v = model.config.hidden_size, model.config.vocab_size
    assert sum(p.numel() for p in own.parameters()) - sum(p.numel() for p in shared.parameters()) == 3 * h * v
    assert not any("lm_head" in n for n, _ in shared.named_parameters())


def test_head_targets_shift_by_k_plus_2():
    labels = torch.tensor([[-100, -100, 10, 11, 12, 13, 14]])
    mask, target = head_targets(labels, 0)
    # position t predicts labels[t + 2]
    assert mask.tolist() == [[True, True, True, True, True, False, False]]
    assert target.tolist() == [10, 11, 12, 13, 14]
    mask, target = head_targets(labels, 2)
    assert mask.tolist() == [[True, True, True, False, False, False, False]]
    assert target.tolist() == [12, 13, 14]


def test_medusa_loss_matches_a_direct_computation():
    torch.manual_seed(0)
    model = tiny_llama()
    heads = _heads(model, "own", k=2)
    for p in heads.parameters():  # move away from the identity init
        p.data += 0.05 * torch.randn_like(p)
    ids = torch.randint(0, 128, (2, 9))
    labels = ids.clone()
    labels[:, :3] = -100
    hidden = model.model(input_ids=ids).last_hidden_state
    loss, stats = medusa_loss(heads, hidden, labels, model.get_output_embeddings(), decay=0.8, num_heads=2)
    expected = 0.0
    for k in range(2):
        logits = heads(hidden)[k]  # (B, T, V)
        shift = k + 2
        ce = F.cross_entropy(logits[:, :-shift].reshape(-1, 128), labels[:, shift:].reshape(-1), ignore_index=-100)
        expected = expected + 0.8 ** k * ce
    torch.testing.assert_close(loss, expected)
    assert stats["head0/count"] == 2 * 6 and stats["head1/count"] == 2 * 6  # labels start at 3
    loss.backward()
    assert heads.blocks[0].layers[0].weight.grad.abs().sum() > 0


def test_medusa_loss_split_over_processes_averages_to_the_full_batch_loss():
    """What DDP does: each process's loss, normalised by the GLOBAL token count times the
    process count, averaged over processes, equals the 1-process loss of the whole batch,
    even when the processes hold different numbers of supervised tokens."""
    torch.manual_seed(0)
    model = tiny_llama()
    heads = _heads(model, "own", k=3)
    for p in heads.parameters():
        p.data += 0.05 * torch.randn_like(p)
    ids = torch.randint(0, 128, (4, 11))
    labels = ids.clone()
    labels[:2, :7] = -100  # the first half has far fewer supervised tokens
    labels[2:, :2] = -100
    hidden = model.model(input_ids=ids).last_hidden_state
    lm_head = model.get_output_embeddings()
    full, _ = medusa_loss(heads, hidden, labels, lm_head, 0.8, 3)
    halves = [(hidden[:2], labels[:2]), (hidden[2:], labels[2:])]
    counts = sum(torch.tensor([float(head_targets(lab, k)[1].numel()) for k in range(3)]) for _, lab in halves)
    parts = [medusa_loss(heads, h, lab, lm_head, 0.8, 3, reduce_counts=lambda c: (counts, 2))[0] for h, lab in halves]
    torch.testing.assert_close((parts[0] + parts[1]) / 2, full)
    naive = [medusa_loss(heads, h, lab, lm_head, 0.8, 3)[0] for h, lab in halves]  # per-process means
    assert abs(((naive[0] + naive[1]) / 2 - full).item()) > 1e-3


def test_simulated_tau():
    assert simulated_tau([]) == 1.0
    assert abs(simulated_tau([0.5, 0.5]) - (1 + 0.5 + 0.25)) < 1e-12
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0


def test_reduced_draft_vocabulary():
    """Heads over the N most frequent targets: training logits over N, decoding logits over V
    with -inf outside the draft vocabulary and the verifier's own logits inside (fresh heads)."""
    model = tiny_llama()
    counts = torch.zeros(128, dtype=torch.long)
    counts[[7, 3, 90, 41]] = torch.tensor([5, 9, 9, 1])
    d2t = draft_vocab(counts, 3)
    assert d2t.tolist() == [3, 7, 90]  # the 3 most frequent, in id order
    lm_head = model.get_output_embeddings()
    hidden = torch.randn(2, 5, 32, dtype=torch.float64)
    full = lm_head(hidden)  # (2, 5, V)
    for mode in ("own", "shared"):
        cfg = MedusaConfig(32, 128, num_heads=2, lm_head=mode, draft_vocab_size=3)
        heads = MedusaHeads(cfg, lm_head, token_map=d2t).to(torch.float64)
        train_logits = heads([hidden[0], hidden[1, :2]], lm_head)
        assert [t.shape for t in train_logits] == [(5, 3), (2, 3)]
        torch.testing.assert_close(train_logits[0], full[0][:, d2t])
        logits = heads(hidden, lm_head)  # (K, 2, 5, V)
        assert logits.shape == (2, 2, 5, 128)
        torch.testing.assert_close(logits[0][..., d2t], full[..., d2t])
        outside = torch.ones(128, dtype=torch.bool)
        outside[d2t] = False
        assert torch.isinf(logits[..., outside]).all()
        assert heads.state_dict()["token_map"].tolist() == [3, 7, 90]  # vLLM's name
    try:
        MedusaConfig(32, 128, draft_vocab_size=129)
    except ValueError as e:
        assert "method.draft_vocab_size=129" in str(e)
    else:
        raise AssertionError("a draft vocabulary larger than the verifier's was accepted")


def test_medusa_loss_with_a_draft_vocabulary_skips_and_counts_missing_targets():
    from draftsmith.models.vocab import target_to_draft

    torch.manual_seed(0)
    model = tiny_llama()
    d2t = torch.arange(0, 128, 2)  # even ids only
    cfg = MedusaConfig(32, 128, num_heads=1, lm_head="own", draft_vocab_size=64)
    heads = MedusaHeads(cfg, model.get_output_embeddings(), token_map=d2t).to(torch.float64)
    ids = torch.randint(0, 128, (2, 9))
    hidden = model.model(input_ids=ids).last_hidden_state
    t2d = target_to_draft(d2t, 128)
    loss, stats = medusa_loss(heads, hidden, ids, None, 0.8, 1, t2d=t2d)
    mask, target = head_targets(ids, 0)
    even = target % 2 == 0
    expected = F.cross_entropy(heads.lm_heads[0](hidden[mask][even]), target[even] // 2)
    torch.testing.assert_close(loss, expected)
    assert stats["head0/count"] == target.numel() > int(even.sum())  # odd targets are misses


def test_reduced_vocabulary_heads_decode_losslessly():
    from draftsmith.decode.engine import generate
    from draftsmith.decode.proposers import make_proposer

    torch.manual_seed(0)
    model = tiny_llama(eos_token_id=None)
    counts = torch.bincount(torch.randint(0, 128, (400,)), minlength=128)
    cfg = MedusaConfig(32, 128, num_heads=2, lm_head="shared", draft_vocab_size=48)
    heads = MedusaHeads(cfg, token_map=draft_vocab(counts, 48)).to(torch.float64)
    for p in heads.parameters():
        p.data += 0.05 * torch.randn_like(p)
    proposer = make_proposer("medusa", heads=heads, paths=[[0], [1], [0, 0], [0, 1]],
                             lm_head=model.get_output_embeddings())
    ids = torch.randint(4, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    out = generate(model, ids, proposer=proposer, max_new_tokens=30)
    ref = model.generate(ids, do_sample=False, max_new_tokens=30)[0, 6:].tolist()
    assert out.tokens == ref
    tree = proposer.propose(ref[-1], torch.randn(32, dtype=torch.float64), [])
    assert set(tree.tokens[1:].tolist()) <= set(heads.token_map.tolist())  # drafts come from the draft vocabulary
