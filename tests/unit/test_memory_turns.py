"""Taking turns at a colocated device's memory (vime_engine.runtime.memory_turns): only the hand-overs a state
needs are made, in vime's order, and host offload keeps every value of the trainer's model and optimizer."""

from __future__ import annotations

import pytest
import torch

from vime_engine.config import ConfigError
from vime_engine.runtime.memory_turns import (
    HostOffload, MemoryTurns, Resident, check_memory_margin, check_memory_turn_flags, memory_turns,
)


def test_only_the_hand_overs_a_state_needs_are_made():
    turns = MemoryTurns(Resident(), Resident())
    turns.for_sync()  # both sides start loaded: nothing to do
    turns.for_generation()
    turns.for_generation()
    turns.for_training()
    turns.for_training()
    turns.for_sync()
    turns.for_training()  # a checkpoint after the sync: the engine's weights go back to sleep
    turns.for_generation()  # weights and KV cache back at once
    assert turns.calls == ["trainer.release", "engine.sleep", "trainer.restore", "engine.wake_up(weights)",
                           "engine.sleep", "trainer.release", "engine.wake_up(weights,kv_cache)"]


def test_host_offload_keeps_the_model_and_the_optimizer_state():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    before = ({k: v.clone() for k, v in model.state_dict().items()},
              {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(optimizer.state.values())})
    offload = HostOffload(model, optimizer, "cpu")
    offload.release()
    offload.restore()
    assert all(p.grad is None for p in model.parameters())  # the next step computes them again
    assert all(torch.equal(v, before[0][k]) for k, v in model.state_dict().items())
    for i, state in enumerate(optimizer.state.values()):
        assert all(torch.equal(v, before[1][i][k]) for k, v in state.items())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # the optimizer still steps the same parameters


@pytest.mark.parametrize(("colocated", "kind", "refused"), [
    (True, "cuda", None), (True, "cpu", "on CPU the engine and the trainer both stay resident"),
    (False, "cuda", "without --colocate"),
])
def test_the_memory_margin_acts_only_colocated_on_an_accelerator(colocated, kind, refused):
    check_memory_margin(0, colocated, kind)  # no margin: fine anywhere
    if refused is None:
        check_memory_margin(1 << 30, colocated, kind)
    else:
        with pytest.raises(ConfigError, match=f"--train-memory-margin-bytes 1073741824: .*{refused}"):
            check_memory_margin(1 << 30, colocated, kind)


@pytest.mark.parametrize(("sleep_mode", "keep_trainer", "colocated", "kind", "refused"), [
    (True, True, True, "cuda", None),
    (False, True, True, "cpu", None),  # on CPU the trainer stays resident anyway
    (True, False, False, "cuda", "--vllm-enable-sleep-mode: an engine sleeps only to hand its memory to a colocated"),
    (True, False, True, "cpu", "--vllm-enable-sleep-mode: vLLM has no sleep mode on CPU"),
    (False, True, False, "npu", "--no-offload-train: the trainer leaves its devices only to make room"),
])
def test_vimes_sleep_mode_and_no_offload_flags_act_colocated_on_an_accelerator(sleep_mode, keep_trainer, colocated,
                                                                               kind, refused):
    if refused is None:
        check_memory_turn_flags(sleep_mode, keep_trainer, colocated, kind)
    else:
        with pytest.raises(ConfigError, match=refused):
            check_memory_turn_flags(sleep_mode, keep_trainer, colocated, kind)


def test_no_offload_train_keeps_the_trainer_on_its_device():
    class Backend:
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(model.parameters())

    assert isinstance(memory_turns("cuda", None, Backend(), "cuda:0").trainer, HostOffload)
    assert isinstance(memory_turns("cuda", None, Backend(), "cuda:0", offload_trainer=False).trainer, Resident)
