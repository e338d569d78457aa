import pytest
import torch

from lmserve.training.heads import (
    AdaptiveSoftmax,
    ClassSoftmax,
    CNNSoftmax,
    DSoftmax,
    FullSoftmax,
    SlimSoftmax,
    TreeSoftmax,
)

torch.manual_seed(0)
V, D, N = 60, 12, 50

HEADS = {
    "full": lambda: FullSoftmax(D, V),
    "full-log-z": lambda: FullSoftmax(D, V, log_z=3.0, learn_log_z=True),
    "adaptive": lambda: AdaptiveSoftmax(D, V, cutoffs=[8, 20, 40], div_value=2.0),
    "class": lambda: ClassSoftmax(D, V, classes=7),
    "tree": lambda: TreeSoftmax(D, V, "huffman"),
    "slim": lambda: SlimSoftmax(D, V, subvectors=4, pool=40, log_z=1.0),
    "dsoftmax": lambda: DSoftmax(D, V, cutoffs=[8, 20], widths=[6, 4, 2]),
    "dsoftmax-nested": lambda: DSoftmax(D, V, cutoffs=[8, 20], widths=[12, 6, 3], layout="nested", log_z=1.0),
    "cnnsoftmax": lambda: CNNSoftmax(D, [f"w{i}" for i in range(V)], 6, 4, [1, 2, 3], 8, correction_size=4),
}


@pytest.fixture(params=list(HEADS))
def head(request):
    torch.manual_seed(0)
    return HEADS[request.param]()


def test_log_probs_are_normalised_and_target_logprob_matches_them(head):
    hidden = torch.randn(N, D)
    targets = torch.randint(0, V, (N,))
    log_probs = head.log_probs(hidden)
    assert log_probs.shape == (N, V)
    torch.testing.assert_close(log_probs.logsumexp(-1), torch.zeros(N), atol=1e-5, rtol=0)
    torch.testing.assert_close(head.target_logprob(hidden, targets), log_probs.gather(1, targets[:, None]).squeeze(1))
    score, log_norms = head.target_terms(hidden, targets)
    torch.testing.assert_close(score - log_norms.sum(-1), head.target_logprob(hidden, targets))


def test_unnormalised_scores_agree_with_target_terms(head):
    hidden = torch.randn(N, D)
    targets = torch.randint(0, V, (N,))
    score, _ = head.target_terms(hidden, targets)
    scores = head.scores(hidden)
    torch.testing.assert_close(head.target_score(hidden, targets), score)
    torch.testing.assert_close(scores.gather(1, targets[:, None]).squeeze(1), score)
    # one softmax (or none): scores normalise to it
    if isinstance(head, FullSoftmax | SlimSoftmax | TreeSoftmax | DSoftmax):
        torch.testing.assert_close(scores.log_softmax(-1), head.log_probs(hidden))


def test_candidate_logprobs_are_the_distribution_gathered(head):
    hidden = torch.randn(4, D)
    candidates = torch.randint(0, V, (4, 3))
    torch.testing.assert_close(
        head.candidate_logprobs(hidden, candidates), head.log_probs(hidden).gather(1, candidates)
    )


def test_adaptive_candidates_share_their_rows_softmaxes():
    """Rows whose candidates leave a cluster empty, fill one cluster several times, or all sit in the shortlist."""
    head = HEADS["adaptive"]()
    hidden = torch.randn(4, D)
    candidates = torch.tensor([[1, 2, 3, 4], [9, 10, 11, 1], [41, 59, 45, 50], [0, 21, 41, 9]])
    torch.testing.assert_close(
        head.candidate_logprobs(hidden, candidates), head.log_probs(hidden).gather(1, candidates)
    )
    only_shortlist = candidates[:1].expand(4, 4)
    torch.testing.assert_close(
        head.candidate_logprobs(hidden, only_shortlist), head.log_probs(hidden).gather(1, only_shortlist)
    )


def test_adaptive_matches_pytorch_reference_implementation():
    """Same parameters as torch.nn.AdaptiveLogSoftmaxWithLoss (which has no biases): same distribution."""
    torch.manual_seed(1)
    ours = AdaptiveSoftmax(D, V, cutoffs=[8, 20, 40], div_value=2.0)
    reference = torch.nn.AdaptiveLogSoftmaxWithLoss(D, V, cutoffs=[8, 20, 40], div_value=2.0)
    with torch.no_grad():
        ours.head.weight.copy_(reference.head.weight)
        ours.head.bias.zero_()
        for mine, theirs in zip(ours.tails, reference.tail, strict=True):
            mine[0].weight.copy_(theirs[0].weight)
            mine[1].weight.copy_(theirs[1].weight)
            mine[1].bias.zero_()
    hidden = torch.randn(N, D)
    targets = torch.randint(0, V, (N,))
    torch.testing.assert_close(ours.log_probs(hidden), reference.log_prob(hidden))
    torch.testing.assert_close(ours.target_logprob(hidden, targets), reference(hidden, targets).output)


def test_adaptive_target_terms_only_touch_the_clusters_of_the_targets():
    torch.manual_seed(2)
    head = AdaptiveSoftmax(D, V, cutoffs=[8, 20, 40])
    rows_seen = []
    for tail in head.tails:
        tail.register_forward_hook(lambda module, inputs, output: rows_seen.append(len(inputs[0])))
    targets = torch.tensor([0, 3, 7, 21, 25])  # shortlist and cluster 2 only
    score, log_norms = head.target_terms(torch.randn(5, D), targets)
    assert rows_seen == [0, 2, 0]  # each cluster computes only the rows whose target it holds
    assert log_norms.shape == (5, 2)
    assert torch.all(log_norms[:3, 1] == 0) and torch.all(log_norms[3:, 1] != 0)


def test_adaptive_cutoffs_are_validated():
    for bad in ([], [20, 8], [0, 8], [8, 60], [8, 8]):
        with pytest.raises(ValueError, match="head.cutoffs"):
            AdaptiveSoftmax(D, V, cutoffs=bad)
    sizes = [tail[0].out_features for tail in AdaptiveSoftmax(64, 1000, [100, 500], div_value=4.0).tails]
    assert sizes == [16, 4]


def test_gradients_flow_through_target_terms(head):
    hidden = torch.randn(N, D, requires_grad=True)
    score, log_norms = head.target_terms(hidden, torch.randint(0, V, (N,)))
    (log_norms.sum() - score.sum()).backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    assert all(p.grad is not None for p in head.parameters())


def test_unigram_bias_init_predicts_the_prior_from_a_zero_state(head):
    prior = torch.distributions.Dirichlet(torch.ones(V)).sample().log()
    head.init_bias(prior)
    zero = torch.zeros(3, D)
    torch.testing.assert_close(head.log_probs(zero), prior.expand(3, V), atol=1e-5, rtol=0)
    if isinstance(head, FullSoftmax | SlimSoftmax | DSoftmax):  # the scores are already normalised: log Z = 0
        torch.testing.assert_close(head.scores(zero).logsumexp(-1), torch.zeros(3), atol=1e-5, rtol=0)


def test_training_terms_are_float32_under_bf16_autocast(head):
    """bf16 autocast (train.precision = "bf16") rounds the logits, not the loss: every head's score and log
    normalisers come out in float32 (CUDA's autocast takes logsumexp to float32 while matrix products stay bf16, so
    a head that mixed the two failed there), and close to the fp32 terms."""
    hidden = torch.randn(N, D)
    targets = torch.randint(0, V, (N,))
    score32, norms32 = head.target_terms(hidden, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        score, log_norms = head.target_terms(hidden, targets)
    assert (score.dtype, log_norms.dtype) == (torch.float32, torch.float32)
    torch.testing.assert_close(score - log_norms.sum(-1), score32 - norms32.sum(-1), atol=0.1, rtol=0.02)
