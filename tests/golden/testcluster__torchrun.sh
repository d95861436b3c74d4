#!/bin/bash
# Rendered by hpcrun 0.1.0: run 20260101-000000-0000-golden, recipe torchrun-example, site testcluster.
# This file is exactly what was submitted with sbatch.
#SBATCH --job-name=torchrun-example
#SBATCH --comment=hpcrun:20260101-000000-0000-golden
#SBATCH --partition=batch
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:10:00
#SBATCH --output=/var/tmp/hpcrun-testcluster/runs/20260101-000000-0000-golden/logs/%j_0_log.out
#SBATCH --error=/var/tmp/hpcrun-testcluster/runs/20260101-000000-0000-golden/logs/%j_0_log.err
#SBATCH --signal=USR2@30
#SBATCH --requeue
#SBATCH --open-mode=append

set -eo pipefail

# Interconnect (ethernet on hpc0) and recipe environment.
export GLOO_SOCKET_IFNAME=hpc0
export NCCL_IB_DISABLE=1
export NCCL_NSOCKS_PERTHREAD=4
export NCCL_SOCKET_IFNAME=hpc0
export NCCL_SOCKET_NTHREADS=2

run_dir=/var/tmp/hpcrun-testcluster/runs/20260101-000000-0000-golden

# srun's messages (and exit status), kept aside for the failure step below, and the job's
# node-local directories: removed however the script ends, on every node the job still holds
# (SLURM_JOB_NUM_NODES counts a node SLURM has since dropped, and srun would refuse the count).
srun_stderr=$(mktemp)
node_dirs=()
held_nodes() {  # the nodes SLURM says the job holds now; its start's list when SLURM does not answer
  local held
  held=$(timeout 10 squeue -h -j "$SLURM_JOB_ID" -o %N 2>/dev/null || true)
  echo "${held:-$SLURM_JOB_NODELIST}"
}
unset HPCRUN_SLURM_PROXY  # a job submitted from inside another job's container must not use its tool loop
unset HPCRUN_STANDBY  # nor be another job's standby
trap 'rm -f "$srun_stderr" "$srun_stderr".*' EXIT


# One task per rank, each running hpcrun's entry point on the run directory (its ranks: srun's variables),
# on the allocation's first nodes (1).
# A failed step is recorded once, here, after it: which task ended first (srun's messages,
# shown as they come and kept aside), the one results row, and what comes next
# (hpcrun.runtime.failure): the step again inside this job, on the nodes it names (up to
# fault.restarts_in_job times), a requeue, or the end. A pipeline, not `2> >(tee ...)`: bash waits for tee.
exec 3>&1
# A stop signal to this shell (scancel --batch or --full, a site's --signal=B:..., a wrapper)
# would end it, and the job as FAILED, by bash's default action: pass it to the ranks instead
# (scancel --signal without --batch/--full signals the steps only), which save and requeue.
# bash runs a trap only between commands, so srun runs in the background and is waited for
# until its subshell is gone (a trapped signal ends `wait` early); the subshell keeps its status.
# The subshell and tee ignore the signals (`--full` sends them to every process of this step):
# killed, the step's status would be lost while the ranks still save. srun sets its own handlers.
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1 | paste -sd, -)
starts="$run_dir"/starts/"$SLURM_JOB_ID"
mkdir -p "${starts%/*}"
restarts_in_job=0
this_job=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}
this_job=${this_job:-$SLURM_JOB_ID}
master_port() { echo $((20000 + (SLURM_JOB_ID + 997 * $1) % 12000)); }  # an attempt's own (the last one's may linger in TIME_WAIT)
# One training step's srun, in the background, on $nodes: srun's messages kept in $1 (emptied first, and shown
# as they come), its exit status in $1.status; its tasks' stdin from $2 (else none, as for any background command)
start_step() {
  : >"$1"
  ( trap '' USR2 TERM
    set +e
    [ -z "$standby_in" ] || exec {standby_in}>&-  # the standby's pipe: its readers see its end when the shell goes
    srun --unbuffered --kill-on-bad-exit=1 --overlap --nodes="$step_count" --ntasks=$((step_count * 1)) \
    --ntasks-per-node=1 --nodelist="$nodes" --job-name="hpcrun-attempt$HPCRUN_ATTEMPT" \
    --output=/var/tmp/hpcrun-testcluster/runs/20260101-000000-0000-golden/logs/%j_%t_log.out --error=/var/tmp/hpcrun-testcluster/runs/20260101-000000-0000-golden/logs/%j_%t_log.err \
    /usr/bin/python3 -u -m hpcrun.launch "$run_dir" 2>&1 >&3 3>&- | tee -a "$1" >&2
    echo "${PIPESTATUS[0]}" >"$1.status" ) <"${2:-/dev/null}" &
}
# A warm standby (fault.warm_standby): the next attempt's ranks, started on this attempt's nodes with the
# next attempt's environment and told by a line on their stdin (hpcrun.runtime.standby): `warm` once
# this attempt trains, `go` to be the restart when it stays on these nodes, else `exit`.
standby= standby_nodes= standby_in= standby_err= standby_attempt=
end_standby() {  # $1: `wait` at the job's normal end (its step given a few seconds to end by itself), `last`
  # at its other ends, none when the job goes on (a restart on other nodes)
  [ -n "$standby" ] || return 0
  echo exit >&"$standby_in" 2>/dev/null
  exec {standby_in}>&-
  if [ "${1:-}" = wait ]; then
    for _ in $(seq 30); do kill -0 "$standby" 2>/dev/null || break; sleep 0.1; done
  fi
  # else (a requeue's, a preemption's end, or other nodes for the restart) no wait, which would hold the
  # requeue: its srun ended (one with a task on a lost node never would, and a restart's ranks wait for
  # what is left of earlier attempts), its tasks leave on the word or their input's end, or by scancel
  if kill -0 "$standby" 2>/dev/null; then
    # its subshell first (out of the job table: no "Killed" notice), which would write its status file
    # after this script's exit removed its files
    local sruns
    sruns=$(pgrep -P "$standby" -x srun || true)
    disown "$standby" 2>/dev/null || true
    kill -KILL "$standby" $sruns 2>/dev/null || true
  fi
  # at the job's end SLURM ends its steps: a scancel retried past a requeue would reach the next start's step of
  # the same id
  if [ -z "${1:-}" ]; then
    # its step by its name, looked up now: a restart of that attempt number started cold on other nodes
    # takes the same name next; scancel waits for a lost node's answer, so in the background
    local ids
    ids=$(timeout 10 squeue -h -s -j "$SLURM_JOB_ID" -o %i,%j 2>/dev/null \
      | awk -F, -v name=hpcrun-attempt"$standby_attempt" '$2 == name { print $1 }' || true)
    if [ -n "$ids" ]; then
      { for id in $ids; do timeout 30 scancel --signal=KILL "$id"; done; } </dev/null >/dev/null 2>&1 3>&- &
    fi
  fi
  standby=
}
ready() {  # the standby can be the restart: its srun runs, none of its tasks ended
  kill -0 "$standby" 2>/dev/null && [ ! -e "$standby_err.status" ] && ! grep -q '^srun: error' "$standby_err" 2>/dev/null
}
while :; do
  # hpcrun's attempt number: every start of the step in this job, requeues and restarts in it alike
  HPCRUN_ATTEMPT=0
  [ ! -f "$starts" ] || HPCRUN_ATTEMPT=$(wc -l <"$starts")
  echo "$SLURM_RESTART_COUNT $restarts_in_job $(date +%s) $nodes" >>"$starts"
  export HPCRUN_ATTEMPT HPCRUN_RESTARTS_IN_JOB=$restarts_in_job
  # the job's first nodes; fewer after a lost node with none to take its place (fault.min_nodes): the
  # ranks left take the lost ones' share of the global batch
  step_count=$(printf '%s\n' ${nodes//,/ } | wc -l)
  # Rendezvous on the step's first node, spelled as its high-speed hostname
  export MASTER_ADDR="${nodes%%,*}"
  export MASTER_PORT=$(master_port "$HPCRUN_ATTEMPT")
  err="$srun_stderr.$HPCRUN_ATTEMPT"  # this attempt's srun messages (a standby's: its own)
  rm -f "$srun_stderr.next" "$srun_stderr.ending"
  probes="$srun_stderr.probes$restarts_in_job"  # this start's: an earlier start's late probe writes its own
  # Only while the job runs: SLURM's own SIGTERM (a requeue, preemption, cancel, the time limit) finds it
  # ending, and scancel retries on an ending job until KillWait's SIGKILL, holding a requeue that long.
  # An array's task by its own id: the array's job id would signal every task of the sweep.
  trap 'scancel -Q --state=RUNNING --signal=USR2 "$this_job" || true' USR2
  trap 'scancel -Q --state=RUNNING --signal=TERM "$this_job" || true' TERM
  if [ -n "$standby" ] && [ "$standby_nodes" = "$nodes" ] && ready; then
    echo go >&"$standby_in"
    exec {standby_in}>&-
    step=$standby standby= err=$standby_err
  else
    end_standby
    start_step "$err"
    step=$!
  fi
  if [ "$restarts_in_job" -lt 5 ]; then
    # the next attempt's ranks, should this one fail; a pipe of their own (a promoted standby's srun
    # still has the one before)
    next=$((HPCRUN_ATTEMPT + 1))
    standby_err="$srun_stderr.standby$next"
    mkfifo "$srun_stderr.in$next"
    exec {standby_in}<>"$srun_stderr.in$next"
    HPCRUN_ATTEMPT=$next HPCRUN_RESTARTS_IN_JOB=$((restarts_in_job + 1)) MASTER_PORT=$(master_port "$next") \
      HPCRUN_STANDBY=1 start_step "$standby_err" "$srun_stderr.in$next"
    standby=$! standby_nodes=$nodes standby_attempt=$next
  fi
  # srun waits for every task to report its end, and a lost node's never do: once a task has
  # failed, a step still there 5 s later is ended by a watcher beside it (its tasks on live
  # nodes are gone). SLURM counts such a step as running until it drops the lost node: the steps
  # after it --overlap. This shell waits for the step itself, so a restart starts as it ends.
  ( trap '' USR2 TERM
    set +e  # a failed log write must not end the watch
    attempt=$HPCRUN_ATTEMPT began=$SECONDS
    unset HPCRUN_ATTEMPT  # its children are no attempt's processes a restart waits for
    failed_at= pause=1  # a look a second, every 0.2 s once a task has failed: the restart waits on this watch
    saving() { false; }
    # the pulse ring named a rank silent, once its namer had recorded that and kept its state: the ranks
    # still there wait in a collective for the silent one, which never returns (stopped, or its node lost)
    named() {
      local marks=("$run_dir"/exits/"$this_job-$attempt"-rank*.silent)
      [ -e "${marks[0]}" ]
    }
    warmed= progress="$run_dir"/progress.json seen=
    while kill -0 "$step" 2>/dev/null; do
      sleep "$pause" </dev/null >/dev/null 2>&1 3>&-  # holds none of the script's outputs once the watcher goes
      # the standby imports once this attempt trains on, past its start-up: rank 0's progress written again
      # after its start's (a flush: metrics.flush_seconds, or a checkpoint), or a minute in
      if [ -n "$standby" ] && [ -z "$warmed" ]; then
        if [ -z "$seen" ] && [ "$progress" -nt "$starts" ]; then  # both written on the run's file system
          seen=$(stat -c %y "$progress" 2>/dev/null)
        elif { [ -n "$seen" ] && [ "$(stat -c %y "$progress" 2>/dev/null)" != "$seen" ]; } \
          || [ "$SECONDS" -ge $((began + 60)) ]; then
          echo warm >&"$standby_in" 2>/dev/null
          warmed=1
        fi
      fi
      if [ -z "$failed_at" ] && grep -q '^srun: error: .*: tasks\? [0-9]' "$err" 2>/dev/null; then
        failed_at=$SECONDS pause=0.2
        # The step's nodes probed now, beside SLURM's clients (the ranks' container may have none),
        # read only if the step must be ended: a live node runs a step of `true` at once, a lost one
        # never (and srun, told to stop, waits for it: hence -k). A controller that does not answer
        # for the job either tells a busy slurmctld from lost nodes (hpcrun.runtime.nodes reads the
        # file). 16 probes at a time, as srun asks slurmctld. Begun with the grace, not after it.
        { ( set +e  # a probe's failure is its answer
          printf '%s\n' ${nodes//,/ } | xargs -P 16 -I{} sh -c 'timeout -k 2 5 srun --overlap --nodes=1 \
            --ntasks=1 --ntasks-per-node=1 --job-name=hpcrun-probe --nodelist="$1" true </dev/null >/dev/null 2>&1
            echo "node $1 $?"' sh {}
          timeout -k 2 5 squeue -h -j "$SLURM_JOB_ID" -o %i </dev/null >/dev/null 2>&1
          echo "controller - $?" ) >"$probes.part" 2>/dev/null && mv -f "$probes.part" "$probes"; } </dev/null 3>&- &
      fi
      # in the same look: a silent rank's namer has written its mark before its task failed
      if [ -n "$failed_at" ] && ! saving && { [ $((SECONDS - failed_at)) -ge 5 ] || named; }; then
        : >"$srun_stderr.ending"
        if [ $((SECONDS - failed_at)) -ge 5 ]; then
          echo '[hpcrun] srun ended by the batch script: it outlived its failed task by 5 s (a node lost?)' | tee -a "$err" >&2
        else
          echo '[hpcrun] srun ended by the batch script: the pulse ring named a rank silent' | tee -a "$err" >&2
        fi
        pkill -KILL -P "$step" -x srun || true
        # and the step's tasks still on live nodes: the signal leaves at once, but scancel waits
        # ~MessageTimeout for a lost node's answer, so in the background. A restart's ranks wait for what
        # is left of them on their node (hpcrun.runtime.predecessors). Not the probes: a live node's, killed
        # before its `true` ran, would say the node is lost (their `timeout` ends a lost node's)
        for s in $(timeout 10 squeue -h -s -j "$SLURM_JOB_ID" -o %i,%j 2>/dev/null); do
          case $s in
            *.batch,*|*.extern,*|*,hpcrun-probe|*,hpcrun-attempt$((attempt + 1))) ;;  # not the next attempt's standby
            *) timeout 30 scancel --signal=KILL "${s%%,*}" </dev/null >/dev/null 2>&1 3>&- & ;;
          esac
        done
        break
      fi
    done ) &
  watcher=$!
  until wait "$step" || ! kill -0 "$step" 2>/dev/null; do :; done
  # the watcher's work, once begun, is finished; else it has nothing left to watch
  [ -e "$srun_stderr.ending" ] || kill -KILL "$watcher" 2>/dev/null || true
  # reaped here, where bash's "Killed" notice goes nowhere; a trapped signal ends `wait` early
  until wait "$watcher" 2>/dev/null || ! kill -0 "$watcher" 2>/dev/null; do :; done
  step_status=$(cat "$err.status" 2>/dev/null || true)
  step_status=${step_status:-1}  # no status: the subshell was killed
  # the ranks are gone: a stop has no step to reach, and this shell must outlive the failure step
  trap '' USR2 TERM
  [ "$step_status" -ne 0 ] || break
  # ready for the restart the failure step may name: no import left to do
  [ -z "$standby" ] || echo warm >&"$standby_in" 2>/dev/null || true
  if [ -e "$srun_stderr.ending" ]; then
    # the watcher's probes, begun when the first task failed: their answers, or their time out
    for _ in $(seq $(( (5 + 5) * 5 ))); do [ -e "$probes" ] && break; sleep 0.2; done
  fi
  # one task on this node, inside the same container as the ranks: the interpreter named by the
  # site exists there, and so does hpcrun. SLURM's word on the job's nodes now (spares included, a
  # dropped node not).
  job_nodes=$(scontrol show hostnames "$(held_nodes)" 2>/dev/null | paste -sd, - || true)
  # the node-local directories go with a requeue: the failure step removes them before it asks
  # for one (after it, SLURM refuses this script's cleanup at exit)
  HPCRUN_NODE_DIRS=$(printf '%s\n' "${node_dirs[@]}") HPCRUN_STEP_NODES=$nodes HPCRUN_JOB_NODES=$job_nodes \
  HPCRUN_PROBES="$probes" HPCRUN_NEXT_NODES="$srun_stderr.next" srun --overlap --nodes=1 --ntasks=1 --ntasks-per-node=1 \
    --nodelist="$SLURMD_NODENAME" \
    /usr/bin/python3 -m hpcrun.runtime.failure "$run_dir" "$step_status" <"$err" \
    || echo "[hpcrun] the failure step exited $? (none starts once SLURM ends or requeues the job)" >&2
  [ -s "$srun_stderr.next" ] || break
  nodes=$(cat "$srun_stderr.next")
  restarts_in_job=$((restarts_in_job + 1))
done
if [ "$step_status" -eq 0 ]; then end_standby wait; else end_standby last; fi
exit "$step_status"
