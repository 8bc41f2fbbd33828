"""Our own implementations of the names vime's (and slime's) plugin files import, under vime's module paths.

A vime plugin file starts `from vime.utils.http_utils import post`, `from vime.rollout.vllm_rollout import
GenerateState, ...`, `from vime.utils.types import Sample`. Where the real vime (or slime) is not installed,
`install_vime_modules()` (finder.py; vime_engine/plugins/loading.py calls it before importing a user's function)
makes those imports land here, so such a file runs unchanged: against our Sample, our `args`, and in server mode
(`--rollout-mode server`) the router's `/inference/v1/generate`. Only the names vime's example plugins use are
here (finder.MODULES); any other `vime.*` import fails naming what is.
"""

from vime_engine.plugins.vime_modules.finder import install_vime_modules

__all__ = ["install_vime_modules"]
