"""Test-only: import Megatron-Bridge on a machine without Transformer Engine, for the one test that compares our
HF mapping with the bridge's (the engine does not use the bridge).

The bridge imports `transformer_engine.pytorch` at module level in its LoRA layers; a stub is placed in
`sys.modules` only while it is imported and removed right after, so every `try: import transformer_engine` in
megatron-core still fails and Megatron keeps its local (non-TE) layers. (Megatron itself runs on CPU through the
engine's own `vime_engine.devices.megatron_on_cpu`.)
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types


class _Placeholder(type):
    """A class that no object is an instance of; attribute access yields further placeholders."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


def _stub_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__getattr__ = lambda attr: _Placeholder(attr, (), {})  # type: ignore[method-assign]
    module.__path__ = []  # a package, so `transformer_engine.pytorch` resolves
    module.__version__ = "0.0.0"  # megatron-core caches this version: 0.0.0 reads as "no TE features"
    return module


@contextlib.contextmanager
def _transformer_engine_stub():
    te = _stub_module("transformer_engine")
    te_pytorch = _stub_module("transformer_engine.pytorch")
    te.pytorch = te_pytorch
    sys.modules["transformer_engine"] = te
    sys.modules["transformer_engine.pytorch"] = te_pytorch
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
            del sys.modules[name]


def import_megatron_bridge() -> types.ModuleType:
    """Import megatron-core first (no TE: local layers), then Megatron-Bridge with the stub in place."""
    import megatron.core  # noqa: F401
    import megatron.core.extensions  # noqa: F401
    import megatron.core.models.gpt.experimental_attention_variant_module_specs  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401
    import megatron.core.transformer  # noqa: F401

    with _transformer_engine_stub():
        bridge = importlib.import_module("megatron.bridge")
        importlib.import_module("megatron.bridge.models.conversion.auto_bridge")
        importlib.import_module("megatron.bridge.peft.lora_layers")
    return bridge
