#!/bin/bash
# Rendered by hpcrun 0.1.0: run 20260101-000000-0000-golden, recipe quickstart, site mycluster.
# This file is exactly what was submitted with sbatch.
#SBATCH --job-name=quickstart
#SBATCH --comment=hpcrun:20260101-000000-0000-golden
#SBATCH --partition=gpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --gres=gpu:2
#SBATCH --time=00:10:00
#SBATCH --account=proj-ml
#SBATCH --qos=normal
#SBATCH --output=/scratch/golden/hpcrun/runs/20260101-000000-0000-golden/logs/%j_0_log.out
#SBATCH --error=/scratch/golden/hpcrun/runs/20260101-000000-0000-golden/logs/%j_0_log.err
#SBATCH --signal=USR2@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --exclusive

set -eo pipefail

# Modules from the site profile.
module load cuda/12.4
module load nccl/2.21

# Setup lines from the site profile (site-owned shell, one command per line).
source /opt/venvs/torch/bin/activate

# Interconnect (infiniband on ib0) and recipe environment.
export GLOO_SOCKET_IFNAME=ib0
export NCCL_DEBUG=WARN
export NCCL_IB_DISABLE=0
export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7
export NCCL_SOCKET_IFNAME=ib0

# Rendezvous on the first node, spelled as its high-speed hostname.
first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR="$first_node"-ib
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
run_dir=/scratch/golden/hpcrun/runs/20260101-000000-0000-golden

# srun's messages (and exit status), kept aside for the failure step below; removed however the script ends.
srun_stderr=$(mktemp)
trap 'rm -f "$srun_stderr" "$srun_stderr.status"' EXIT

# One task per rank, each running hpcrun's entry point on the run directory (its ranks: srun's variables).
# A failed step is recorded once, here, after it: which task ended first (srun's messages,
# shown as they come and kept aside), the one results row, and the requeue decision
# (hpcrun.runtime.failure). A pipeline, not `2> >(tee ...)`: bash waits for tee to finish.
exec 3>&1
# A stop signal to this shell (scancel --batch or --full, a site's --signal=B:..., a wrapper)
# would end it, and the job as FAILED, by bash's default action: pass it to the ranks instead
# (scancel --signal without --batch/--full signals the steps only), which save and requeue.
# bash runs a trap only between commands, so srun runs in the background and is waited for
# until its subshell is gone (a trapped signal ends `wait` early); the subshell keeps its status.
# The subshell and tee ignore the signals (`--full` sends them to every process of this step):
# killed, the step's status would be lost while the ranks still save. srun sets its own handlers.
trap 'scancel --signal=USR2 "$SLURM_JOB_ID" || true' USR2
trap 'scancel --signal=TERM "$SLURM_JOB_ID" || true' TERM
( trap '' USR2 TERM
  set +e
  srun --unbuffered --kill-on-bad-exit=1 \
  --output=/scratch/golden/hpcrun/runs/20260101-000000-0000-golden/logs/%j_%t_log.out --error=/scratch/golden/hpcrun/runs/20260101-000000-0000-golden/logs/%j_%t_log.err \
  python -u -m hpcrun.launch "$run_dir" 2>&1 >&3 3>&- | tee "$srun_stderr" >&2
  echo "${PIPESTATUS[0]}" >"$srun_stderr.status" ) &
step=$!
until wait "$step" || ! kill -0 "$step" 2>/dev/null; do :; done
step_status=$(cat "$srun_stderr.status" 2>/dev/null || true)
step_status=${step_status:-1}  # no status: the subshell was killed
# the ranks are gone: a stop has no step to reach, and this shell must outlive the failure step
trap '' USR2 TERM
if [ "$step_status" -ne 0 ]; then
  # one task on this node, inside the same container as the ranks: the interpreter named by
  # the site exists there, and so does hpcrun
  srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist="$SLURMD_NODENAME" \
  python -m hpcrun.runtime.failure "$run_dir" "$step_status" <"$srun_stderr" \
    || echo "[hpcrun] the failure step exited $? (none starts once SLURM ends or requeues the job)" >&2
fi
exit "$step_status"
