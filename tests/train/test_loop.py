"""The training loop: determinism, exact resumption, learning, and what it refuses.

A two-block cut of ``tiny`` (KDA then MLA, SwiGLU MLPs) keeps compiles short; the loop does not
care about the layout. Resumption is checked the way a killed run resumes: the first run stops at
a checkpoint, a fresh ``RunDir`` restores it from disk and finishes, and the parameters must equal
an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from prfaas_jax.config import LayerKind, MlpKind, load_model_config
from prfaas_jax.errors import UserError
from prfaas_jax.ops.dispatch import Impl
from prfaas_jax.train.checkpoints import RunDir
from prfaas_jax.train.loop import TrainConfig, Trainer, eval_set, initial_state
from prfaas_jax.train.tasks import TaskSpec

CFG = dataclasses.replace(
    load_model_config("tiny"),
    layers=(LayerKind.KDA, LayerKind.MLA),
    mlps=(MlpKind.DENSE, MlpKind.DENSE),
)
SPEC = TaskSpec(task="mqar", vocab_size=CFG.vocab_size, seq_len=32, num_pairs=4)
CONFIG = TrainConfig(steps=8, batch_size=8, lr=3e-3, warmup_steps=2, eval_every=4, eval_examples=16)


def _run(config: TrainConfig = CONFIG, **run):
    trainer = Trainer(CFG, SPEC, config)
    state = trainer.run(initial_state(CFG, config), **run)
    return trainer, state


def _same(a, b) -> bool:
    leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(x, y) for x, y in leaves
    )


@pytest.mark.slow
def test_two_runs_with_one_seed_are_identical():
    first, state_a = _run()
    second, state_b = _run()
    assert [r.loss for r in first.history] == [r.loss for r in second.history]
    assert _same(state_a.params, state_b.params)
    evals = [r.eval_accuracy for r in first.history if r.eval_accuracy is not None]
    assert len(evals) == 2  # steps 4 and 8


def test_another_seed_gives_another_run():
    first, _ = _run()
    other, _ = _run(dataclasses.replace(CONFIG, seed=1))
    assert [r.loss for r in first.history] != [r.loss for r in other.history]


def test_a_killed_run_resumes_to_the_same_parameters(tmp_path):
    _, whole = _run()
    run_dir = RunDir(tmp_path / "run", CFG, SPEC, CONFIG)
    trainer = Trainer(CFG, SPEC, CONFIG)
    cut = trainer.run(
        initial_state(CFG, CONFIG), on_checkpoint=run_dir.save_state, checkpoint_every=3, stop_at=5
    )
    assert cut.step == 5
    assert sorted(int(p.name) for p in (tmp_path / "run" / "state").iterdir()) == [3, 5]
    restored = RunDir(tmp_path / "run", CFG, SPEC, CONFIG).resume()
    assert restored is not None and restored.step == 5
    assert _same(restored.params, cut.params) and _same(restored.opt_state, cut.opt_state)
    finished = Trainer(CFG, SPEC, CONFIG).run(restored)
    assert finished.step == CONFIG.steps
    assert _same(finished.params, whole.params)


def test_resuming_with_other_flags_is_refused(tmp_path):
    run_dir = RunDir(tmp_path / "run", CFG, SPEC, CONFIG)
    Trainer(CFG, SPEC, CONFIG).run(
        initial_state(CFG, CONFIG), on_checkpoint=run_dir.save_state, checkpoint_every=4, stop_at=4
    )
    other = dataclasses.replace(CONFIG, lr=1e-3)
    with pytest.raises(UserError, match="another train configuration"):
        RunDir(tmp_path / "run", CFG, SPEC, other).resume()


@pytest.mark.slow
def test_the_loss_goes_down():
    trainer, _ = _run(dataclasses.replace(CONFIG, steps=40, eval_every=40))
    losses = [r.loss for r in trainer.history]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.1


def test_pallas_is_refused_in_one_line():
    with pytest.raises(UserError, match="training runs the chunk or reference ops") as info:
        TrainConfig(impl="pallas")
    assert "\n" not in str(info.value)


def test_the_default_ops_are_the_backends():
    """The token scans on this CPU; an explicit choice is kept."""
    assert jax.default_backend() == "cpu" and TrainConfig().impl is Impl.REFERENCE
    assert TrainConfig(impl="chunk").impl is Impl.CHUNK
    assert TrainConfig(impl="chunk").for_step().impl is Impl.CHUNK


def test_init_from_starts_at_the_checkpoint_weights(tmp_path):
    from prfaas_jax.model import init_params
    from prfaas_jax.model.checkpoint import save_checkpoint

    params = init_params(jax.random.PRNGKey(7), CFG)
    save_checkpoint(tmp_path / "start", CFG, params)
    state = initial_state(CFG, dataclasses.replace(CONFIG, init_from=str(tmp_path / "start")))
    assert _same(state.params, params) and state.step == 0
    assert not _same(state.params, initial_state(CFG, CONFIG).params)  # not the seed's weights

    other = dataclasses.replace(CFG, layers=(LayerKind.GDN, LayerKind.MLA))
    save_checkpoint(tmp_path / "other", other, init_params(jax.random.PRNGKey(0), other))
    with pytest.raises(UserError, match="another layout"):
        initial_state(CFG, dataclasses.replace(CONFIG, init_from=str(tmp_path / "other")))


def test_both_trainable_ops_train_the_same_run():
    """Eight steps with the token scans and with the chunked ops: the same losses to float32
    rounding (each op's gradient is checked against finite differences in
    tests/model/test_gradients.py; here they agree on a whole optimised run)."""
    scans, _ = _run(dataclasses.replace(CONFIG, impl="reference"))
    chunks, _ = _run(dataclasses.replace(CONFIG, impl="chunk"))
    assert len(scans.history) == len(chunks.history) == CONFIG.steps
    np.testing.assert_allclose(
        [r.loss for r in scans.history], [r.loss for r in chunks.history], rtol=1e-4
    )


def test_a_recall_measurement_reproduces_bit_for_bit_from_its_seed():
    # What `prfaas codesign --seeds` runs per seed: training, held-out and validation accuracy.
    from prfaas_jax.train.recall_probe import measure_recall, validation_set

    first = measure_recall(CFG, SPEC, CONFIG, [32, 64])
    again = measure_recall(CFG, SPEC, CONFIG, [32, 64])
    assert (first.accuracy, first.validation, first.final_loss) == (
        again.accuracy,
        again.validation,
        again.final_loss,
    )
    assert _same(first.params, again.params)
    _, state = _run()  # the training loop's own run of the same flags
    assert _same(first.params, state.params)
    # The validation split is drawn apart from the held-out examples.
    held_out = eval_set(SPEC, CONFIG)
    assert not np.array_equal(validation_set(SPEC, CONFIG).tokens, held_out.tokens)
