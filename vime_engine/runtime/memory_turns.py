"""Colocated on one device, the trainer and the engine take turns at its memory (the order vime uses):

    generate   trainer released, engine awake (weights and KV cache)
    train      engine asleep (vLLM sleep level 2: weights and KV cache discarded), trainer restored
    sync       engine wakes its weights only (`wake_up(tags=["weights"])`), the trainer's gathered tensors
               load into them; the KV cache waits for the next generation (`wake_up(tags=["kv_cache"])`)

so that a colocated run needs the larger of the two sides' memory, not their sum. Level 2 is enough because a
sync always loads every weight (lm_head included); vLLM keeps the model's buffers across it.

The two sides meet it through `EngineMemory` and `TrainerMemory`. On CPU vLLM has no sleep mode and the host's
memory is the device's: both sides stay resident (`Resident`), said once in the log, and the turns are still
taken (and recorded in `MemoryTurns.calls`) so the order is the same code on every device.
"""

from __future__ import annotations

import logging
from typing import Protocol

from vime_engine.config.errors import ConfigError

log = logging.getLogger(__name__)
SLEEP_LEVEL = 2


class EngineMemory(Protocol):
    def release(self) -> None: ...

    def restore(self, tags: list[str]) -> None: ...


class TrainerMemory(Protocol):
    def release(self) -> None: ...

    def restore(self) -> None: ...


class Resident:
    """Memory that stays where it is (CPU: vLLM has no sleep mode; the host's memory is the device's)."""

    def release(self) -> None:
        pass

    def restore(self, tags: list[str] | None = None) -> None:
        pass


class VllmSleepMode:
    """The engine's memory through vLLM's sleep mode (the engine was built with `enable_sleep_mode`)."""

    def __init__(self, llm):
        self.llm = llm

    def release(self) -> None:
        self.llm.sleep(level=SLEEP_LEVEL)

    def restore(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)


class HostOffload:
    """The trainer's parameters, gradients and optimizer state moved to host memory while the engine generates,
    and back before the trainer works (for the torch backends; Megatron keeps its buffers resident)."""

    def __init__(self, model, optimizer, device: str, margin_bytes: int = 0):
        import torch  # here, not at the top: the driver imports this module for its checks

        self.model, self.optimizer, self.device, self.margin_bytes = model, optimizer, device, margin_bytes
        self.device_module = None if device == "cpu" else getattr(torch, device.split(":")[0])  # torch.cuda / npu

    def _move(self, device: str) -> None:
        import torch

        for param in self.model.parameters():
            param.data = param.data.to(device, non_blocking=True)
            param.grad = None  # the next step computes them again
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:  # not Adam's step counter
                    state[key] = value.to(device, non_blocking=True)

    def release(self) -> None:
        self._move("cpu")
        if self.device_module is not None:
            self.device_module.empty_cache()  # the freed blocks back to the device

    def restore(self) -> None:
        self._move(self.device)
        if self.device_module is None:
            return
        free = self.device_module.mem_get_info()[0]
        if free < self.margin_bytes:
            raise MemoryError(
                f"--train-memory-margin-bytes {self.margin_bytes}: with the trainer's memory back on {self.device} "
                f"only {free} bytes are free; lower --vllm-gpu-memory-utilization or the batch's tokens")


class MemoryTurns:
    """Which side holds the device, and the hand-overs between them; `calls` records each one in order."""

    def __init__(self, engine: EngineMemory, trainer: TrainerMemory):
        self.engine, self.trainer = engine, trainer
        self.engine_holds: set[str] = {"weights", "kv_cache"}  # both sides start loaded
        self.trainer_resident = True
        self.calls: list[str] = []

    def _engine_release(self) -> None:
        if self.engine_holds:
            self.engine.release()
            self.engine_holds.clear()
            self.calls.append("engine.sleep")

    def _engine_restore(self, tags: list[str]) -> None:
        missing = [tag for tag in tags if tag not in self.engine_holds]
        if missing:
            self.engine.restore(missing)
            self.engine_holds.update(missing)
            self.calls.append(f"engine.wake_up({','.join(missing)})")

    def _trainer(self, resident: bool) -> None:
        if self.trainer_resident != resident:
            (self.trainer.restore if resident else self.trainer.release)()
            self.trainer_resident = resident
            self.calls.append("trainer.restore" if resident else "trainer.release")

    def for_training(self) -> None:
        """Before the trainer works (a step, log-probs, a checkpoint, an export)."""
        self._engine_release()
        self._trainer(True)

    def for_sync(self) -> None:
        """Before the trainer's weights load into the engine: both sides' weights, no KV cache."""
        self._trainer(True)
        self._engine_restore(["weights"])

    def for_generation(self) -> None:
        """Before the engine generates."""
        self._trainer(False)
        self._engine_restore(["weights", "kv_cache"])


def check_memory_margin(margin_bytes: int, colocated: bool, accelerator_kind: str) -> None:
    """`--train-memory-margin-bytes` acts where the trainer takes the device's memory back from the engine:
    colocated on an accelerator; refused elsewhere, with the reason."""
    if margin_bytes and not colocated:
        raise ConfigError(
            f"--train-memory-margin-bytes {margin_bytes}: the trainer has its devices to itself without --colocate, "
            "so there is no memory to take back; pass --colocate or leave the margin out")
    if margin_bytes and accelerator_kind == "cpu":
        raise ConfigError(
            f"--train-memory-margin-bytes {margin_bytes}: on CPU the engine and the trainer both stay resident in "
            "host memory, so there is no device memory to keep free; pass 0 (the margin acts colocated on an "
            "accelerator)")


def check_memory_turn_flags(sleep_mode: bool, keep_trainer: bool, colocated: bool, accelerator_kind: str) -> None:
    """vime's `--vllm-enable-sleep-mode` and `--no-offload-train` act on the turns a colocated rank takes; refused,
    with the reason, where no turns are taken (apart) or where the engine cannot sleep (CPU)."""
    if sleep_mode and not colocated:
        raise ConfigError("--vllm-enable-sleep-mode: an engine sleeps only to hand its memory to a colocated "
                          "trainer, and without --colocate nothing puts it to sleep; pass --colocate or drop the flag")
    if sleep_mode and accelerator_kind == "cpu":
        raise ConfigError("--vllm-enable-sleep-mode: vLLM has no sleep mode on CPU, where the engine and the trainer "
                          "both stay resident in host memory; drop the flag (it acts colocated on an accelerator)")
    if keep_trainer and not colocated:
        raise ConfigError("--no-offload-train: the trainer leaves its devices only to make room for a colocated "
                          "engine, so without --colocate it stays on them anyway; drop the flag")


def memory_turns(accelerator_kind: str, llm, backend, device: str, margin_bytes: int = 0,
                 offload_trainer: bool = True) -> MemoryTurns:
    """The turns a colocated rank takes on `accelerator_kind`: vLLM's sleep mode and the trainer offloaded to host
    on accelerators (host offload for the torch backends, which hold `model` and `optimizer`, unless not
    `offload_trainer`: vime's --no-offload-train), both resident on CPU (said once)."""
    if accelerator_kind == "cpu":
        log.info("colocated on CPU: vLLM has no sleep mode and the host's memory is the device's, so the engine "
                 "and the trainer both stay resident")
        return MemoryTurns(Resident(), Resident())
    model, optimizer = getattr(backend, "model", None), getattr(backend, "optimizer", None)
    offloadable = offload_trainer and hasattr(model, "parameters") and optimizer
    trainer = HostOffload(model, optimizer, device, margin_bytes) if offloadable else Resident()
    return MemoryTurns(VllmSleepMode(llm), trainer)
