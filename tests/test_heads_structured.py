"""Class-based, tree and slim heads: their structure, against naive references, and through a checkpoint."""

import math
from itertools import pairwise

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lmserve.training.config import HeadConfig
from lmserve.training.heads import ClassSoftmax, FullSoftmax, SlimSoftmax, TreeSoftmax, build_head
from lmserve.training.heads.class_based import clustered_classes, frequency_bins
from lmserve.training.heads.slim import kmeans
from lmserve.training.heads.tree import huffman_branches, leaf_depths

V, D, N = 60, 12, 40


def zipf_prior(vocab_size: int) -> torch.Tensor:
    weights = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)
    return (weights / weights.sum()).log().float()


def test_frequency_bins_share_sqrt_frequency_and_keep_every_class():
    prior = zipf_prior(1000)
    bounds = frequency_bins(prior, 30)
    sizes = (bounds[1:] - bounds[:-1]).tolist()
    assert bounds[0] == 0 and bounds[-1] == 1000 and min(sizes) >= 1
    shares = [prior[a:b].double().mul(0.5).exp().sum().item() for a, b in pairwise(bounds.tolist())]
    assert max(shares) < 2.5 * min(shares)  # about equal sqrt-frequency mass per class
    assert sizes[0] < sizes[-1]  # frequent words in small classes, rare words in large ones
    # a word heavier than a whole share still leaves room for every later class
    skewed = torch.tensor([0.97] + [0.03 / 9] * 9).log()
    assert frequency_bins(skewed, 5).tolist() == [0, 1, 2, 3, 4, 10]


def test_class_head_is_class_times_word_in_class():
    torch.manual_seed(0)
    head = ClassSoftmax(D, V, classes=6)
    head.init_bias(zipf_prior(V))
    hidden = torch.randn(N, D)
    class_logprob = head.classes(hidden).log_softmax(-1)
    logits = head.words(hidden)
    want = torch.empty(N, V)
    for c, (a, b) in enumerate(pairwise(head.bounds.tolist())):
        want[:, a:b] = class_logprob[:, c, None] + logits[:, a:b].log_softmax(-1)
    torch.testing.assert_close(head.log_probs(hidden), want)
    assert len(head.bounds) == 7 and ClassSoftmax(D, 10_000).bounds.numel() == 101  # round(sqrt(|V|)) by default


def test_class_head_scores_only_the_targets_class():
    torch.manual_seed(0)
    head = ClassSoftmax(D, V, classes=6)
    head.init_bias(zipf_prior(V))
    _, _, logits = head._in_class(torch.randn(3, D), torch.tensor([0, 30, 59]))
    assert logits.shape == (3, head.max_class_size) and head.max_class_size < V / 2
    sizes = (head.bounds[1:] - head.bounds[:-1])[head.word_class[torch.tensor([0, 30, 59])]]
    assert torch.equal(torch.isfinite(logits).sum(1), sizes)  # padding is masked out


def test_huffman_tree_gives_frequent_words_short_paths():
    prior = zipf_prior(V)
    head = TreeSoftmax(D, V, "huffman")
    head.init_bias(prior)
    depth = (head.path_signs != 0).sum(1).double()
    assert depth[0] < depth[-1]
    assert (2.0**-depth).sum().item() == pytest.approx(1.0)  # Kraft equality: a full binary tree
    entropy = -(prior.double().exp() * prior.double() / math.log(2)).sum().item()
    assert entropy <= (prior.double().exp() * depth).sum().item() < entropy + 1  # Huffman's optimal code length
    balanced = TreeSoftmax(D, 64, "balanced")
    assert torch.all((balanced.path_signs != 0).sum(1) == 6)


def test_tree_logprob_is_the_product_along_the_path():
    torch.manual_seed(0)
    head = TreeSoftmax(D, V, "huffman")
    head.init_bias(zipf_prior(V))
    hidden = torch.randn(5, D)
    parent = {}
    for i, (left, right) in enumerate(head.branches.tolist()):
        parent[left], parent[right] = (i, -1.0), (i, 1.0)
    logits = head.nodes(hidden)
    for word in (0, 17, V - 1):
        want, node = torch.zeros(5), word
        while node in parent:
            i, sign = parent[node]
            want = want + torch.nn.functional.logsigmoid(sign * logits[:, i])
            node = V + i
        torch.testing.assert_close(head.target_logprob(hidden, torch.full((5,), word)), want)
    torch.testing.assert_close(head.log_probs(hidden).exp().sum(-1), torch.ones(5))  # the leaves sum to one


def test_tree_is_rebuilt_from_a_checkpoint():
    torch.manual_seed(0)
    trained = TreeSoftmax(D, V, "huffman")
    trained.init_bias(zipf_prior(V))
    fresh = TreeSoftmax(D, V, "huffman")  # equal-weight tree until loaded
    assert not torch.equal(fresh.branches, trained.branches)
    fresh.load_state_dict(trained.state_dict())
    hidden = torch.randn(4, D)
    torch.testing.assert_close(fresh.log_probs(hidden), trained.log_probs(hidden))
    assert set(trained.state_dict()) == {"branches", "nodes.weight", "nodes.bias"}  # paths are derived


def test_class_bins_are_rebuilt_from_a_checkpoint():
    torch.manual_seed(0)
    trained = ClassSoftmax(D, V, classes=6)
    trained.init_bias(zipf_prior(V))
    fresh = ClassSoftmax(D, V, classes=6)
    fresh.load_state_dict(trained.state_dict())
    hidden = torch.randn(4, D)
    torch.testing.assert_close(fresh.log_probs(hidden), trained.log_probs(hidden))


def two_groups(tmp_path) -> tuple[np.ndarray, str]:
    """Embeddings of V words in two tight groups, even ids and odd ids, saved as a checkpoint's."""
    rng = np.random.default_rng(0)
    centres = np.where(np.arange(V)[:, None] % 2 == 0, 3.0, -3.0) * np.eye(1, D)
    vectors = centres + rng.normal(scale=0.1, size=(V, D))
    (tmp_path / "ckpt").mkdir()
    save_file(
        {"embedding.weight": torch.tensor(vectors, dtype=torch.float32)}, str(tmp_path / "ckpt" / "model.safetensors")
    )
    return vectors, str(tmp_path / "ckpt")


def test_clustered_classes_keep_similar_words_together_with_balanced_mass(tmp_path):
    vectors, _ = two_groups(tmp_path)
    prior = zipf_prior(V)
    halves = clustered_classes(vectors, prior, 2)
    assert sorted(tuple(c % 2 for c in members) for members in halves) == [(0,) * 30, (1,) * 30]
    classes = clustered_classes(vectors, prior, 8)
    assert len(classes) == 8 and sorted(np.concatenate(classes).tolist()) == list(range(V))
    assert all(len({w % 2 for w in members}) == 1 for members in classes)  # no class mixes the two groups
    mass = [np.exp(0.5 * prior.double().numpy()[members]).sum() for members in classes]
    assert mass == sorted(mass, reverse=True) and mass[0] < 4 * mass[-1]
    assert [len(m) for m in clustered_classes(vectors, prior, V)] == [1] * V  # as many classes as words


def test_clustered_class_head_is_a_distribution_in_word_ids_and_survives_a_checkpoint(tmp_path):
    _, ckpt = two_groups(tmp_path)
    torch.manual_seed(0)
    head = build_head(HeadConfig(type="class", classes=6, class_embeddings=ckpt), D, V)
    head.init_bias(zipf_prior(V))
    assert sorted(head.position.tolist()) == list(range(V)) and head.position.tolist() != list(range(V))
    assert len({w % 2 for w in range(V) if head.word_class[head.position[w]] == 0}) == 1
    hidden, targets = torch.randn(N, D), torch.randint(0, V, (N,))
    log_probs = head.log_probs(hidden)
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(N))
    want = log_probs.gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(head.target_logprob(hidden, targets), want)
    score, log_norms = head.target_terms(hidden, targets)
    torch.testing.assert_close(score - log_norms.sum(-1), want)
    torch.testing.assert_close(
        head.target_score(hidden, targets), head.scores(hidden).gather(1, targets[:, None]).squeeze(1)
    )
    # a zero state predicts the prior exactly, in word ids
    torch.testing.assert_close(head.log_probs(torch.zeros(1, D))[0], zipf_prior(V), atol=1e-5, rtol=0)

    fresh = ClassSoftmax(D, V, classes=6)  # no embeddings needed to load: the layout is in the checkpoint
    fresh.load_state_dict(head.state_dict())
    torch.testing.assert_close(fresh.log_probs(hidden), log_probs)
    older = {k: v for k, v in ClassSoftmax(D, V, classes=6).state_dict().items() if k != "position"}
    fresh.load_state_dict(older)  # a checkpoint from before clustered classes: frequency bins, in id order
    assert fresh.position.tolist() == list(range(V))
    with pytest.raises(ValueError, match="head.class_embeddings"):
        ClassSoftmax(D, V + 1, classes=6, embeddings=ckpt).init_bias(zipf_prior(V + 1))


def test_huffman_branches_put_children_before_parents():
    branches = huffman_branches(np.array([5.0, 1.0, 1.0, 2.0]))
    assert branches.tolist() == [[1, 2], [3, 4], [5, 0]]  # 1+1 -> 4; 2+2 -> 5; 4+5 -> root 6


def test_slim_assignment_is_balanced_fixed_and_saved():
    head = SlimSoftmax(D, V, subvectors=4, pool=40)  # 10 vectors per position, each for 6 of the 60 words
    for k in range(4):
        assert torch.bincount(head.table.assignment[:, k], minlength=10).tolist() == [6] * 10
    assert torch.equal(head.table.assignment, SlimSoftmax(D, V, subvectors=4, pool=40).table.assignment)
    assert "table.assignment" in head.state_dict()
    assert head.table.pools.numel() == 40 * D // 4  # M sub-vectors of D/K


def test_slim_logits_by_dynamic_programme_equal_the_composed_matrix():
    torch.manual_seed(0)
    head = SlimSoftmax(D, V, subvectors=3, pool=15)
    hidden = torch.randn(N, D)
    vectors, bias = head.output_vectors(torch.arange(V))
    for w in (0, 7, V - 1):
        parts = [head.table.pools[k, head.table.assignment[w, k]] for k in range(3)]
        torch.testing.assert_close(vectors[w], torch.cat(parts))
    torch.testing.assert_close(head.logits(hidden), hidden @ vectors.T + bias)


def test_slim_sizes_are_validated():
    with pytest.raises(ValueError, match="head.slim_subvectors = 5"):
        SlimSoftmax(D, V, subvectors=5, pool=40)
    with pytest.raises(ValueError, match="head.slim_pool = 42"):
        SlimSoftmax(D, V, subvectors=4, pool=42)


def test_log_z_shifts_scores_not_probabilities():
    torch.manual_seed(0)
    plain = FullSoftmax(D, V)
    shifted = FullSoftmax(D, V, log_z=9.0)
    shifted.load_state_dict(plain.state_dict())
    hidden, targets = torch.randn(N, D), torch.randint(0, V, (N,))
    torch.testing.assert_close(shifted.log_probs(hidden), plain.log_probs(hidden))
    torch.testing.assert_close(shifted.target_score(hidden, targets), plain.target_score(hidden, targets) - 9.0)
    learned = FullSoftmax(D, V, log_z=2.0, learn_log_z=True)
    assert [name for name, _ in learned.named_parameters()] == ["log_z_offset", "linear.weight", "linear.bias"]
    with torch.no_grad():
        learned.log_z_offset.uniform_(-0.1, 0.1)  # as the model's initialisation does to every parameter
    assert abs(learned.log_z.item() - 2.0) <= 0.1  # the start survives it
    learned.init_bias(zipf_prior(V))
    assert learned.log_z.item() == 2.0
    torch.testing.assert_close(learned.scores(torch.zeros(1, D))[0], zipf_prior(V))
    assert set(FullSoftmax(D, V, log_z=9.0).state_dict()) == {"linear.weight", "linear.bias"}  # as before


def test_a_learned_log_z_gets_the_mean_gradient_of_the_positions_in_training():
    head = FullSoftmax(D, V, log_z=2.0, learn_log_z=True)
    hidden = torch.randn(N, D)
    eval_scores = head.eval().scores(hidden)
    scores = head.train().scores(hidden)
    torch.testing.assert_close(scores, eval_scores)  # the same values
    scores.sum().backward()
    assert head.log_z_offset.grad.item() == pytest.approx(-V)  # each row's -V, averaged over the N rows
    head.zero_grad()
    head.eval().scores(hidden).sum().backward()
    assert head.log_z_offset.grad.item() == pytest.approx(-N * V)  # outside training: the plain sum


def test_uniform_bias_init_keeps_biases_but_hands_over_the_prior():
    head = build_head(HeadConfig(type="full"), D, V)
    before = head.linear.bias.clone()
    head.init_bias(zipf_prior(V), set_bias=False)
    assert torch.equal(head.linear.bias, before)
    torch.testing.assert_close(head.log_prior, zipf_prior(V))


def test_registry_builds_every_head_and_names_the_key():
    built = {
        name: build_head(HeadConfig(type=name, cutoffs=[10, 30], slim_pool=8, tree="balanced"), D, V)
        for name in ("full", "adaptive", "class", "tree", "slim")
    }
    assert [type(h).__name__ for h in built.values()] == [
        "FullSoftmax",
        "AdaptiveSoftmax",
        "ClassSoftmax",
        "TreeSoftmax",
        "SlimSoftmax",
    ]
    with pytest.raises(ValueError, match="head.type = 'bogus'"):
        build_head(HeadConfig(type="bogus"), D, V)
    with pytest.raises(ValueError, match="head.tree = 'brown'"):
        TreeSoftmax(D, V, "brown")
    with pytest.raises(ValueError, match="head.classes = 61"):
        ClassSoftmax(D, V, classes=61)


def two_clusters_checkpoint(tmp_path) -> str:
    """A checkpoint whose input embeddings form two tight clusters: the even word ids and the odd ones."""
    rng = np.random.default_rng(0)
    centres = np.where(np.arange(V)[:, None] % 2 == 0, 3.0, -3.0) * np.eye(1, D)
    vectors = torch.tensor(centres + rng.normal(scale=0.1, size=(V, D)), dtype=torch.float32)
    (tmp_path / "ckpt").mkdir()
    save_file({"embedding.weight": vectors}, str(tmp_path / "ckpt" / "model.safetensors"))
    return str(tmp_path / "ckpt")


def root_agreement_with_the_clusters(head: TreeSoftmax) -> float:
    """The share of words that the root sends the way of the majority of their cluster (1: it splits even from odd)."""
    first_turn = head.path_signs[torch.arange(V), (head.path_signs != 0).sum(1) - 1] > 0  # the root is last on a path
    agree = (first_turn == (torch.arange(V) % 2 == 0)).double().mean().item()
    return max(agree, 1 - agree)


def test_clustered_tree_keeps_similar_words_together(tmp_path):
    """Two clusters of embeddings: the root separates them; frequencies still shorten frequent words' paths."""
    head = build_head(
        HeadConfig(type="tree", tree="clustered", tree_embeddings=two_clusters_checkpoint(tmp_path)), D, V
    )
    prior = zipf_prior(V)
    head.init_bias(prior)
    assert root_agreement_with_the_clusters(head) == 1.0
    depth = (head.path_signs != 0).sum(1).double()
    entropy = -(prior.double().exp() * prior.double() / math.log(2)).sum().item()
    assert (prior.double().exp() * depth).sum().item() < entropy + 2  # mass-halving splits: Shannon-Fano bound
    torch.testing.assert_close(head.log_probs(torch.randn(3, D)).exp().sum(-1), torch.ones(3))
    with pytest.raises(ValueError, match="head.tree_embeddings"):
        TreeSoftmax(D, V, "clustered")
    with pytest.raises(ValueError, match="covers? 60 words|cover 60 words"):
        TreeSoftmax(D, V + 1, "clustered", str(tmp_path / "ckpt")).init_bias(zipf_prior(V + 1))


def test_huffman_clustered_tree_is_a_huffman_code_that_keeps_similar_words_together(tmp_path):
    """Every word's path is as long as in the Huffman tree; the words are placed by their embeddings, so when each
    cluster holds about half of the Kraft sum (word pairs 2k, 2k + 1 of equal frequency) the root separates them."""
    config = HeadConfig(type="tree", tree="huffman_clustered", tree_embeddings=two_clusters_checkpoint(tmp_path))
    head = build_head(config, D, V)
    weights = 1.0 / (torch.arange(V, dtype=torch.float64) // 2 + 1)
    prior = (weights / weights.sum()).log().float()
    head.init_bias(prior)
    huffman = TreeSoftmax(D, V, "huffman")
    huffman.init_bias(prior)
    torch.testing.assert_close(leaf_depths(head.branches), leaf_depths(huffman.branches), rtol=0, atol=0)
    assert not torch.equal(head.branches, huffman.branches)
    # (a tie of the Huffman code gives one pair unequal depths: a word of each cluster crosses over to even the halves)
    assert root_agreement_with_the_clusters(head) >= 58 / 60 and root_agreement_with_the_clusters(huffman) < 0.75
    torch.testing.assert_close(head.log_probs(torch.randn(3, D)).exp().sum(-1), torch.ones(3))
    # without equal halves the walk along the principal direction still fills each half of the Kraft sum exactly
    zipf = TreeSoftmax(D, V, "huffman_clustered", config.tree_embeddings)
    zipf.init_bias(zipf_prior(V))
    huffman.init_bias(zipf_prior(V))
    torch.testing.assert_close(leaf_depths(zipf.branches), leaf_depths(huffman.branches), rtol=0, atol=0)
    with pytest.raises(ValueError, match="head.tree = huffman_clustered needs head.tree_embeddings"):
        TreeSoftmax(D, V, "huffman_clustered")


# -- clustered slim sub-vectors -----------------------------------------------------------------------------------


def test_kmeans_finds_separated_clusters_deterministically():
    torch.manual_seed(3)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    members = torch.randint(0, 3, (200,))
    members[:3] = torch.tensor([0, 1, 2])  # the starting centroids are the first points
    points = centres[members] + 0.1 * torch.randn(200, 2)
    found, labels = kmeans(points, 3)
    torch.testing.assert_close(found, centres[:3], atol=0.05, rtol=0)
    assert torch.equal(labels, members)
    again, labels_again = kmeans(points, 3)
    assert torch.equal(again, found) and torch.equal(labels_again, labels)


def test_slim_sub_vectors_clustered_from_a_trained_models_output_vectors(tmp_path):
    torch.manual_seed(4)
    # 6 kinds of words whose trained vectors are alike within a kind; chunk k of kind j is centre[k][j]
    kinds = torch.arange(V) % 6
    centres = torch.randn(4, 6, D // 4)
    trained = torch.cat([centres[k][kinds] for k in range(4)], dim=1) + 0.01 * torch.randn(V, D)
    save_file(
        {"head.linear.weight": trained, "embedding.weight": torch.zeros(V, 5)}, str(tmp_path / "model.safetensors")
    )
    clustered = SlimSoftmax(D, V, subvectors=4, pool=24, embeddings=str(tmp_path))
    random = SlimSoftmax(D, V, subvectors=4, pool=24)
    before = clustered.table.assignment.clone()
    assert torch.equal(before, random.table.assignment)  # until the trainer hands over the unigram
    clustered.init_bias(torch.full((V,), -torch.log(torch.tensor(float(V)))))
    assignment = clustered.table.assignment
    for k in range(4):  # same kind, same sub-vector; the pools hold the centres
        for kind in range(6):
            assert len(set(assignment[kinds == kind, k].tolist())) == 1
    vectors = clustered.table.vectors(torch.arange(V))
    torch.testing.assert_close(vectors, trained, atol=0.05, rtol=0)  # the noise around the centres
    hidden = torch.randn(N, D)
    torch.testing.assert_close(clustered.logits(hidden), hidden @ vectors.T + clustered.bias)


def test_slim_clustering_checks_its_source(tmp_path):
    save_file({"head.linear.weight": torch.randn(V, D + 1)}, str(tmp_path / "model.safetensors"))
    head = SlimSoftmax(D, V, subvectors=4, pool=24, embeddings=str(tmp_path))
    with pytest.raises(ValueError, match="head.slim_embeddings = .* 13 dimensions"):
        head.init_bias(torch.zeros(V))
    with pytest.raises(ValueError, match="head.slim_pool = 400"):
        SlimSoftmax(D, V, subvectors=4, pool=400, embeddings=str(tmp_path))
    save_file({"embedding.weight": torch.randn(V + 1, D)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="cover 61 words"):
        SlimSoftmax(D, V, subvectors=4, pool=24, embeddings=str(tmp_path)).init_bias(torch.zeros(V))
