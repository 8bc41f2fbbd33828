"""The resumable checkpoint: `store` (rollout directories, the commit order, LATEST, finding the newest valid one),
`manifest` (every file's size and checksums, written last), `tensor_files` (safetensors written and read in the
pass that hashes them), `run_history` (the run's append-only metrics history beside the checkpoints)."""
