#!/bin/bash
# Rendered by hpcrun 0.1.0: run 20260101-000000-0000-golden.warmup, recipe staged.warmup, site slingshot.
# This file is exactly what was submitted with sbatch.
#SBATCH --job-name=staged.warmup
#SBATCH --partition=gpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --gpus-per-node=2
#SBATCH --time=00:10:00
#SBATCH --account=m0001
#SBATCH --qos=regular
#SBATCH --constraint=gpu
#SBATCH --output=/pscratch/golden/hpcrun/runs/20260101-000000-0000-golden.warmup/logs/%j_0_log.out
#SBATCH --error=/pscratch/golden/hpcrun/runs/20260101-000000-0000-golden.warmup/logs/%j_0_log.err
#SBATCH --signal=USR2@120
#SBATCH --requeue
#SBATCH --open-mode=append

set -eo pipefail

# Modules from the site profile.
module load cudatoolkit
module load nccl

# Interconnect (slingshot on hsn0) and recipe environment.
export FI_CXI_DISABLE_HOST_REGISTER=1
export FI_MR_CACHE_MONITOR=userfaultfd
export FI_PROVIDER=cxi
export GLOO_SOCKET_IFNAME=hsn0
export NCCL_CROSS_NIC=1
export NCCL_NET='AWS Libfabric'
export NCCL_SOCKET_IFNAME=hsn0

# Rendezvous on the first node, spelled as its high-speed hostname.
first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR="$first_node"
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
run_dir=/pscratch/golden/hpcrun/runs/20260101-000000-0000-golden.warmup

# One task per rank, each running hpcrun's entry point on the run directory. submitit's
# JobEnvironment, which tells each task its ranks, recognises SLURM by this variable.
export SUBMITIT_EXECUTOR=slurm
# A failed step is recorded once, here, after it: which task ended first (srun's messages,
# kept aside), the one results row, and the requeue decision (hpcrun.runtime.failure).
srun_stderr=$(mktemp)
step_status=0
srun --unbuffered --kill-on-bad-exit=1 \
  --output=/pscratch/golden/hpcrun/runs/20260101-000000-0000-golden.warmup/logs/%j_%t_log.out --error=/pscratch/golden/hpcrun/runs/20260101-000000-0000-golden.warmup/logs/%j_%t_log.err \
  apptainer exec --nv --bind /pscratch /global/common/images/pytorch.sif \
  python -u -m hpcrun.launch "$run_dir" 2>"$srun_stderr" || step_status=$?
cat "$srun_stderr" >&2
if [ "$step_status" -ne 0 ]; then
  python -m hpcrun.runtime.failure "$run_dir" "$step_status" "$srun_stderr" || true
fi
rm -f "$srun_stderr"
exit "$step_status"
