#!/usr/bin/env bash
# Runs the benchmarks of bench/ with -c opt, one after the other, and regenerates the summary
# table of docs/benchmarks.md from the RESULT lines they print.
#
#   tools/bench.sh [--only a,b,...] [--quick] [--out DIR] [--no-docs] [--page FILE] [--dry-run]
#   tools/bench.sh --from DIR [--page FILE] [--no-docs]
#
# The suite, in the order it runs: compute transport apply weighting recovery logging_overhead
# failures selective_logging convergence chaos python_overhead peer_torch replication_overhead
# failover sharding server_capacity backup_overhead (about 80 minutes on 2 cores, weighting 18 of them,
# convergence 13). soak (docs/design.md §9's "server memory over a long run"), detection and goodput
# (R21's crash detection and ETTR) and audit (R22) run only when --only names them. sharding needs root (network namespaces and tbf); without it its row says failed.
#
# Builds the selected benchmarks once (`bazel build --jobs=2 -c opt //bench:NAME ...`; the
# convergence study is //study/convergence, see package_of), then
# runs each alone from the repository root (the development machine has 2 cores: two at once
# would measure each other; a lock keeps a second tools/bench.sh on the machine from starting),
# under a timeout of twice its expected duration plus two minutes. Its whole output goes to
# DIR/NAME.log and what bench.sh knows of the run (command, date, machine, load average at the
# start, duration, exit code) to DIR/NAME.run. Each benchmark ends with
# `RESULT NAME: key=value ...`; from it (and from weighting's verdict lines) bench.sh writes one
# table row per benchmark: what it measures, the baseline and the result measured beside it, the
# ratio, the target of docs/design.md §9 and whether it was met, the exact command, the date and the
# machine. A benchmark that fails, times out or prints no RESULT line gets a row saying so, with
# its exit code and log, and no figure (chaos exits 1 and soak 3 when they ran and missed their
# target: those rows keep their figures).
#
# The table goes to DIR/summary.md (this run's rows) and, unless --no-docs, into
# docs/benchmarks.md between the lines `<!-- bench.sh: begin -->` and `<!-- bench.sh: end -->`;
# the rest of the page (the analysis, written by hand) stays as it is. Rows of benchmarks that
# did not run this time are kept from the page (each row has its own date), so --only replaces
# only its own rows.
#
#   --only LIST   the benchmarks to run, comma-separated (default: the suite above)
#   --quick       each benchmark with its shortest sensible flags (the suite in about 7
#                 minutes): a smoke test. Default: each benchmark's own defaults. Quick rows are
#                 marked, and the page then says its figures come from a quick run.
#   --out DIR     logs and results (default /tmp/rebound-bench/YYYYmmdd-HHMMSS)
#   --no-docs     leave the page alone (DIR/summary.md is still written)
#   --page FILE   the page to regenerate (default docs/benchmarks.md)
#   --dry-run     print the plan (commands, expected durations, timeouts) and stop
#   --from DIR    build and run nothing: regenerate the table from DIR's NAME.run and NAME.log
#                 files (every benchmark with a NAME.run there), onto the page, or on stdout
#                 with --no-docs
#
# Exit codes: 0 every benchmark ran and printed its RESULT line (target met or not); 1 one or
# more failed, timed out or printed no RESULT line (their rows say so; the page is still
# regenerated); 2 the build failed (nothing ran, the page is untouched); 3 the table cannot be
# written: the page lacks its two markers or cannot be written, or --from's DIR holds no run or
# a malformed one; 4 another tools/bench.sh is running on this machine; 64 usage.
set -euo pipefail

readonly kSuite=(compute transport apply weighting recovery logging_overhead failures
  selective_logging convergence chaos python_overhead peer_torch replication_overhead failover
  sharding server_capacity backup_overhead)
# Run only when --only names them (as soak): each takes many minutes of kills (audit: of runs).
readonly kOnDemand=(soak detection goodput audit)
readonly kKnown=("${kSuite[@]}" "${kOnDemand[@]}")
readonly kBegin='<!-- bench.sh: begin -->'
readonly kEnd='<!-- bench.sh: end -->'
readonly kTableHeader="| benchmark | what it measures | baseline | result | ratio | \
target (docs/design.md §9) | verdict | command | run |"
readonly kTableRule='|---|---|---|---|---|---|---|---|---|'
readonly kLock=/tmp/rebound-bench.lock

# What each benchmark measures (its header comment has the details).
declare -rA kWhat=(
  [compute]="worker step (fwd + bwd + HVP, tree, D, AdaHessian), CPU, one thread"
  [transport]="Sync round trip of a 16 MiB shard with its optimizer state, store on disk"
  [apply]="server ElasticSync and ApplyAdaHessian on a 16 MiB center"
  [weighting]="test accuracy with one faulty trainer, DYNAMIC reliability weights"
  [recovery]="REPLAY rebuild of one slot by k = 2 spares"
  [logging_overhead]="failure-free training throughput with the step log on"
  [failures]="time to 0.87 test accuracy with 3 trainers killed, REPLAY"
  [selective_logging]="log bytes and recovery time of plan-logging's choice, 4-stage MLP"
  [convergence]="test accuracy, DYNAMIC weights against UNIFORM and synchronous averaging (Xu & Carr's study, simulated time)"
  [chaos]="seeded runs under process, server and network faults"
  [soak]="server heap and data directory over a long run with trainers killed"
  [python_overhead]="the example CNN (Python client) trained through Rebound, tau 8, step log on, one thread"
  [peer_torch]="the shipped MLP with AdaHessian: rebound_train's engine against plain PyTorch (double backward), one thread each"
  [replication_overhead]="failure-free training throughput of the shipped job with a replicated server group (leader + 1 standby, sync, fsync false)"
  [failover]="SIGKILL of a group's leader to the first sync the new leader answers, shipped job, 4 trainers"
  [sharding]="sync throughput of a 64 MiB center, 4 synthetic trainers, K = 1, 2, 4 server groups each behind a tbf-limited link; the shipped job on loopback, K = 2"
  [server_capacity]="syncs/s one server group answers: synthetic trainers R = 1 to 64, centers of 1, 16 and 64 MiB, K = 1 and 2"
  [backup_overhead]="training throughput of the shipped model (2 trainers) while reboundctl backup --backup_max_mb_s 4 runs back to back, against none; an export's time and size"
  [detection]="SIGKILL of a trainer to the server's FAILED (crash detection), 20 kills; SIGSTOP to FAILED"
  [goodput]="ETTR (failure-free time to 0.87 / time with failures) at a mean time between failures of 20, 10 and 5 s: REPLAY, GLOBAL_CHECKPOINT, RESTART_FROM_CENTER, drop"
  [audit]="audit replay: a trainer flipping a bit every 50 steps, 1 spare; flips caught at 1, 5 and 20% of windows audited (the row: 5%); throughput with audits at 5% against off, the spare on a core of its own"
)
# The targets of docs/design.md §9 (selective_logging and chaos have none there).
declare -rA kTarget=(
  [compute]=">= 0.5x sgemm's FLOP rate"
  [transport]=">= 0.8x the echo's throughput"
  [apply]=">= 0.5x memcpy"
  [weighting]="never worse than UNIFORM; >= +0.5 pt for corrupted (b) and restarted (c)"
  [recovery]=">= 1.6x faster than k = 1"
  [logging_overhead]=">= 0.95x logging off"
  [failures]=">= 1.2x faster than GLOBAL_CHECKPOINT, <= 1.10x the failure-free time"
  [selective_logging]="none: a trade-off (docs/design.md §5.2)"
  [convergence]="DYNAMIC >= UNIFORM with a trainer killed; never > 0.5 pt worse otherwise (docs/convergence.md)"
  [chaos]="0 violations (docs/chaos.md; not in §9)"
  [soak]="flat: no growth with steps"
  [python_overhead]=">= 0.90x the plain PyTorch loop (R12; not in §9)"
  [peer_torch]=">= 2x PyTorch, expected (R12; not in §9)"
  [replication_overhead]=">= 0.85x a single server (R13; not in §9)"
  [failover]="<= lease + 1 s (R13; not in §9)"
  [sharding]="K = 2 >= 1.7x and K = 4 >= 3x K = 1; the shipped job K = 2 >= 0.9x K = 1 (R14; not in §9)"
  [server_capacity]=">= 0.7x the echo limit at R = 64, 16 MiB, K = 1 (R14; not in §9)"
  [backup_overhead]=">= 0.9x without backups (R17; not in §9)"
  [detection]="median <= 300 ms, max <= 1 s (R21; not in §9)"
  [goodput]="REPLAY >= 0.97 at 1 kill / 20 s, >= 0.9 at 1 / 5 s, above every other policy (R21; not in §9)"
  [audit]="0 false reports, flips caught in about the share of windows audited; throughput >= 0.97x audits off (R22; not in §9)"
)
# The ratio a benchmark's RESULT line must reach, for those whose target is one.
declare -rA kMinRatio=([compute]=0.5 [transport]=0.8 [apply]=0.5 [recovery]=1.6
  [logging_overhead]=0.95 [failures]=1.2 [python_overhead]=0.9 [peer_torch]=2
  [replication_overhead]=0.85 [server_capacity]=0.7 [backup_overhead]=0.9)
# Expected wall time in seconds on the 2-core development machine, with the defaults ...
declare -rA kFullSeconds=([compute]=10 [transport]=60 [apply]=10 [weighting]=1080 [recovery]=150
  [logging_overhead]=270 [failures]=300 [selective_logging]=20 [convergence]=780 [chaos]=180 [soak]=660
  [python_overhead]=240 [peer_torch]=90 [replication_overhead]=300 [failover]=240 [sharding]=450
  [server_capacity]=600 [backup_overhead]=75 [detection]=120 [goodput]=900 [audit]=600)
# ... and with --quick's flags, which are the shortest that still exercise every part.
declare -rA kQuickSeconds=([compute]=5 [transport]=20 [apply]=5 [weighting]=90 [recovery]=45
  [logging_overhead]=50 [failures]=150 [selective_logging]=5 [convergence]=30 [chaos]=75 [soak]=150
  [python_overhead]=40 [peer_torch]=20 [replication_overhead]=90 [failover]=60 [sharding]=150
  [server_capacity]=45 [backup_overhead]=20 [detection]=40 [goodput]=150 [audit]=150)
declare -rA kQuickFlags=(
  [compute]="--rounds=1 --steps=1"
  [transport]="--calls=2 --rounds=1 --warmup=1"
  [apply]="--calls=2 --rounds=3"
  [weighting]="--seconds=10 --seeds=1 --scenarios=b"
  [recovery]="--reps=1 --steps=20"
  [logging_overhead]="--reps=1 --seconds=5 --warmup_seconds=2"
  [failures]="--reps=1 --calibration_seconds=3 --max_seconds=60"
  [selective_logging]="--reps=3 --stage_steps=2"
  [convergence]="--quick"
  [chaos]="--runs=1 --faults=3 --steps=2000"
  [soak]="--minutes=2 --warmup_s=30 --kill_every_s=40 --sample_s=5"
  [python_overhead]="--reps=1 --seconds=5"
  [peer_torch]="--reps=1 --seconds=3"
  [replication_overhead]="--reps=1 --seconds=5 --warmup_seconds=2"
  [failover]="--kills=2 --steady_seconds=1"
  [sharding]="--rate_mbit=1000 --seconds=2 --window_syncs=2 --small_reps=1 --small_seconds=5 --small_warmup_seconds=2"
  [server_capacity]="--trainers=64 --centers=16 --groups=1 --seconds=3 --warmup_seconds=1"
  [backup_overhead]="--reps=1 --seconds=3"
  [detection]="--kills=3"
  [goodput]="--mtbf_s=5 --policies=replay,drop --max_seconds=60"
  [audit]="--fractions=0.05 --steps=1600 --horizon=600 --throughput_reps=1 --drift_horizons=50"
)

# The package a benchmark's binary is in: bench/, except the convergence study (study/).
package_of() {  # name
  case "$1" in
    convergence) echo study/convergence ;;
    *) echo bench ;;
  esac
}

die() {  # exit code, message
  local code=$1
  shift
  echo "bench.sh: $*" >&2
  exit "$code"
}

usage() {  # problem
  echo "bench.sh: $1" >&2
  echo "usage: tools/bench.sh [--only a,b,...] [--quick] [--out DIR] [--no-docs] [--page FILE]" \
    "[--dry-run] | --from DIR [--page FILE] [--no-docs]" >&2
  exit 64
}

is_known() {  # name
  local known
  for known in "${kKnown[@]}"; do
    [ "$known" = "$1" ] && return 0
  done
  return 1
}

duration() {  # seconds, possibly with a fraction -> "45 s", "0.4 s", "3 min" or "1 h 5 min"
  local s=${1%.*}
  if [ "$s" -lt 90 ]; then
    echo "$1 s"
  elif [ "$s" -lt 3600 ]; then
    echo "$(((s + 30) / 60)) min"
  else
    echo "$((s / 3600)) h $(((s % 3600 + 30) / 60)) min"
  fi
}

timeout_for() {  # expected seconds -> timeout seconds
  echo $((2 * $1 + 120))
}

readonly kRunKeys=(name mode command date load cores cpu seconds timeout_s rc timed_out log)

# The value of KEY in a key=value file (the first line that has it; empty when none has it).
field() {  # file, key
  awk -v key="$2" 'index($0, key "=") == 1 { print substr($0, length(key) + 2); exit }' "$1"
}

# Exits 3 unless $1 is a run file of tools/bench.sh, of a known benchmark.
check_run() {  # run file
  local key name
  [ -r "$1" ] || die 3 "cannot read the run file '$1'"
  for key in "${kRunKeys[@]}"; do
    grep -q "^$key=" "$1" || die 3 "$1: no '$key=' line: not a run file of tools/bench.sh"
  done
  name=$(field "$1" name)
  is_known "$name" || die 3 "$1: unknown benchmark '$name'"
  for key in rc timed_out timeout_s seconds; do
    [[ $(field "$1" "$key") =~ ^[0-9]+(\.[0-9]+)?$ ]] ||
      die 3 "$1: $key is not a number: '$(field "$1" "$key")'"
  done
}

# Prints the table row of one finished run, from its .run file (check_run has accepted it) and
# its log.
render_row() {  # run file
  local run=$1 name log
  name=$(field "$run" name)
  log=$(field "$run" log)
  local cell
  cell="$(field "$run" date); $(duration "$(field "$run" seconds)"); load $(field "$run" load); \
$(field "$run" cores) x $(field "$run" cpu)"
  if [ "$(field "$run" mode)" = quick ]; then cell="$cell; *quick*"; fi
  # The log beside the run file: the path recorded is where it was written, which may have moved.
  local input
  input=$(dirname "$run")/$name.log
  [ -r "$input" ] || input=/dev/null
  B_NAME=$name B_WHAT=${kWhat[$name]} B_TARGET=${kTarget[$name]} B_MIN=${kMinRatio[$name]:-} \
    B_RC=$(field "$run" rc) B_TIMED_OUT=$(field "$run" timed_out) \
    B_TIMEOUT=$(field "$run" timeout_s) B_LOG=$log B_COMMAND=$(field "$run" command) \
    B_RUN=$cell B_HAVE_LOG=$([ "$input" = /dev/null ] && echo 0 || echo 1) \
    awk '
function num(s) { return s ~ /^[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$/ }
function at_least(r, min) { return r == "inf" || (num(r) && r + 0 >= min + 0) }
function verdict_of(ok) { return ok ? "**met**" : "**missed**" }
function cell(s) { gsub(/\|/, "\\|", s); return s }
function row(baseline, result, ratio, verdict) {
  printf "| `%s` | %s | %s | %s | %s | %s | %s | `%s` | %s |\n", name, cell(what),
         cell(baseline), cell(result), cell(ratio), cell(target), cell(verdict), cell(command),
         cell(run)
}
function fail_row(what_happened) {
  row("—", "—", "—", what_happened " (exit " rc "; log `" logpath "`)")
}
# Every key the RESULT line must have; a failure row naming the first missing one otherwise.
function need(keys,    k, n, i) {
  n = split(keys, k, " ")
  for (i = 1; i <= n; i++) {
    if (!(k[i] in v)) {
      fail_row("**failed**: RESULT line without `" k[i] "`")
      return 0
    }
  }
  return 1
}
BEGIN {
  name = ENVIRON["B_NAME"]; what = ENVIRON["B_WHAT"]; target = ENVIRON["B_TARGET"]
  min = ENVIRON["B_MIN"]; rc = ENVIRON["B_RC"] + 0; timed_out = ENVIRON["B_TIMED_OUT"] + 0
  timeout_s = ENVIRON["B_TIMEOUT"]; logpath = ENVIRON["B_LOG"]; command = ENVIRON["B_COMMAND"]
  run = ENVIRON["B_RUN"]; have_log = ENVIRON["B_HAVE_LOG"] + 0
  prefix = "RESULT " name ":"
}
index($0, prefix) == 1 { result = substr($0, length(prefix) + 1); have_result = 1 }
# weighting: "verdict against docs/design.md §9 (...):" then one indented line per scenario.
/^verdict against docs\/design\.md/ { in_verdicts = 1; n_verdicts = 0; next }
in_verdicts && /^  [^ ]/ { verdict_line[++n_verdicts] = $0; next }
{ in_verdicts = 0 }
END {
  if (timed_out) { fail_row("**timed out** after " timeout_s " s"); exit }
  if (!have_log) { fail_row("**failed**: no log"); exit }
  if (!have_result) {
    fail_row(rc == 0 ? "**failed**: no RESULT line" : "**failed**")
    exit
  }
  n = split(result, token, " ")
  for (i = 1; i <= n; i++) {
    p = index(token[i], "=")
    if (p > 1) v[substr(token[i], 1, p - 1)] = substr(token[i], p + 1)
  }
  # A run that failed gives no figure, except where the exit code is the verdict.
  if (!(rc == 0 || (name == "chaos" && rc == 1 && v["violations"] + 0 > 0) ||
        (name == "soak" && rc == 3))) {
    fail_row("**failed**")
    exit
  }
  if (name == "compute") {
    if (!need("step_gflops sgemm_gflops ratio")) exit
    row("OpenBLAS sgemm on the same GEMM shapes: " v["sgemm_gflops"] " GFLOP/s",
        "step: " v["step_gflops"] " GFLOP/s", v["ratio"], verdict_of(at_least(v["ratio"], min)))
  } else if (name == "transport") {
    if (!need("sync_mib_s echo_mib_s ratio")) exit
    row("bare gRPC echo of the same bytes: " v["echo_mib_s"] " MiB/s",
        "Sync: " v["sync_mib_s"] " MiB/s", v["ratio"], verdict_of(at_least(v["ratio"], min)))
  } else if (name == "apply") {
    if (!need("elastic_gb_s adahessian_gb_s memcpy_gb_s ratio")) exit
    row("memcpy of the same bytes: " v["memcpy_gb_s"] " GB/s",
        "ElasticSync " v["elastic_gb_s"] " GB/s, ApplyAdaHessian " v["adahessian_gb_s"] " GB/s",
        v["ratio"] " (the slower)", verdict_of(at_least(v["ratio"], min)))
  } else if (name == "weighting") {
    if (!need("scenario_b_dynamic scenario_b_uniform ratio")) exit
    # The verdict lines: "b corrupted labels  D-U +1.22 pts (spread ...): never worse MET; ...".
    diffs = ""; missed = 0; judged = 0
    for (i = 1; i <= n_verdicts; i++) {
      line = verdict_line[i]
      if (line !~ /(MET|MISSED)/) continue
      judged++
      if (line ~ /MISSED/) missed++
      split(line, word, " ")
      d = line; sub(/^.*D-U /, "", d); sub(/ .*$/, "", d)
      diffs = diffs (diffs == "" ? "" : ", ") word[1] " " d
    }
    if (judged == 0) verdict = "n/a: no scenario with a target ran"
    else verdict = verdict_of(missed == 0) " (DYNAMIC - UNIFORM: " diffs " pt)"
    row("UNIFORM weights: test accuracy " v["scenario_b_uniform"] " in (b)",
        "DYNAMIC: " v["scenario_b_dynamic"] " in (b)", v["ratio"], verdict)
  } else if (name == "recovery") {
    if (!need("k1_ms ratio")) exit
    k = ""
    for (key in v) if (key ~ /^k[0-9]+_ms$/ && key != "k1_ms") k = key
    if (k == "") { fail_row("**failed**: RESULT line without `kK_ms`"); exit }
    spares = substr(k, 2, length(k) - 4)
    row("k = 1 spare: rebuild " v["k1_ms"] " ms", "k = " spares " spares: " v[k] " ms",
        v["ratio"], verdict_of(at_least(v["ratio"], min)))
  } else if (name == "logging_overhead") {
    if (!need("on_samples_s off_samples_s ratio")) exit
    row("step log off: " v["off_samples_s"] " samples/s", "on: " v["on_samples_s"] " samples/s",
        v["ratio"], verdict_of(at_least(v["ratio"], min)))
  } else if (name == "failures") {
    if (!need("replay_s global_checkpoint_s failure_free_s replay_vs_free ratio")) exit
    row("GLOBAL_CHECKPOINT at CheckFreq'"'"'s interval: " v["global_checkpoint_s"] " s",
        "REPLAY: " v["replay_s"] " s (failure-free " v["failure_free_s"] " s, x" \
          v["replay_vs_free"] ")",
        v["ratio"], verdict_of(at_least(v["ratio"], min) && num(v["replay_vs_free"]) &&
                                      v["replay_vs_free"] + 0 <= 1.10))
  } else if (name == "selective_logging") {
    if (!need("all_logged_bytes_per_step all_logged_recovery_ms none_logged_recovery_ms plan " \
              "plan_bytes_ratio plan_recovery_ratio")) exit
    row("all boundaries logged: " v["all_logged_bytes_per_step"] " bytes/step, mean recovery " \
          v["all_logged_recovery_ms"] " ms (none logged: " v["none_logged_recovery_ms"] " ms)",
        "plan " v["plan"] ": bytes x" v["plan_bytes_ratio"] ", recovery x" \
          v["plan_recovery_ratio"],
        "bytes " v["plan_bytes_ratio"] ", recovery " v["plan_recovery_ratio"], "n/a")
  } else if (name == "convergence") {
    if (!need("kill_d_minus_u_pts straggler_d_minus_u_pts none_d_minus_u_pts " \
              "sync_minus_uniform_pts runs minutes")) exit
    row("UNIFORM weights (plain EASGD), same runs",
        "DYNAMIC - UNIFORM: kill " v["kill_d_minus_u_pts"] " pt, straggler " \
          v["straggler_d_minus_u_pts"] " pt, none " v["none_d_minus_u_pts"] " pt; SYNC - " \
          "UNIFORM " v["sync_minus_uniform_pts"] " pt (" v["runs"] " runs, " v["minutes"] " min)",
        "—", verdict_of(v["kill_d_minus_u_pts"] + 0 >= 0 && \
                        v["straggler_d_minus_u_pts"] + 0 >= -0.5 && \
                        v["none_d_minus_u_pts"] + 0 >= -0.5))
  } else if (name == "chaos") {
    if (!need("runs faults recoveries violations")) exit
    row("a fault-free run of the same job, per seed",
        v["runs"] " runs: " v["faults"] " faults, " v["recoveries"] " recoveries, " \
          v["violations"] " violations", "—", verdict_of(rc == 0 && v["violations"] == "0"))
  } else if (name == "soak") {
    if (!need("minutes kills heap_mib heap_slope_mib_per_min rss_mib rss_slope_mib_per_min " \
              "store_mib store_slope_mib_per_min flat")) exit
    row("its own mean: flat is under 10% (or 8 MiB) per hour",
        v["minutes"] " min, " v["kills"] " kills: heap " v["heap_mib"] " MiB (" \
          v["heap_slope_mib_per_min"] " MiB/min), data directory " v["store_mib"] " MiB (" \
          v["store_slope_mib_per_min"] " MiB/min), RSS " v["rss_mib"] " MiB (" \
          v["rss_slope_mib_per_min"] " MiB/min)",
        "—", verdict_of(v["flat"] == "yes"))
  } else if (name == "python_overhead") {
    if (!need("rebound_samples_s plain_samples_s ratio")) exit
    row("plain PyTorch loop: " v["plain_samples_s"] " samples/s",
        "through Rebound: " v["rebound_samples_s"] " samples/s", v["ratio"],
        verdict_of(at_least(v["ratio"], min)))
  } else if (name == "replication_overhead") {
    if (!need("replicated_samples_s single_samples_s ratio")) exit
    row("single server: " v["single_samples_s"] " samples/s",
        "leader + 1 standby: " v["replicated_samples_s"] " samples/s", v["ratio"],
        verdict_of(at_least(v["ratio"], min)))
  } else if (name == "failover") {
    if (!need("kills median_ms max_ms lease_ms")) exit
    row("the leader lease: " v["lease_ms"] " ms",
        v["kills"] " kills: median " v["median_ms"] " ms, max " v["max_ms"] " ms",
        "—", verdict_of(num(v["max_ms"]) && v["max_ms"] + 0 <= v["lease_ms"] + 1000))
  } else if (name == "sharding") {
    if (!need("k1_mib_s k2_mib_s k4_mib_s k2_ratio k4_ratio small_job_ratio")) exit
    row("K = 1: " v["k1_mib_s"] " MiB/s",
        "K = 2: " v["k2_mib_s"] " MiB/s, K = 4: " v["k4_mib_s"] " MiB/s; small job K = 2 / K = 1: " \
          v["small_job_ratio"],
        "K = 2 " v["k2_ratio"] ", K = 4 " v["k4_ratio"] ", small " v["small_job_ratio"],
        verdict_of(at_least(v["k2_ratio"], 1.7) && at_least(v["k4_ratio"], 3) && \
                   at_least(v["small_job_ratio"], 0.9)))
  } else if (name == "server_capacity") {
    if (!need("r64_16mib_syncs_s echo_limit_syncs_s ratio")) exit
    row("bare gRPC echo of the same bytes, 64 clients: " v["echo_limit_syncs_s"] " calls/s",
        "R = 64, 16 MiB, K = 1: " v["r64_16mib_syncs_s"] " syncs/s", v["ratio"],
        verdict_of(at_least(v["ratio"], min)))
  } else if (name == "detection") {
    if (!need("kills median_ms max_ms sigstop_ms failure_timeout_ms")) exit
    row("the heartbeat timeout: failure_timeout " v["failure_timeout_ms"] " ms (SIGSTOP: " \
          v["sigstop_ms"] " ms)",
        v["kills"] " kills: median " v["median_ms"] " ms, max " v["max_ms"] " ms", "—",
        verdict_of(num(v["max_ms"]) && v["median_ms"] + 0 <= 300 && v["max_ms"] + 0 <= 1000))
  } else if (name == "goodput") {
    if (!need("mtbf_s ettr_replay ettr_checkpoint ettr_restart ettr_drop")) exit
    row("at 1 kill / " v["mtbf_s"] " s: GLOBAL_CHECKPOINT " v["ettr_checkpoint"] \
          ", RESTART_FROM_CENTER " v["ettr_restart"] ", drop " v["ettr_drop"],
        "REPLAY: ETTR " v["ettr_replay"], "—",
        verdict_of(num(v["ettr_replay"]) && v["ettr_replay"] + 0 >= 0.9))
  } else if (name == "audit") {
    if (!need("fraction injected detected median_detect_steps p_detect_1000 false_reports throughput_ratio")) exit
    row("audits off (the cost baseline: ratio 1)",
        "at fraction " v["fraction"] ": " v["detected"] " of " v["injected"] " flips caught, median " \
          v["median_detect_steps"] " steps after; " v["p_detect_1000"] " of flips followed by a " \
          "catch within 1000 steps; " v["false_reports"] " false reports",
        v["throughput_ratio"],
        verdict_of(num(v["false_reports"]) && v["false_reports"] + 0 == 0 && \
                   at_least(v["throughput_ratio"], 0.97)))
  } else if (name == "peer_torch") {
    if (!need("rebound_samples_s torch_samples_s ratio")) exit
    row("plain PyTorch: " v["torch_samples_s"] " samples/s",
        "rebound_train: " v["rebound_samples_s"] " samples/s", v["ratio"],
        verdict_of(at_least(v["ratio"], min)))
  }
}' "$input"
}

# The generated part of the page, markers included. Rows: this run's (the run files given), then
# for every other benchmark the page's row if it has one (from an earlier run or written by
# hand), else, for the suite's, a row saying it has not run.
compose() {  # summary text, old section file (or ""), run files...
  local summary=$1 old=$2
  shift 2
  local -A rows=()
  local run name
  for run in "$@"; do
    check_run "$run"
    name=$(field "$run" name)
    rows[$name]=$(render_row "$run")
  done
  local all=()
  for name in "${kKnown[@]}"; do
    if [ -n "${rows[$name]:-}" ]; then
      all+=("${rows[$name]}")
    elif [ -n "$old" ] && grep -q "^| \`$name\` |" "$old"; then
      all+=("$(grep "^| \`$name\` |" "$old" | head -n 1)")
    elif [ -n "$old" ] && [[ ! " ${kOnDemand[*]} " == *" $name "* ]]; then
      all+=("| \`$name\` | ${kWhat[$name]} | — | — | — | ${kTarget[$name]} |\
 not run by tools/bench.sh yet | — | — |")
    fi
  done
  echo "$kBegin"
  echo "<!-- Generated by tools/bench.sh: edits between these two markers are overwritten. -->"
  if [ -n "$old" ]; then
    echo "$summary Rows of benchmarks that did not run then are kept from before, each with its" \
      "own date."
  else
    echo "$summary"
  fi
  if printf '%s\n' "${all[@]}" | grep -q '; \*quick\* |$'; then
    echo
    echo "**Quick run.** Rows marked *quick* come from \`tools/bench.sh --quick\`: each benchmark" \
      "with its shortest flags, to check that the suite runs. Their figures are not" \
      "measurements: run \`tools/bench.sh --only NAME\` before quoting one."
  fi
  echo
  echo "$kTableHeader"
  echo "$kTableRule"
  printf '%s\n' "${all[@]}"
  echo "$kEnd"
}

# Checks that the page has its two markers, once each, in order; writes what lies between them
# to $1.
old_section() {  # output file, page
  local out=$1 page=$2
  [ -r "$page" ] || die 3 "cannot read the page '$page'"
  awk -v begin="$kBegin" -v end="$kEnd" -v page="$page" '
    $0 == begin { n_begin++; if (n_begin == 1) begin_line = NR; inside = 1; next }
    $0 == end { n_end++; if (n_end == 1) end_line = NR; inside = 0; next }
    inside { print }
    END {
      if (n_begin != 1 || n_end != 1 || end_line < begin_line) {
        printf "bench.sh: %s must hold the line \"%s\" once and, after it, the line \"%s\" " \
               "once (found %d and %d)\n", page, begin, end, n_begin, n_end > "/dev/stderr"
        exit 1
      }
    }' "$page" >"$out" || exit 3
}

# Replaces the page's generated part with the section in $2.
write_page() {  # page, section file
  local page=$1 section=$2 tmp
  tmp=$(mktemp "$page.XXXXXX") || die 3 "cannot write beside the page '$page'"
  chmod --reference="$page" "$tmp"
  if ! awk -v begin="$kBegin" -v end="$kEnd" -v section="$section" '
      $0 == begin { while ((getline line < section) > 0) print line; skip = 1; next }
      $0 == end { skip = 0; next }
      !skip { print }' "$page" >"$tmp" || ! mv "$tmp" "$page"; then
    rm -f "$tmp"
    die 3 "cannot write the page '$page'"
  fi
}

# ---- command line -------------------------------------------------------------------------------
only="" quick=0 out="" docs=1 dry_run=0 from="" page=""
invocation="tools/bench.sh${*:+ $*}"
while [ $# -gt 0 ]; do
  case $1 in
    --only | --out | --from | --page)
      [ $# -ge 2 ] || usage "$1 needs a value"
      case $1 in
        --only) only=$2 ;;
        --out) out=$2 ;;
        --from) from=$2 ;;
        --page) page=$2 ;;
      esac
      shift 2
      ;;
    --only=*) only=${1#*=}; shift ;;
    --out=*) out=${1#*=}; shift ;;
    --from=*) from=${1#*=}; shift ;;
    --page=*) page=${1#*=}; shift ;;
    --quick) quick=1; shift ;;
    --no-docs) docs=0; shift ;;
    --dry-run) dry_run=1; shift ;;
    *) usage "unknown argument '$1'" ;;
  esac
done
if [ -n "$from" ] && { [ -n "$only" ] || [ "$quick" = 1 ] || [ -n "$out" ] ||
  [ "$dry_run" = 1 ]; }; then
  usage "--from regenerates the table from an earlier run: it takes only --page and --no-docs"
fi
selected=()
if [ -n "$only" ]; then
  IFS=, read -r -a names <<<"$only"
  for name in "${names[@]}"; do
    is_known "$name" || usage "--only: unknown benchmark '$name' (known: ${kKnown[*]})"
    for other in "${selected[@]}"; do
      [ "$other" != "$name" ] || usage "--only: '$name' named twice"
    done
    selected+=("$name")
  done
  [ ${#selected[@]} -gt 0 ] || usage "--only: the list is empty"
else
  selected=("${kSuite[@]}")
fi
# Paths on the command line are the caller's; everything else is relative to the repository.
[ -z "$out" ] || out=$(realpath -m -- "$out")
[ -z "$from" ] || from=$(realpath -m -- "$from")
[ -z "$page" ] || page=$(realpath -m -- "$page")
cd "$(dirname "$0")/.."
page=${page:-$PWD/docs/benchmarks.md}

# ---- --from: regenerate only -------------------------------------------------------------------
if [ -n "$from" ]; then
  [ -d "$from" ] || die 3 "--from: no directory '$from'"
  runs=()
  for name in "${kKnown[@]}"; do
    if [ -f "$from/$name.run" ]; then runs+=("$from/$name.run"); fi
  done
  [ ${#runs[@]} -gt 0 ] || die 3 "--from: '$from' holds no NAME.run file of tools/bench.sh"
  [ -f "$from/suite.run" ] || die 3 "--from: '$from' has no suite.run"
  summary=$(field "$from/suite.run" summary)
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
  if [ "$docs" = 1 ]; then
    old_section "$scratch/old" "$page"
    compose "$summary" "$scratch/old" "${runs[@]}" >"$scratch/section"
    write_page "$page" "$scratch/section"
    echo "bench.sh: regenerated the table of $page from $from"
  else
    compose "$summary" "" "${runs[@]}"
  fi
  exit 0
fi

# ---- the plan ---------------------------------------------------------------------------------
mode=full
[ "$quick" = 0 ] || mode=quick
out=${out:-/tmp/rebound-bench/$(date '+%Y%m%d-%H%M%S')}
targets=()
total=0
for name in "${selected[@]}"; do
  targets+=("//$(package_of "$name"):$name")
  if [ "$quick" = 1 ]; then
    total=$((total + kQuickSeconds[$name]))
  else
    total=$((total + kFullSeconds[$name]))
  fi
done
build=(bazel build --jobs=2 -c opt "${targets[@]}")
cores=$(nproc)
cpu=$(awk -F': *' '/^model name/ { print $2; exit }' /proc/cpuinfo 2>/dev/null || true)
cpu=${cpu:-unknown CPU}

echo "bench.sh: ${#selected[@]} benchmark(s), $mode settings, one at a time on $cores x $cpu:" \
  "expected about $(duration "$total") after the build; logs in $out"
for name in "${selected[@]}"; do
  expected=${kFullSeconds[$name]}
  [ "$quick" = 0 ] || expected=${kQuickSeconds[$name]}
  flags=""
  [ "$quick" = 0 ] || flags=" ${kQuickFlags[$name]}"
  printf '  %-18s ~%-7s timeout %-7s %s/%s%s\n' "$name" "$(duration "$expected")" \
    "$(duration "$(timeout_for "$expected")")" "$(package_of "$name")" "$name" "$flags"
done
if [ "$dry_run" = 1 ]; then
  echo "bench.sh: dry run: would build with '${build[*]}'"
  exit 0
fi

# ---- build and run ------------------------------------------------------------------------------
# Refuse a page without its markers now rather than after the runs.
if [ "$docs" = 1 ]; then
  scratch=$(mktemp)
  old_section "$scratch" "$page"
  rm -f "$scratch"
fi
command -v bazel >/dev/null 2>&1 || die 2 "bazel is not installed: run tools/setup.sh"
command -v timeout >/dev/null 2>&1 || die 2 "timeout (coreutils) is not installed"
exec 9>"$kLock"
flock -n 9 || die 4 "another tools/bench.sh holds $kLock: benchmarks must not run two at once"
mkdir -p "$out" || die 3 "cannot create '$out'"

echo "bench.sh: ${build[*]}"
rc=0
"${build[@]}" 2>&1 | tee "$out/build.log" || rc=$?
[ "$rc" = 0 ] || die 2 "the build failed (exit $rc): see above or $out/build.log; nothing ran"
bin_abs=$(bazel info -c opt bazel-bin 2>/dev/null) || die 2 "'bazel info -c opt bazel-bin' failed"
# The same directory through the workspace's bazel-out link reads better in the commands.
bin="bazel-out/${bin_abs#*/bazel-out/}"
[ "$bin" -ef "$bin_abs" ] || bin=$bin_abs

started=$(date -u '+%Y-%m-%d %H:%M UTC')
summary="Generated by \`$invocation\` on $started: built with \`${build[*]}\`, then each \
benchmark run alone from the repository root under a timeout (log paths are on the machine that \
ran them)."
printf 'summary=%s\n' "$summary" >"$out/suite.run"

i=0
runs=()
for name in "${selected[@]}"; do
  i=$((i + 1))
  if [ "$quick" = 1 ]; then
    expected=${kQuickSeconds[$name]}
    read -r -a args <<<"${kQuickFlags[$name]}"
  else
    expected=${kFullSeconds[$name]}
    args=()
  fi
  limit=$(timeout_for "$expected")
  binary="$bin/$(package_of "$name")/$name"
  command="$binary${args[*]:+ ${args[*]}}"
  log=$out/$name.log
  rm -f "$out/$name.run" "$log"
  date=$(date -u '+%Y-%m-%d %H:%M UTC')
  load=$(cut -d ' ' -f 1 /proc/loadavg)
  echo "[$i/${#selected[@]}] $name: $command (load $load; expected ~$(duration "$expected")," \
    "timeout $(duration "$limit"); log $log)"
  start=$EPOCHREALTIME
  rc=0
  timeout --kill-after=30 "$limit" "$binary" "${args[@]}" >"$log" 2>&1 </dev/null ||
    rc=$?
  seconds=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  timed_out=0
  # timeout exits 124 after its SIGTERM, 137 when it had to follow with SIGKILL.
  if [ "$rc" = 124 ] || { [ "$rc" = 137 ] && [ "${seconds%.*}" -ge "$limit" ]; }; then
    timed_out=1
  fi
  {
    echo "name=$name"
    echo "mode=$mode"
    echo "command=$command"
    echo "date=$date"
    echo "load=$load"
    echo "cores=$cores"
    echo "cpu=$cpu"
    echo "seconds=$seconds"
    echo "timeout_s=$limit"
    echo "rc=$rc"
    echo "timed_out=$timed_out"
    echo "log=$log"
  } >"$out/$name.run"
  runs+=("$out/$name.run")
  result=$(grep "^RESULT $name:" "$log" | tail -n 1 || true)
  if [ "$timed_out" = 1 ]; then
    echo "  TIMED OUT after $(duration "$seconds") (exit $rc)"
  else
    echo "  exit $rc after $(duration "$seconds"): ${result:-no RESULT line}"
  fi
done

# ---- the table ----------------------------------------------------------------------------------
compose "$summary" "" "${runs[@]}" >"$out/summary.md"
echo "bench.sh: this run's table: $out/summary.md"
if [ "$docs" = 1 ]; then
  old_section "$out/page_before.md" "$page"
  compose "$summary" "$out/page_before.md" "${runs[@]}" >"$out/section.md"
  write_page "$page" "$out/section.md"
  echo "bench.sh: regenerated the table of $page"
fi
awk -F ' [|] ' '/^[|] `/ { sub(/^[|] /, ""); printf "  %-20s ratio %-12s %s\n", $1, $5, $7 }' \
  "$out/summary.md"
failed=$(grep -c '| \*\*\(failed\|timed out\)\*\*' "$out/summary.md" || true)
if [ "$failed" -ne 0 ]; then
  echo "bench.sh: $failed benchmark(s) failed, timed out or printed no RESULT line: see their rows"
  exit 1
fi
echo "bench.sh: every benchmark ran ($(duration "$SECONDS") in all)"
