"""Experiment trackers (W&B, MLflow) that the metrics sink (`sink`) fans out to, and the resume rule they share
(`resume`).

One vime run is one tracker run, found again when the run resumes: by `--wandb-run-id` / `--mlflow-run-id`,
else by a key kept in the `--save` directory (`tracking-run-key`), so a run restarted with the same `--save`
continues its tracker runs and a fresh directory starts new ones. Without `--save` nothing can resume and
each start is a new tracker run.

Resume rule: a tracker is sent a metric at a rollout id only if its run does not yet hold that metric at
that rollout id or a later one, as read from the tracker's own store when it opens (MLflow: the run's metric
history; W&B: its transaction logs under --wandb-dir, or the resumed run's summary). A run killed after
logging rollout 5 and resumed from its checkpoint at 3 therefore sends nothing again for 4 and 5: the tracker
keeps the values logged first, which the resumed run reproduces (bit-identical on CPU, without a jump on
accelerators). What a tracker lacks of the checkpoint's history (W&B writes its log every 15 s, so a kill
loses the last seconds; or the tracker was switched on at resume) is sent when the sink is rewritten to that
history. Each tracker thus holds every rollout id once.
"""
