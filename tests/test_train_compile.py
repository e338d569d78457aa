"""``train.compile``: the static-shape steps of training/fast_step.py train like the eager step.

On the CPU: the config's errors, the routed loss against the eager one, ``torch.compile`` of the step against the
eager step and a whole run with it. On a GPU (``needs_gpu``): both faster steps against the eager step in bf16.
"""

import itertools

import pytest
import torch

from lmserve.training.cli import main
from lmserve.training.config import ConfigError, load_config
from lmserve.training.fast_step import Router, routed_loss
from lmserve.training.trainer import StepLosses, Trainer

pytestmark = pytest.mark.slow  # torch.compile and CUDA graph captures of whole runs

# fp32 on the CPU: the routed step sums the same terms in another order over padded shapes
CPU_RTOL = 1e-4
# bf16 products over padded shapes round differently from the eager step's, and the difference grows with the steps
GPU_RTOL = 2e-2


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["train.compile=fast"], "train.compile = 'fast', expected one of none, compile, cuda_graphs, compile_graphs"),
        (["train.compile=cuda_graphs"], "it needs train.device = cuda or cuda:N, got 'cpu'"),
        (["train.compile=compile_graphs"], "it needs train.device = cuda or cuda:N, got 'cpu'"),
        (['train.compile="compile"', 'head.type="tree"'], "it needs head.type = full or adaptive, got tree"),
        (['train.compile="compile"', 'objective.type="nce"'], "needs objective.type = cross_entropy"),
        (['train.compile="compile"', "model.dropout=0.1"], "needs model.dropout = 0 and train.accumulate = 1"),
        (['train.compile="compile"', "train.accumulate=2"], "needs model.dropout = 0 and train.accumulate = 1"),
    ],
)
def test_config_errors_name_the_key_and_what_it_needs(sets, message):
    with pytest.raises(ConfigError, match="train.compile") as err:
        load_config(None, sets)
    assert message in str(err.value)


def test_cuda_graphs_without_a_gpu_fails_before_any_work(tmp_path, write_config, capsys):
    config = write_config("sentence", "adaptive", train={"compile": "cuda_graphs"})
    assert main(["fit", str(config), "--out", str(tmp_path / "run")]) == 2
    assert "train.compile = cuda_graphs captures CUDA graphs" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


def trainer(tmp_path, write_config, name, mode="sentence", head="adaptive", **train) -> Trainer:
    config = write_config(mode, head, model={"dropout": 0.0}, train={"epochs": 1, **train})
    return Trainer.fresh(load_config(config), tmp_path / name)


@pytest.mark.parametrize(("mode", "head"), [("sentence", "adaptive"), ("sentence", "full"), ("stream", "adaptive")])
def test_routed_loss_is_the_eager_loss(tmp_path, write_config, mode, head):
    t = trainer(tmp_path, write_config, "run", mode, head)
    router = Router(t.model, t.cfg.train.batch_size, t.vocab.eos_id, t.train_batches.carries_state)
    for batch in itertools.islice(t.train_batches.batches(), 5):
        routed = router.route(batch)
        assert routed.inputs.shape[0] % (1 if mode == "stream" else 4) == 0
        assert routed.num_tokens == batch.num_tokens
        _, eager_nll, _ = t.loss(batch, None)
        zeros = torch.zeros(2, routed.inputs.shape[1], 16)
        _, nll, _, _ = routed_loss(t.model, routed, zeros, zeros, torch.tensor(1.0))
        assert float(nll) == pytest.approx(float(eager_nll), rel=CPU_RTOL)
    if head == "adaptive":  # the capacities hold every batch's tail rows, with room to spare
        assert router.capacity and all(c > 0 for c in router.capacity.values())


def test_a_widened_batch_has_the_loss_of_the_batch(tmp_path, write_config):
    t = trainer(tmp_path, write_config, "run")
    router = Router(t.model, t.cfg.train.batch_size, t.vocab.eos_id, t.train_batches.carries_state)
    routed = router.route(next(iter(t.train_batches.batches())))
    tails = tuple(c + 3 + i for i, c in enumerate(routed.tails))
    wider = routed.widened(tails)
    assert wider.tails == tails
    zeros = torch.zeros(2, routed.inputs.shape[1], 16)
    nll = [float(routed_loss(t.model, b, zeros, zeros, torch.tensor(1.0))[1]) for b in (routed, wider)]
    assert nll[1] == pytest.approx(nll[0], rel=1e-6)


def routed_all_at_once(t: Trainer) -> list:
    """The epoch's routed steps, routed before any is taken (as benchmarks/gpu_step.py takes them): a capacity that
    grows on a later batch leaves the earlier batches of the same T narrower."""
    steps = list(t.train_steps(0))
    tails = {}
    for (batch,) in steps:
        tails.setdefault(batch.inputs.shape[0], set()).add(batch.tails)
    assert any(len(seen) > 1 for seen in tails.values())  # the case at hand: some T comes in two shapes
    return steps


def test_the_step_widens_each_batch_to_the_widest_shape_of_its_length(tmp_path, write_config):
    t = trainer(tmp_path, write_config, "run", compile="compile")
    seen = []

    def recorded(model, batch, *args):
        seen.append(batch.tails)
        return routed_loss(model, batch, *args)

    t.fast.loss = recorded  # the routed loss uncompiled: only the shapes the step gives it are at issue
    steps = routed_all_at_once(t)
    for _ in range(2):
        for micro in steps:
            t.step(micro, [None], False)
    first, second = seen[: len(steps)], seen[len(steps) :]
    widest = {}
    for (batch,), tails in zip(steps, first, strict=True):
        widest[batch.inputs.shape[0]] = tails
    # the second pass gives the loss one shape per T, the widest the first pass met: nothing new to capture
    assert second == [widest[batch.inputs.shape[0]] for (batch,) in steps]


def run_losses(t: Trainer, steps: int) -> list[float]:
    states, losses = [None], []
    for micro in itertools.islice(t.train_steps(0), steps):
        nll, tokens, states = t.step(micro, states, False)
        losses.append(float(nll) / tokens)  # a faster step's NLL is a tensor on the device
    return losses


@pytest.mark.parametrize("mode", ["sentence", "stream"])
def test_compiled_step_trains_as_the_eager_step_on_the_cpu(tmp_path, write_config, mode):
    eager = run_losses(trainer(tmp_path, write_config, "eager", mode), 6)
    compiled = run_losses(trainer(tmp_path, write_config, "compiled", mode, compile="compile"), 6)
    assert compiled == pytest.approx(eager, rel=CPU_RTOL)
    assert eager[-1] < eager[0]  # it learnt: the comparison is not of six untrained steps


def test_a_compiled_run_trains_to_the_end(tmp_path, write_config):
    config = write_config("sentence", "adaptive", model={"dropout": 0.0}, train={"epochs": 1, "compile": "compile"})
    assert main(["fit", str(config), "--out", str(tmp_path / "run")]) == 0  # routed in the prefetch thread
    assert (tmp_path / "run" / "results.json").exists()


def test_step_losses_are_read_once_and_a_non_finite_sum_names_its_steps():
    losses = StepLosses()
    losses.add(torch.tensor(2.0), "epoch 1, batch 0")
    losses.add(torch.tensor(3.0), "epoch 1, batch 1")
    assert losses.read("epoch 1, batch 1") == 5.0
    assert losses.read("epoch 1, batch 1") == 0.0  # from zero again
    losses.add(torch.tensor(1.0), "epoch 1, batch 2")
    losses.add(torch.tensor(float("nan")), "epoch 1, batch 3")
    with pytest.raises(FloatingPointError, match="nan in the steps from epoch 1, batch 2 to epoch 1, batch 3"):
        losses.read("epoch 1, batch 3")
    with pytest.raises(FloatingPointError, match="inf at epoch 2, batch 7"):  # a float: at once
        StepLosses().add(float("inf"), "epoch 2, batch 7")


@pytest.mark.parametrize(("compile_mode", "where"), [("none", "at epoch 1, batch 0"), ("compile", "in the steps from")])
def test_a_run_whose_loss_is_not_finite_stops_and_says_where(tmp_path, write_config, compile_mode, where):
    t = trainer(tmp_path, write_config, "run", compile=compile_mode)
    t.model.embedding.weight.data.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match=f"training loss is nan {where}"):
        t.fit()


@pytest.mark.parametrize(
    "compile_mode",
    [pytest.param(m, marks=pytest.mark.needs_gpu) for m in ("compile", "cuda_graphs", "compile_graphs")],
)
@pytest.mark.parametrize("mode", ["sentence", "stream"])
def test_gpu_steps_train_as_the_eager_bf16_step(tmp_path, write_config, mode, compile_mode):
    gpu = {"device": "cuda", "precision": "bf16"}
    eager = run_losses(trainer(tmp_path, write_config, "eager", mode, **gpu), 12)
    fast = run_losses(trainer(tmp_path, write_config, "fast", mode, compile=compile_mode, **gpu), 12)
    assert fast == pytest.approx(eager, rel=GPU_RTOL)


@pytest.mark.needs_gpu
def test_a_second_pass_over_batches_routed_at_once_replays_without_capturing(tmp_path, write_config):
    """cuda_graphs captures CUDA graphs, which exist on an NVIDIA GPU only (on the CPU the shapes the step gives its
    loss are tested instead, above)."""
    t = trainer(tmp_path, write_config, "fast", compile="cuda_graphs", device="cuda", precision="bf16")
    steps = [[batch.pin_memory() for batch in micro] for micro in routed_all_at_once(t)]
    for micro in steps:
        t.step(micro, [None], False)
    captured = t.fast.captured
    assert 0 < captured < len(steps)
    for micro in steps:
        t.step(micro, [None], False)
    assert t.fast.captured == captured
