"""The boundary between a Prefect task and the engine process it starts.

`layout` (where a run lives and the engine job every stage shares), `messages` (the typed job, report and
ModelArts chunk files both sides write and read), `process` (the flow side: start the engine child, turn its exit
into a typed outcome), `runner` (the child side: `python -m tasks.engine_job.runner
JOB.json`), `checkpoint_history` (the run's history file beside the checkpoints committed to storage),
`speed_probe` (the machine's speed, timed beside a chunk's step times). No Prefect here: the same runner runs
inside a ModelArts container.
"""
