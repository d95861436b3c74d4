#!/bin/bash
# Rendered by hpcrun 0.1.0: run 20260101-000000-0000-golden, recipe quickstart, site local.
# hpcrun's local controller runs this file once per task (2 on this machine: one per rank, or one torchrun), with
# RANK, LOCAL_RANK, WORLD_SIZE and HPCRUN_LOCAL_JOB_ID set.
set -eo pipefail

# Interconnect (ethernet on lo) and recipe environment.
export GLOO_SOCKET_IFNAME=lo
export NCCL_IB_DISABLE=1
export NCCL_NSOCKS_PERTHREAD=4
export NCCL_SOCKET_IFNAME=lo
export NCCL_SOCKET_NTHREADS=2

# Rendezvous on this machine; the port is derived from the job so parallel runs do not collide.
export MASTER_ADDR=127.0.0.1
export MASTER_PORT=$((20000 + HPCRUN_LOCAL_JOB_ID % 12000))
run_dir=/home/golden/hpcrun/runs/20260101-000000-0000-golden

exec /usr/bin/python3 -u -m hpcrun.launch "$run_dir"
