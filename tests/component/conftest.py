from tests.support.prefect_server import prefect_harness  # noqa: F401  (in-process flows, one temporary server)
from tests.support.s3_fixtures import (  # noqa: F401  (storage fixtures: moto, fault proxy, HF Hub server)
    fault_proxy, hf_endpoint, hf_hub, make_bucket, moto_endpoint, moto_with_iam, storage_env,
)
