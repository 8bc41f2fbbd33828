"""Huawei Cloud ModelArts: `client` (training jobs through huaweicloudsdkmodelarts: submit, poll, stop), `logs`
(log previews turned into a stream of new lines) and `entrypoint` (the command each node of a job runs)."""
