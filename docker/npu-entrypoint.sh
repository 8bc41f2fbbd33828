#!/bin/bash
# Put CANN (and ATB, for vllm-ascend) into the environment, then run the given command.
set -e
# shellcheck disable=SC1091
source /usr/local/Ascend/ascend-toolkit/set_env.sh
# shellcheck disable=SC1091
source /usr/local/Ascend/nnal/atb/set_env.sh
exec "$@"
