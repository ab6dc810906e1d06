#!/usr/bin/env bash
# ceph-dev-cluster.sh: a throwaway single-node Ceph cluster for tests and demos.
#
#   scripts/ceph-dev-cluster.sh start DIR     one mon, one mgr, one memstore OSD, pool "rbd";
#                                             waits for HEALTH_OK; last stdout line is DIR/ceph.conf
#   scripts/ceph-dev-cluster.sh stop DIR      kill the daemons started from DIR, delete what start made
#   scripts/ceph-dev-cluster.sh status DIR    ceph -s
#   scripts/ceph-dev-cluster.sh stop-osd DIR  clean OSD shutdown (memstore is saved to DIR/osd.0)
#   scripts/ceph-dev-cluster.sh start-osd DIR start the OSD again (memstore reloaded), wait for HEALTH_OK
#   scripts/ceph-dev-cluster.sh pause-osd DIR SIGSTOP the OSD: I/O to it blocks, nothing is lost
#   scripts/ceph-dev-cluster.sh resume-osd DIR SIGCONT the OSD (and re-peer it after a long
#                                             pause): blocked I/O completes
#
# Clients: CEPH_CONF=DIR/ceph.conf rbd create --size 1G rbd/img; rbd ls; rbd export ...;
# fio --ioengine=rbd --clientname=admin --pool=rbd --rbdname=img ... with CEPH_CONF set.
#
# Needs Debian 12's ceph-mon ceph-osd ceph-mgr ceph-common (librbd-dev for building
# against librbd) and root: the daemons run as root, so nothing is chowned to "ceph".
#
# Everything lives under DIR: ceph.conf, keyrings, mon/mgr/osd data, logs (DIR/log),
# pid files and admin sockets (DIR/run). Nothing is read from or written to /etc/ceph,
# /var/lib/ceph, /var/log/ceph or /var/run/ceph. The monitor listens on 127.0.0.1 at
# a port picked free at start (stored in DIR/ceph.conf), mgr and OSD on 127.0.0.1 at
# ports they pick themselves, so clusters in different DIRs run side by side.
#
# Authentication: cephx, with keys generated at start. The client.admin keyring is
# DIR/client.admin.keyring and ceph.conf's [client] section points at it, so CEPH_CONF
# alone is enough for the ceph, rbd and fio clients (client name "admin").
#
# Storage: the OSD uses memstore, bounded by "memstore device bytes" (default 2 GiB,
# env CEPH_DEV_MEMSTORE_BYTES). Data lives in the OSD's memory: expect the OSD's RSS
# to be several times what is stored (1-2.4 GB for 256-512 MiB were seen).
#
# Stopping the OSD while it serves: use pause-osd/resume-osd. SIGSTOP freezes the OSD
# with its memory intact; client I/O to it hangs (librados retries forever by default)
# and completes after resume-osd. A pause shorter than the heartbeat grace (20 s) ends
# with SIGCONT alone. After a longer one resume-osd also marks the OSD down, as its
# peers would in a real cluster: the OSD rejoins, its PGs re-peer and blocked ops are
# resent; resume-osd returns once the cluster is HEALTH_OK again (a few seconds). That
# re-peer is also what revives an OSD whose PGs are stuck "laggy" (see the read lease
# note in write_conf). The OSD's op thread suicide timeout is raised to 10 minutes; the
# monitor marks an OSD that has not reported for 15 minutes down on its own.
#
# stop-osd/start-osd really restart the OSD. memstore keeps its data across that only
# because this script turns osd_fast_shutdown off: on SIGTERM the OSD writes its store
# to DIR/osd.0 and start-osd loads it back (checked: an rbd export before and after is
# identical). An OSD that crashed or got SIGKILL loses everything; stop and start the
# cluster then. I/O to the cluster blocks while the OSD is stopped.
#
# Health: the config switches off the warnings that a one-node, one-copy cluster
# raises by design (no redundancy, insecure global_id reclaim, low disk space for the
# mon) so that start can demand HEALTH_OK.
#
# Env: CEPH_DEV_MEMSTORE_BYTES (default 2147483648), CEPH_DEV_TIMEOUT (seconds to wait
# for HEALTH_OK, default 90).
set -euo pipefail

PROG=${0##*/}
MEMSTORE_BYTES=${CEPH_DEV_MEMSTORE_BYTES:-2147483648}
TIMEOUT=${CEPH_DEV_TIMEOUT:-90}
MON_ID=a
MGR_ID=x
OSD_ID=0
# osd heartbeat grace, Ceph's default, written into ceph.conf: resume-osd uses it.
HEARTBEAT_GRACE=20
# Files and directories start creates in DIR; stop removes exactly these.
OWNED=(ceph.conf client.admin.keyring mon.keyring monmap "mon.$MON_ID" "mgr.$MGR_ID"
  "osd.$OSD_ID" log run crash .ceph-dev-cluster)

usage() {
  cat >&2 <<EOF
usage: $PROG start|stop|status|stop-osd|start-osd|pause-osd|resume-osd DIR
  start DIR       bring up mon, mgr, memstore OSD and pool "rbd" under DIR; prints DIR/ceph.conf
  stop DIR        kill the daemons started from DIR and delete the cluster's files
  status DIR      ceph -s
  stop-osd DIR    stop the OSD cleanly (memstore saved to disk); start-osd DIR brings it back
  pause-osd DIR   SIGSTOP the OSD (I/O blocks, data kept); resume-osd DIR sends SIGCONT
                  (and re-peers the OSD if it was paused for over 20 s)
env: CEPH_DEV_MEMSTORE_BYTES (default 2147483648), CEPH_DEV_TIMEOUT (default 90 s)
clients: CEPH_CONF=DIR/ceph.conf rbd ls; fio --ioengine=rbd --clientname=admin ...
EOF
  exit 2
}

log() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Every ceph call is bounded so a dead monitor gives an error instead of a hang.
cephc() { timeout 60 ceph --connect-timeout 20 "$@"; }

# pid of daemon NAME (mon.a, mgr.x, osd.0) if it runs from this DIR's config, else fail.
# The cmdline check keeps a stale pid file from pointing at some unrelated process.
daemon_pid() {
  local pidfile=$RUN/$1.pid pid
  [[ -s $pidfile ]] || return 1
  pid=$(<"$pidfile")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [[ -r /proc/$pid/cmdline ]] || return 1
  tr '\0' '\n' <"/proc/$pid/cmdline" | grep -qxF "$CONF" || return 1
  echo "$pid"
}

# Wait up to $1 seconds for the command in $2... to succeed.
wait_for() {
  local limit=$1 start=$SECONDS
  shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS - start < limit)) || return 1
    sleep 0.2
  done
}

gone() { ! kill -0 "$1" 2>/dev/null; }

# Send SIGTERM (or $2) to daemon $1 and wait until it is gone; SIGKILL after 30 s.
kill_daemon() {
  local name=$1 sig=${2:-TERM} pid
  pid=$(daemon_pid "$name") || return 0
  kill -CONT "$pid" 2>/dev/null || true # a paused daemon cannot act on SIGTERM
  kill "-$sig" "$pid" 2>/dev/null || true
  if ! wait_for 30 gone "$pid"; then
    log "$name (pid $pid) still there after 30 s, sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    wait_for 10 gone "$pid" || die "$name (pid $pid) does not die"
  fi
  rm -f "$RUN/$name.pid"
}

# ceph-authtool without the cluster's config: its -n NAME would otherwise pick up
# that daemon's section and, for -n mon., create an empty log file DIR/log/mon..log.
authtool() { ceph-authtool -c /dev/null "$@" >/dev/null; }
authtool_print() { ceph-authtool -c /dev/null "$@"; }

# Start a daemon binary with the args given. Ceph daemons fork and detach; their early
# output goes to DIR/log/NAME.out, not to our stdout, so start can be used as
# conf=$(ceph-dev-cluster.sh start DIR) without the daemons holding the pipe open.
spawn() {
  local name=$1
  shift
  "$@" -c "$CONF" </dev/null >>"$LOGS/$name.out" 2>&1 ||
    die "$name failed to start; see $LOGS/$name.out and $LOGS/$name.log"
}

# A free TCP port on 127.0.0.1 for the monitor: random in 10000-29999, which is below
# the kernel's ephemeral range and away from the 6800-7300 range mgr and OSD bind in.
pick_port() {
  local port i
  for ((i = 0; i < 100; i++)); do
    port=$((10000 + RANDOM % 20000))
    # A connect that fails means nobody listens there (on 127.0.0.1 or 0.0.0.0).
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$port"
      return
    fi
  done
  die "no free port found for the monitor"
}

write_conf() {
  local port=$1 fsid=$2
  cat >"$CONF" <<EOF
# Throwaway single-node cluster made by $PROG; everything is under $DIR.
[global]
fsid = $fsid
mon initial members = $MON_ID
mon host = [v2:127.0.0.1:$port]
# Without these the mgr and OSD bind 0.0.0.0.
public addr = 127.0.0.1
cluster addr = 127.0.0.1
run dir = $RUN
crash dir = $DIR/crash
mon cluster log file = default=$LOGS/\$channel.log cluster=$LOGS/cluster.log
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
# All clients are current; the default "allow" raises a health warning.
auth allow insecure global id reclaim = false
# One OSD: one copy, placed on the OSD itself rather than across hosts.
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
# Test machines often have fuller disks than a mon likes; do not warn or stop for it.
mon data avail warn = 2
mon data avail crit = 1
# PG states reach the mon through the mgr, every 5 s by default; start waits on them.
mgr stats period = 1
mon mgr digest period = 1
# Ceph's default; resume-osd re-peers an OSD paused for longer than this.
osd heartbeat grace = $HEARTBEAT_GRACE
# Read leases: a PG serves I/O only while its lease (heartbeat grace * this ratio,
# 16 s by default) holds; the OSD renews it on a timer. After a pause longer than the
# lease its PGs go "laggy" until the renewal comes, and once (1 of 5 pauses of
# 10-170 s) it never came: client ops waited "for readable" until the OSD was marked
# down. A 1-hour lease keeps a pause from touching the lease at all; with one OSD there
# is no other primary a long lease could hold up (a re-peer after mark-down or restart
# took the usual few seconds).
osd pool default read lease ratio = 180

[mon]
mon data = $DIR/mon.\$id
keyring = $DIR/mon.\$id/keyring
log file = $LOGS/\$name.log
pid file = $RUN/\$name.pid
admin socket = $RUN/\$name.asok

[mon.$MON_ID]
# The monitor needs its address spelled out or it keeps probing for peers.
public addr = v2:127.0.0.1:$port

[mgr]
mgr data = $DIR/mgr.\$id
keyring = $DIR/mgr.\$id/keyring
log file = $LOGS/\$name.log
pid file = $RUN/\$name.pid
admin socket = $RUN/\$name.asok

[osd]
osd data = $DIR/osd.\$id
keyring = $DIR/osd.\$id/keyring
log file = $LOGS/\$name.log
pid file = $RUN/\$name.pid
admin socket = $RUN/\$name.asok
osd objectstore = memstore
memstore device bytes = $MEMSTORE_BYTES
# memstore only writes its contents to disk on a clean shutdown; fast shutdown skips it.
osd fast shutdown = false
# A paused (SIGSTOPped) OSD must not kill itself for slow threads when resumed.
osd op thread suicide timeout = 600
# resume-osd marks a long-paused OSD down; by default the 6th mark-down within 10
# minutes makes the OSD shut itself down.
osd max markdown count = 1000

[client]
keyring = $DIR/client.admin.keyring
EOF
}

health_ok() { [[ $(cephc health 2>/dev/null) == HEALTH_OK ]]; }
mgr_available() { cephc mgr stat -f json 2>/dev/null | grep -q '"available": *true'; }
# HEALTH_OK alone is not enough: PGs still being created do not warn yet.
pgs_clean() {
  cephc pg stat -f json 2>/dev/null |
    grep -Eq '"num_pg_by_state":\[\{"name":"active\+clean","num":[0-9]+\}\]'
}
osd_up() { cephc osd dump -f json 2>/dev/null | grep -q '"osd": *'"$OSD_ID"', *"uuid": *"[^"]*", *"up": *1'; }

# Bounded wait for HEALTH_OK; on timeout show the state and where the logs are.
wait_healthy() {
  local start=$SECONDS
  if ! wait_for "$TIMEOUT" mgr_available ||
    ! wait_for $((TIMEOUT - (SECONDS - start))) pgs_clean ||
    ! wait_for $((TIMEOUT - (SECONDS - start))) health_ok; then
    cephc -s >&2 || true
    cephc health detail >&2 || true
    die "cluster in $DIR not HEALTH_OK after ${TIMEOUT}s; logs: $LOGS/{mon.$MON_ID,mgr.$MGR_ID,osd.$OSD_ID}.log, $LOGS/cluster.log, $LOGS/*.out"
  fi
}

start_osd_daemon() {
  spawn "osd.$OSD_ID" ceph-osd -i "$OSD_ID"
  wait_for "$TIMEOUT" osd_up || die "osd.$OSD_ID not up after ${TIMEOUT}s; see $LOGS/osd.$OSD_ID.log"
}

cmd_start_failed() {
  (($1 == 0)) || log "start failed; logs are in $LOGS; '$PROG stop $DIR' removes what was made"
}

cmd_start() {
  local name pid running=0
  if [[ -e $DIR/.ceph-dev-cluster ]]; then
    [[ $(<"$DIR/.ceph-dev-cluster") == up ]] ||
      die "an earlier start in $DIR failed or is still running; '$PROG stop $DIR' cleans up"
    for name in "mon.$MON_ID" "mgr.$MGR_ID" "osd.$OSD_ID"; do
      if pid=$(daemon_pid "$name"); then
        running=1
      else
        log "warning: $name is not running"
        [[ $name != osd.* ]] || log "'$PROG start-osd $DIR' starts it"
      fi
    done
    if ((running)); then
      log "cluster in $DIR is already running"
      echo "$CONF"
      return
    fi
    die "$DIR holds a cluster whose daemons are all gone; run '$PROG stop $DIR' first"
  fi
  if [[ -d $DIR ]] && [[ -n $(ls -A "$DIR") ]]; then
    die "$DIR is not empty and was not made by $PROG"
  fi
  local tool
  for tool in ceph ceph-mon ceph-mgr ceph-osd ceph-authtool monmaptool rbd; do
    command -v "$tool" >/dev/null ||
      die "$tool not found; apt-get install ceph-mon ceph-osd ceph-mgr ceph-common"
  done
  [[ $(id -u) == 0 ]] || die "must run as root (the daemons run as root)"

  # Any failure from here on leaves a half-made cluster that stop can remove.
  trap 'cmd_start_failed $?' EXIT
  mkdir -p "$DIR"
  # The marker goes first so that stop can clean up after a start that failed halfway;
  # it says "up" once the cluster is HEALTH_OK.
  echo starting >"$DIR/.ceph-dev-cluster"
  mkdir -p "$LOGS" "$RUN" "$DIR/crash" "$DIR/mon.$MON_ID" "$DIR/mgr.$MGR_ID" "$DIR/osd.$OSD_ID"

  local port fsid
  port=$(pick_port)
  fsid=$(</proc/sys/kernel/random/uuid)
  write_conf "$port" "$fsid"
  log "monitor on 127.0.0.1:$port, fsid $fsid"

  # Monitor: keyring with the mon. key and client.admin (mkfs imports both into the
  # auth database), a one-entry monmap, mkfs, run.
  authtool --create-keyring "$DIR/mon.keyring" --gen-key -n mon. --cap mon 'allow *'
  authtool --create-keyring "$DIR/client.admin.keyring" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *'
  authtool "$DIR/mon.keyring" --import-keyring "$DIR/client.admin.keyring"
  monmaptool --create --fsid "$fsid" --addv "$MON_ID" "[v2:127.0.0.1:$port]" "$DIR/monmap" >/dev/null
  ceph-mon -c "$CONF" --mkfs -i "$MON_ID" --monmap "$DIR/monmap" --keyring "$DIR/mon.keyring" \
    >>"$LOGS/mon.$MON_ID.out" 2>&1 || die "ceph-mon --mkfs failed; see $LOGS/mon.$MON_ID.out"
  spawn "mon.$MON_ID" ceph-mon -i "$MON_ID"
  wait_for "$TIMEOUT" cephc mon stat || die "monitor does not answer; see $LOGS/mon.$MON_ID.log"

  # Manager: not needed for I/O, but without it health turns MGR_DOWN. Its devicehealth
  # module would create a pool of its own once the OSD is up (and scrape SMART data a
  # memstore OSD does not have); off, so the cluster holds just the rbd pool.
  cephc config set mgr mgr/devicehealth/enable_monitoring false --force
  cephc auth get-or-create "mgr.$MGR_ID" mon 'allow profile mgr' osd 'allow *' mds 'allow *' \
    -o "$DIR/mgr.$MGR_ID/keyring" >/dev/null
  spawn "mgr.$MGR_ID" ceph-mgr -i "$MGR_ID"

  # OSD: register it with a fresh key, mkfs the memstore, run. On boot the OSD puts
  # itself into the CRUSH map under host=$(hostname), root=default.
  local uuid key id
  uuid=$(</proc/sys/kernel/random/uuid)
  key=$(authtool_print --gen-print-key)
  authtool --create-keyring "$DIR/osd.$OSD_ID/keyring" -n "osd.$OSD_ID" --add-key "$key"
  id=$(printf '{"cephx_secret": "%s"}' "$key" | cephc osd new "$uuid" -i -)
  [[ $id == "$OSD_ID" ]] || die "expected osd id $OSD_ID, the monitor gave '$id'"
  ceph-osd -c "$CONF" -i "$OSD_ID" --mkfs --osd-uuid "$uuid" >>"$LOGS/osd.$OSD_ID.out" 2>&1 ||
    die "ceph-osd --mkfs failed; see $LOGS/osd.$OSD_ID.out"
  start_osd_daemon

  local out
  out=$(cephc osd pool create rbd 2>&1) || die "creating pool rbd failed: $out"
  # rbd pool init writes to the pool, so it also waits for the PGs to go active.
  timeout "$TIMEOUT" rbd pool init rbd || die "rbd pool init failed; see $LOGS/osd.$OSD_ID.log"
  wait_healthy
  echo up >"$DIR/.ceph-dev-cluster"
  trap - EXIT
  log "cluster up in $((SECONDS))s; use CEPH_CONF=$CONF"
  echo "$CONF"
}

cmd_stop() {
  if [[ ! -e $DIR/.ceph-dev-cluster ]]; then
    log "no cluster in $DIR; nothing to stop"
    return
  fi
  # Data is deleted anyway, so the OSD gets SIGKILL: a clean memstore shutdown would
  # first write the whole store to disk.
  # All three at once: each takes a second or two to go (the OSD to free its memory).
  local pids=() p failed=0 f
  kill_daemon "osd.$OSD_ID" KILL &
  pids+=($!)
  kill_daemon "mgr.$MGR_ID" &
  pids+=($!)
  kill_daemon "mon.$MON_ID" &
  pids+=($!)
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  ((failed == 0)) || die "not all daemons of $DIR could be stopped; nothing removed"
  for f in "${OWNED[@]}"; do rm -rf "${DIR:?}/$f"; done
  rmdir "$DIR" 2>/dev/null || log "left $DIR in place: it holds files not made by $PROG"
  log "stopped and removed the cluster in $DIR"
}

require_cluster() {
  [[ -e $DIR/.ceph-dev-cluster ]] || die "no cluster in $DIR (run '$PROG start $DIR')"
  daemon_pid "mon.$MON_ID" >/dev/null || die "the monitor of $DIR is not running"
}

cmd_status() {
  require_cluster
  cephc -s
}

cmd_stop_osd() {
  require_cluster
  daemon_pid "osd.$OSD_ID" >/dev/null || { log "osd.$OSD_ID is not running"; return; }
  kill_daemon "osd.$OSD_ID"
  rm -f "$RUN/osd.$OSD_ID.paused"
  # A clean shutdown tells the monitor already; after a SIGKILL it would not know for
  # 15 minutes, so say it (a no-op if it is down already).
  cephc osd down "$OSD_ID" >/dev/null 2>&1 || true
  log "osd.$OSD_ID stopped"
}

cmd_start_osd() {
  require_cluster
  if daemon_pid "osd.$OSD_ID" >/dev/null; then
    log "osd.$OSD_ID is already running"
    return
  fi
  start_osd_daemon
  wait_healthy
  log "osd.$OSD_ID started"
}

# Is process $1 stopped (SIGSTOP)? Field 3 of /proc/PID/stat is the state, T for stopped.
is_stopped() { [[ $(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) == T ]]; }

cmd_pause_osd() {
  local pid
  require_cluster
  pid=$(daemon_pid "osd.$OSD_ID") || die "osd.$OSD_ID is not running"
  if is_stopped "$pid"; then
    log "osd.$OSD_ID is already paused"
    return
  fi
  date +%s >"$RUN/osd.$OSD_ID.paused"
  kill -STOP "$pid"
  log "osd.$OSD_ID (pid $pid) paused; I/O to it blocks until resume-osd"
}

cmd_resume_osd() {
  local pid since paused
  require_cluster
  pid=$(daemon_pid "osd.$OSD_ID") || die "osd.$OSD_ID is not running"
  if ! is_stopped "$pid"; then
    log "osd.$OSD_ID is not paused"
    rm -f "$RUN/osd.$OSD_ID.paused"
    return
  fi
  since=$(cat "$RUN/osd.$OSD_ID.paused" 2>/dev/null || echo 0) # 0: paused by someone else
  paused=$(($(date +%s) - since))
  kill -CONT "$pid"
  rm -f "$RUN/osd.$OSD_ID.paused"
  if ((paused < HEARTBEAT_GRACE)); then
    log "osd.$OSD_ID (pid $pid) resumed after ${paused}s"
    return
  fi
  # Paused for longer than the heartbeat grace, a real cluster would have marked the OSD
  # down and it would rejoin on waking. Do that here too: it is also the one thing that
  # reliably revives PGs that an OSD of Ceph 16 left "laggy" (ops stuck "waiting for
  # readable" for good, seen once after a 170 s pause). Blocked client ops are resent.
  log "osd.$OSD_ID (pid $pid) resumed after ${paused}s; marking it down so that it re-peers"
  cephc osd down "$OSD_ID" >/dev/null 2>&1 || true
  wait_for "$TIMEOUT" osd_up || die "osd.$OSD_ID not back up after ${TIMEOUT}s; see $LOGS/osd.$OSD_ID.log"
  wait_healthy
  log "osd.$OSD_ID is serving again"
}

[[ $# == 2 ]] || usage
[[ -n $2 ]] || usage
# Absolute paths: they go into ceph.conf and are compared against daemon command lines.
DIR=$(realpath -m -- "$2")
# ceph.conf values are not quoted, and "mon cluster log file" is a space-separated list.
[[ $DIR != *[[:space:]]* ]] || die "DIR must not contain white space: '$DIR'"
CONF=$DIR/ceph.conf
LOGS=$DIR/log
RUN=$DIR/run
# Clients run by this script (ceph, rbd) use the cluster's config.
export CEPH_CONF=$CONF

case $1 in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  stop-osd) cmd_stop_osd ;;
  start-osd) cmd_start_osd ;;
  pause-osd) cmd_pause_osd ;;
  resume-osd) cmd_resume_osd ;;
  *) usage ;;
esac
