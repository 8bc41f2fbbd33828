"""What a user's plugin file meets: `loading` (a function named by a flag, imported and its signature checked;
coroutines awaited), `vime_args` (the read-only `args` namespace with vime's names) and `boundary` (what a
user's function returns checked, and what it raises named, as a UserFunctionError).

Where vime's hooks are called: the rollout side in vime_engine/rollout/vime_hooks.py, the trainer side in
vime_engine/train/vime_hooks.py, rewards in vime_engine/rewards/custom.py, custom generate functions in
vime_engine/rollout/custom_generate.py.
"""
