#!/usr/bin/env bash
# A real SLURM cluster on this machine, for hpcrun's integration tests.
#
#   tests/cluster/testcluster.sh up [--nodes N]   install (Debian packages) and start everything; idempotent
#   tests/cluster/testcluster.sh slurmd NODE      start one node's slurmd (a node powered off by tests/faults.py)
#   tests/cluster/testcluster.sh install          only the Debian packages (.ci/run: beside pip's installs)
#   tests/cluster/testcluster.sh status           daemons, nodes and partitions
#   tests/cluster/testcluster.sh down             stop the daemons and remove the namespaces
#
# Layout: bridge hpcbr0 (10.77.0.1) on the host runs slurmctld, slurmdbd, MariaDB and munge;
# network namespaces node1 (10.77.0.11), node2 (10.77.0.12), ... each run one slurmd and reach
# the others only through their interface `hpc0`, which sites/testcluster.yaml names.
#
# Partitions: nodes come in pools of two, each with its own partitions, so test processes
# running at once each get a cluster of their own (tests/runs.py `pool`): pool 0 is `batch` (the
# default), `urgent` (a higher priority tier that preempts `batch` with requeue) and `fragile`
# (preempted by `urgent` with PreemptMode=CANCEL) on node[1-2]; pool k is `batchk`/`urgentk`/
# `fragilek` on the next two nodes. `all` spans every node; from
# 8 nodes, `scale` spans the upper half (the scale tests', tests/test_cluster_campaign.py). A user
# `hpcwatch` runs the polling test's watchers (SLURM counts RPCs per user); `hpcquota` may hold 25 jobs
# (MaxSubmitJobs, enforced: the sweep-deferral test; 10 in QOS capped, 30 in QOS wide).
# N defaults to 2 (one pool), or to the node count of a cluster already up. Beside them, each pool
# outside `scale` has a spare node, node(N+k+1), and a partition `spare`/`sparek` of its two nodes
# and that one (the hot-spare tests, resources.spare_nodes); `all` leaves the spares out.
# Each node has node-local scratch, a tmpfs at $LOCAL mounted in the mount namespace its slurmd
# (and so every job process on it) lives in: gone when the node is powered off, as on real nodes.
# Needs root. See shared notes/slurm-testbed.md for why each setting is here.
set -euo pipefail

CLUSTER=hpctest
BRIDGE=hpcbr0
NET=10.77.0
IFACE=hpc0
ETC=/etc/slurm
SHARED=/var/tmp/hpcrun-testcluster
LOGS=/var/log/slurm
LOCAL=/run/hpcrun-node-local

log() { printf '[testcluster] %s\n' "$*" >&2; }

install_packages() {
  local missing=()
  for bin in slurmctld slurmd slurmdbd sbatch munged mysqld_safe ip; do
    command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
  done
  dpkg -s libaio-dev >/dev/null 2>&1 || missing+=(libaio-dev)
  [ ${#missing[@]} -eq 0 ] && return
  log "installing SLURM, munge, MariaDB (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurmctld slurmd slurm-client slurmdbd munge mariadb-server libaio-dev iproute2 >/dev/null
}

network_up() {
  # Idempotent over what an earlier cluster left: network namespaces and the bridge outlive the
  # processes of a session that ended without `down`. No `cmd | grep -q` tests here: under
  # pipefail the test fails when grep exits before the command's last write (SIGPIPE), and an
  # `ip addr add` of an address already there then fails ("Address already assigned", seen in CI).
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$NET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  local i=11 have
  for node in "${NODES[@]}"; do
    have=$(ip netns exec "$node" ip -4 -o addr show dev "$IFACE" 2>/dev/null || true)
    if [[ $have != *" $NET.$i/24 "* ]] || ! ip link show "veth-$node" >/dev/null 2>&1; then
      ip netns del "$node" 2>/dev/null || true  # a namespace half made, or its veth gone
      ip link del "veth-$node" 2>/dev/null || true
      if pkill -f "^slurmd -N $node\$"; then  # it would stay in the old namespace
        wait_for 15 "slurmd of $node to exit" bash -c "! pgrep -f '^slurmd -N $node\$'"
      fi
      ip netns add "$node"
      ip link add "veth-$node" type veth peer name "tmp-$node"
      ip link set "tmp-$node" netns "$node"
      ip netns exec "$node" ip link set "tmp-$node" name "$IFACE"
      ip netns exec "$node" ip addr add "$NET.$i/24" dev "$IFACE"
      ip netns exec "$node" ip link set "$IFACE" up
      ip netns exec "$node" ip link set lo up
    fi
    ip link set "veth-$node" master "$BRIDGE"
    ip link set "veth-$node" up
    grep -q "^$NET.$i $node\$" /etc/hosts || echo "$NET.$i $node" >>/etc/hosts
    i=$((i + 1))
  done
}

write_config() {  # returns 1 when slurm.conf changed (a running cluster must reread it)
  mkdir -p "$ETC" "$LOGS" /var/spool/slurmctld /run/slurm "$SHARED"/{runs,results,nvme}
  chmod 1777 "$SHARED" "$SHARED"/{runs,results,nvme}
  local host; host=$(hostname -s)
  # written aside and renamed only when different: every SLURM command on this machine (other
  # tests' included) reads slurm.conf, and must never see it half written
  cat >"$ETC/slurm.conf.new" <<CONF
ClusterName=$CLUSTER
SlurmctldHost=$host($NET.1)
SlurmUser=root
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s);
# short here so requeue tests take seconds. Clusters choose it for their prolog times.
AuthInfo=cred_expire=20
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# A lost node is DOWN after SlurmdTimeout without an answer to slurmctld's pings (sent every
# third of it), and its jobs are requeued (NODE_FAIL); default 300 s, short here so node-loss
# tests take seconds. ReturnToService=2: a DOWN node is usable again as soon as its slurmd
# registers (tests/faults.py power_on), with no scontrol update state=resume.
SlurmdTimeout=30
ReturnToService=2
SchedulerType=sched/backfill
MpiDefault=none
JobRequeue=1
KillWait=20
# Longer than KillWait: slurmd answers slurmctld's "end this step" only once the step's tasks
# are gone (up to KillWait); an answer later than MessageTimeout (default 10 s) makes slurmctld
# send the request again ~60 s later, when it ends the requeued attempt's step of the same id.
# hpcrun's ranks end within seconds of SIGTERM (hpcrun/signals.py), but on this machine's two
# loaded cores slurmd itself can take longer than 10 s.
MessageTimeout=30
# A step's tasks may outlive SIGKILL while one of them waits on the disk (a checkpoint's fsync, in
# D state: seen for 60 s when CI's setup, its pip and DeepSpeed's builds saturated this machine's
# disk): past UnkillableStepTimeout (default 60 s) SLURM drains the node ("Kill task failed") and
# every later test of its pool finds no node. Sites on slow shared filesystems raise it the same way.
UnkillableStepTimeout=180
MinJobAge=600
InactiveLimit=0
MaxArraySize=1001
# past every job slurmdbd already holds (start_slurm): a slurmctld killed before it saved its
# state would hand out ids again, and sacct -j ID would mix two jobs' records (no backticks in
# this heredoc: the shell would run them)
FirstJobId=$(cat "$ETC/first-job-id" 2>/dev/null || echo 1)
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
AccountingStorageType=accounting_storage/slurmdbd
# association limits are enforced, as on shared clusters: user hpcquota may hold 25 jobs (array
# tasks count one each), and a sweep past that is refused by slurmctld, not only by hpcrun
AccountingStorageEnforce=limits
# the bridge address, not localhost: jobs on the nodes (their own network namespaces) ask sacct too
AccountingStorageHost=$NET.1
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
# The main scheduler and backfill passes every few seconds (defaults: 60 s and 30 s): a requeued
# job whose hold has expired starts at the next pass, not up to a minute later. No event wakes
# the scheduler when the hold ends.
SchedulerParameters=sched_interval=3,bf_interval=5
$(node_lines)
CONF
  cat >"$ETC/cgroup.conf" <<CONF
CgroupPlugin=cgroup/v1
CgroupAutomount=no
CONF
  cat >"$ETC/slurmdbd.conf" <<CONF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=$LOGS/slurmdbd.log
PidFile=/run/slurm/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurmtest
StorageLoc=slurm_acct_db
CONF
  chmod 600 "$ETC/slurmdbd.conf"
  if cmp -s "$ETC/slurm.conf.new" "$ETC/slurm.conf"; then rm -f "$ETC/slurm.conf.new"; return 0; fi
  mv "$ETC/slurm.conf.new" "$ETC/slurm.conf"
  return 1
}

node_lines() {  # NodeName and PartitionName lines for "${NODES[@]}": pools of two, then the spares
  local i=11 node pool
  for node in "${NODES[@]}"; do
    echo "NodeName=$node NodeAddr=$NET.$i CPUs=2 RealMemory=4000 State=UNKNOWN"
    i=$((i + 1))
  done
  # GraceTime 0 (the default): a preempted job gets USR2 and SIGTERM together, SIGKILL KillWait later
  for ((pool = 0; pool < ${#POOLED[@]} / 2; pool++)); do
    local members="${POOLED[$((2 * pool))]},${POOLED[$((2 * pool + 1))]}" suffix=""
    [ "$pool" -gt 0 ] && suffix=$pool
    echo "PartitionName=batch$suffix Nodes=$members$([ "$pool" -eq 0 ] && echo ' Default=YES') MaxTime=01:00:00 State=UP PriorityTier=1 PreemptMode=REQUEUE"
    echo "PartitionName=urgent$suffix Nodes=$members MaxTime=01:00:00 State=UP PriorityTier=10 PreemptMode=OFF"
    # a site whose preemption cancels: a preempted job there is over, not coming back
    echo "PartitionName=fragile$suffix Nodes=$members MaxTime=01:00:00 State=UP PriorityTier=1 PreemptMode=CANCEL"
    if [ "$pool" -lt "${#SPARES[@]}" ]; then
      echo "PartitionName=spare$suffix Nodes=$members,${SPARES[$pool]} MaxTime=01:00:00 State=UP PriorityTier=1 PreemptMode=REQUEUE"
    fi
  done
  echo "PartitionName=all Nodes=$(IFS=,; echo "${POOLED[*]}") MaxTime=01:00:00 State=UP PriorityTier=1 PreemptMode=REQUEUE"
  # from 8 nodes: the upper half for the scale tests (a 1,000-point campaign, training on 4 nodes),
  # apart from the pools of the first half, where CI runs the other cluster tests at the same time
  if [ "${#POOLED[@]}" -ge 8 ]; then
    echo "PartitionName=scale Nodes=$(IFS=,; echo "${POOLED[*]:${#POOLED[@]}/2}") MaxTime=01:00:00 State=UP PriorityTier=1 PreemptMode=REQUEUE"
  fi
}

test_users() {
  # Unprivileged users: `hpcwatch` for the polling test (SLURM counts RPCs per user: sdiag,
  # sacctmgr show stats; its watchers' queries are told apart from everything root does), and
  # `hpcquota`, whose association holds at most 25 jobs (MaxSubmitJobs, a common per-user cap:
  # the sweep-deferral test). They run this machine's Python and hpcrun: the directories above
  # them must let them pass.
  local user
  for user in hpcwatch hpcquota; do
    id "$user" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$user"
  done
  # each part only where missing (an earlier run may have stopped halfway), the cap set every time
  [ -n "$(sacctmgr -n -P show account quota format=account)" ] || sacctmgr -i add account quota cluster="$CLUSTER" >/dev/null
  [ -n "$(sacctmgr -n -P show assoc where user=hpcquota format=user)" ] || sacctmgr -i add user hpcquota account=quota >/dev/null
  sacctmgr -i modify user hpcquota set maxsubmitjobs=25 >/dev/null || true  # exit 1 when nothing changed
  # two QOS hpcquota may use, whose per-user caps SLURM applies before the association's 25:
  # `capped` holds 10 jobs, `wide` 30 (the QOS test of tests/test_cluster_campaign.py)
  local qos cap
  for qos in capped:10 wide:30; do
    cap=${qos#*:} qos=${qos%:*}
    [ -n "$(sacctmgr -n -P show qos "$qos" format=name)" ] || sacctmgr -i add qos "$qos" >/dev/null
    sacctmgr -i modify qos "$qos" set maxsubmitjobsperuser="$cap" >/dev/null || true
  done
  sacctmgr -i modify user hpcquota set qos+=capped,wide >/dev/null || true
  local dir
  for dir in "$(python3 -c 'import sys; print(sys.base_prefix)')" "$(python3 -c 'import hpcrun, os; print(os.path.dirname(hpcrun.__file__))' 2>/dev/null || true)"; do
    while [ -n "$dir" ] && [ "$dir" != / ]; do
      chmod o+x "$dir" 2>/dev/null || true
      dir=$(dirname "$dir")
    done
  done
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local limit=$1 what=$2; shift 2
  for _ in $(seq "$limit"); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  log "timed out waiting for $what"; return 1
}

start_munge() {
  pgrep -x munged >/dev/null && return
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
  runuser -u munge -- /usr/sbin/munged
  wait_for 20 munge munge -n
}

start_mariadb() {
  if ! pgrep -f mysqld_safe >/dev/null; then
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    (mysqld_safe >/dev/null 2>&1 &)
  fi
  wait_for 60 MariaDB mysqladmin ping
  mysql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
            CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmtest';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
}

start_slurm() {
  if ! pgrep -x slurmdbd >/dev/null; then slurmdbd; fi
  wait_for 60 slurmdbd sacctmgr -n list cluster
  local clusters; clusters=$(sacctmgr -n list cluster format=cluster)
  [[ " $(echo $clusters) " == *" $CLUSTER "* ]] || sacctmgr -i add cluster "$CLUSTER" >/dev/null
  if ! pgrep -x slurmctld >/dev/null; then
    local last; last=$(sacct -X -n -P -a -S 2000-01-01 -E now -o JobIDRaw | sort -n | tail -1)
    echo $(( ${last:-0} + 1 )) >"$ETC/first-job-id"
    write_config || true
    slurmctld
  fi
  wait_for 60 slurmctld scontrol ping
  for node in "${NODES[@]}"; do
    pgrep -f "^slurmd -N $node\$" >/dev/null || start_slurmd "$node"
  done
  # nodes that were down from an earlier run come back once their slurmd answers
  scontrol update nodename="$(IFS=,; echo "${NODES[*]}")" state=resume >/dev/null 2>&1 || true
  wait_for 90 "all ${#NODES[@]} nodes idle" nodes_idle
}

start_slurmd() {  # NODE: its slurmd, in a mount namespace of its own holding the node's scratch
  local node=$1
  mkdir -p "/var/spool/slurmd/$node" "$LOCAL"
  # `ip netns exec` gives each call a new mount namespace (mounts in it do not reach the host): a
  # tmpfs mounted there is seen by this slurmd and every job process it starts, and by nothing else
  ip netns exec "$node" sh -c 'mount -t tmpfs -o size=3g,mode=1777 hpcrun-node-local "$1" && exec slurmd -N "$2"' \
    sh "$LOCAL" "$node"
}

nodes_up() {  # every node answers (idle, or running jobs)
  [ "$(sinfo -h -N -o '%N %t' | sort -u | grep -cE ' (idle|mix|alloc)$')" -eq "${#NODES[@]}" ]
}

nodes_idle() {
  [ "$(sinfo -h -N -o '%N %t' | sort -u | grep -c ' idle$')" -eq "${#NODES[@]}" ]
}

running_nodes() {  # the node count of the cluster up now (0: none)
  scontrol show nodes -o 2>/dev/null | grep -c '^NodeName=node' || true
}

status() {
  for d in munged 'mysqld|mariadbd' slurmdbd slurmctld; do
    printf '%-10s %s\n' "${d%%|*}" "$(pgrep -x "$d" >/dev/null && echo running || echo stopped)"
  done
  for node in "${NODES[@]}"; do
    printf '%-10s %s\n' "slurmd/$node" "$(pgrep -f "^slurmd -N $node\$" >/dev/null && echo running || echo stopped)"
  done
  sinfo -N -o '%N %P %t %c' 2>/dev/null || true
}

up() {
  if scontrol ping >/dev/null 2>&1 && [ "$(running_nodes)" -ne "${#NODES[@]}" ]; then
    log "$(running_nodes) nodes up, ${#NODES[@]} asked: restarting"
    down
  fi
  if scontrol ping >/dev/null 2>&1 && nodes_up 2>/dev/null; then
    # running (maybe busy): only a changed configuration to apply
    if ! write_config; then
      if [[ "$(scontrol show config)" != *"AccountingStorageEnforce = associations,limits"* ]]; then
        # reconfigure shows a new AccountingStorageEnforce but does not apply it (seen; the
        # slurm.conf manual: a restart is required)
        log "slurm.conf changed: restarting slurmctld"; scontrol shutdown slurmctld
        wait_for 30 "slurmctld to exit" bash -c '! pgrep -x slurmctld'
        start_slurm
      else
        log "slurm.conf changed: scontrol reconfigure"; scontrol reconfigure
      fi
    fi
    test_users
    log "already up"; status; return
  fi
  install_packages
  network_up
  write_config || true
  start_munge
  start_mariadb
  start_slurm
  test_users
  log "up: $(sinfo -h -N -o '%N:%t' | tr '\n' ' ')"
}

down() {
  scancel --state=all -u root >/dev/null 2>&1 || true
  scancel --state=all -u hpcquota >/dev/null 2>&1 || true
  # a daemon still exiting holds its port (the next `up` could not start its successor), and a
  # step daemon of a killed job keeps its node "completing": stop them all, then insist
  pkill -x 'slurmd|slurmctld|slurmdbd|slurmstepd' || true
  if ! wait_for 15 "daemons to exit" bash -c '! pgrep -x "slurmd|slurmctld|slurmdbd|slurmstepd"'; then
    pkill -9 -f 'slurmd|slurmctld|slurmdbd|slurmstepd' || true
    wait_for 10 "daemons to die" bash -c '! pgrep -x "slurmd|slurmctld|slurmdbd|slurmstepd"'
  fi

  for node in $(ip netns list | grep -oE '^node[0-9]+'); do  # every node of any size's cluster
    ip netns del "$node" 2>/dev/null || true
    ip link del "veth-$node" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  log "down (munge and MariaDB left running; they are harmless and slow to restart)"
}

count= node_arg=
command=${1:-}
[ $# -gt 0 ] && shift
if [ "$command" = slurmd ]; then node_arg=${1:?usage: $0 slurmd NODE}; shift; fi
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) count=${2:-}; shift 2 || true ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
if [ -z "$count" ]; then
  # the pooled nodes of a cluster up now (`all` leaves the spares out)
  count=$( (sinfo -h -p all -N -o '%N' 2>/dev/null || true) | sort -u | wc -l)
  [ "$count" -ge 2 ] || count=2
fi
if ! [[ "$count" =~ ^[0-9]+$ ]] || [ "$count" -lt 2 ] || [ $((count % 2)) -ne 0 ] || [ "$count" -gt 64 ]; then
  echo "--nodes: an even number from 2 to 64, not '$count'" >&2; exit 2
fi
POOLED=() SPARES=()
for ((n = 1; n <= count; n++)); do POOLED+=("node$n"); done
# one spare per pool outside `scale` (the upper half from 8 nodes)
spares=$(( count >= 8 ? count / 4 : count / 2 ))
for ((n = count + 1; n <= count + spares; n++)); do SPARES+=("node$n"); done
NODES=("${POOLED[@]}" "${SPARES[@]}")

case "$command" in
  up) up ;;
  install) install_packages ;;
  down) down ;;
  status) status ;;
  slurmd) start_slurmd "$node_arg" ;;
  *) echo "usage: $0 up [--nodes N]|install|down|status|slurmd NODE" >&2; exit 2 ;;
esac
