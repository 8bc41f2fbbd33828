"""vime's `vime.utils.types`: its Sample is ours (vime_engine/sample.py), which answers to vime's names
(`Sample.Status.COMPLETED`, `tokens`, `response_length`, `append_response_tokens`, ...)."""

from vime_engine.sample import Sample

__all__ = ["Sample"]
