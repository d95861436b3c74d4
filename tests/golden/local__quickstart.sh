#!/bin/bash
# Rendered by hpcrun 0.1.0: run 20260101-000000-0000-golden, recipe quickstart, site local.
# submitit's local executor runs this file once per rank (2 ranks on this machine).
set -eo pipefail

# Interconnect (ethernet on lo) and recipe environment.
export GLOO_SOCKET_IFNAME=lo
export NCCL_IB_DISABLE=1
export NCCL_NSOCKS_PERTHREAD=4
export NCCL_SOCKET_IFNAME=lo
export NCCL_SOCKET_NTHREADS=2
export HPCRUN_RUN_DIR=/home/golden/hpcrun/runs/20260101-000000-0000-golden
export HPCRUN_RUN_ID=20260101-000000-0000-golden

# Rendezvous on this machine; the port is derived from the job so parallel runs do not collide.
export MASTER_ADDR=127.0.0.1
export MASTER_PORT=$((20000 + SUBMITIT_LOCAL_JOB_ID % 20000))

exec /usr/bin/python3 -u -m hpcrun.launch /home/golden/hpcrun/runs/20260101-000000-0000-golden/logs
