#!/usr/bin/env bash
# Plots a job's progress CSV (rebound_launch --progress_csv) as a PNG: test accuracy over time in
# the upper panel, the reliability weight of every slot in the lower one, and the failures and
# recoveries the CSV's event rows record as labelled vertical lines across both panels:
#   red dashed     a trainer killed by the launcher ("killed ...")
#   orange dashed  a worker declared FAILED by the server ("worker ...: ALIVE -> FAILED ...")
#   green solid    a slot RECOVERED ("recovery N of slot (r,s): RECOVERED ...")
#   purple solid   a recovery that ended otherwise (CHECKSUM_MISMATCH, SPARE_FAILED, ABANDONED)
#   black dotted   an audit caught a trainer computing wrong (AUDIT_MISMATCH, confirmed by a second
#                  replay), or a worker QUARANTINED for it (docs/recovery.md#audits)
# and, shaded, each slot's time out of service, from its first kill or failure to its recovery.
#
#   tools/plot_progress.sh PROGRESS_CSV OUTPUT_PNG
#
# Any number of slots; rows without a test accuracy (before the first evaluation) or without a
# weight are skipped. Prints one summary line. Exit 0 with the PNG written, 1 when the CSV is
# missing or malformed (the message names file, line and column) or gnuplot fails, 64 on usage.
# Needs gnuplot (Debian's gnuplot-nox, installed by tools/setup.sh).
set -euo pipefail

readonly kHeader="elapsed_s,slot,step,loss,weight,test_accuracy,event"
readonly kWidth=1200 kHeight=900

die() {
  echo "plot_progress: $*" >&2
  exit 1
}

if [ $# -ne 2 ]; then
  echo "usage: tools/plot_progress.sh PROGRESS_CSV OUTPUT_PNG" >&2
  exit 64
fi
csv=$1
png=$2

command -v gnuplot >/dev/null 2>&1 ||
  die "gnuplot is not installed: run tools/setup.sh (it installs Debian's gnuplot-nox)"
case $png in
  *\'* | *$'\n'*) die "the output path must not contain a quote or a line break: $png" ;;
esac
if [ ! -f "$csv" ] || [ ! -r "$csv" ]; then die "cannot read the progress CSV '$csv'"; fi
[ -s "$csv" ] || die "$csv is empty: expected the header '$kHeader'"
header=$(head -n 1 "$csv" | tr -d '\r')
[ "$header" = "$kHeader" ] ||
  die "$csv:1: not a progress CSV: expected the header '$kHeader', got '$header'"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# One pass over the CSV. Writes, in $tmp:
#   accuracy.dat  "elapsed accuracy_percent", one line per distinct time
#   weights.dat   "elapsed weight" per slot, one gnuplot index (block) per slot
#   marks.gp      gnuplot commands: shaded outages, event lines, key entries for them
#   labels.gp     gnuplot commands: the event labels above the upper panel
#   facts.sh      shell assignments: slots, counts, ranges, title line, summary
awk -v csv="$csv" -v dir="$tmp" -v header="$kHeader" '
function fail(msg) {
  printf "plot_progress: %s:%d: %s\n", csv, start, msg > "/dev/stderr"
  failed = 1
  exit 1
}
function is_number(s) {
  return s ~ /^[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$/
}
# Text safe inside a double-quoted gnuplot string and a double-quoted shell string.
function clean(s) {
  gsub(/[^A-Za-z0-9_.,:;()\/+%= -]/, "_", s)
  return s
}
function seconds(t) { return sprintf("%.1f s", t) }
function add_event(t, kind, label) {
  n_events++
  ev_t[n_events] = t; ev_kind[n_events] = kind; ev_label[n_events] = clean(label)
  seen_kind[kind] = 1
}
BEGIN { line_no = 0; record = ""; n_slots = 0; n_acc = 0; n_events = 0; n_out = 0; wmax = 0 }
{
  line_no++
  sub(/\r$/, "")
  if (line_no == 1) next
  # A quoted event may span lines: join until the quotes balance.
  if (record == "") { start = line_no; record = $0 } else record = record "\n" $0
  if (gsub(/"/, "\"", record) % 2 == 1) next
  row = record; record = ""
  if (row == "") next

  for (i = 1; i <= 6; i++) {
    p = index(row, ",")
    if (p == 0) fail("expected 7 columns (" header "), got " i)
    f[i] = substr(row, 1, p - 1)
    row = substr(row, p + 1)
  }
  event = row
  if (event ~ /^"/) {
    if (event !~ /"$/ || length(event) < 2) fail("unterminated quoted event: " event)
    event = substr(event, 2, length(event) - 2)
    gsub(/""/, "\"", event)
  }
  t = f[1]; slot = f[2]; weight = f[5]; acc = f[6]
  if (!is_number(t)) fail("elapsed_s is not a number: \047" t "\047")
  if (slot != "" && slot !~ /^r[0-9]+s[0-9]+$/) fail("slot is not rRsS: \047" slot "\047")
  if (weight != "" && !is_number(weight)) fail("weight is not a number: \047" weight "\047")
  if (acc != "" && !is_number(acc)) fail("test_accuracy is not a number: \047" acc "\047")
  t += 0
  if (n_rows == 0 || t > tmax) tmax = t
  n_rows++

  if (acc != "" && (n_acc == 0 || t != acc_last_t)) {
    n_acc++; acc_last_t = t; acc_last = acc * 100
    print t, acc * 100 > (dir "/accuracy.dat")
  }
  if (slot != "" && weight != "") {
    if (!(slot in slot_index)) { n_slots++; slot_index[slot] = n_slots; slot_name[n_slots] = slot }
    k = slot_index[slot]
    wdata[k] = wdata[k] t " " weight "\n"
    n_weights++
    if (weight + 0 > wmax) wmax = weight + 0
  }

  if (event == "") next
  split(event, word, " ")
  who = (slot != "") ? "slot " slot : "the job"
  if (event ~ /^killed /) {
    add_event(t, "kill", word[2] " killed")
    if (slot != "" && !(slot in down_since)) down_since[slot] = t
  } else if (event ~ /^worker / && event ~ /: [A-Z_]+ -> FAILED/) {
    add_event(t, "failed", word[2] " FAILED")
    if (slot != "" && !(slot in down_since)) down_since[slot] = t
  } else if (event ~ /^AUDIT_MISMATCH of slot /) {
    add_event(t, "audit", who " AUDIT_MISMATCH")
  } else if (event ~ /^worker / && event ~ /: [A-Z_]+ -> QUARANTINED/) {
    add_event(t, "audit", word[2] " QUARANTINED")
    if (slot != "" && !(slot in down_since)) down_since[slot] = t
  } else if (event ~ /^recovery [0-9]+ of slot .*: RECOVERED/) {
    add_event(t, "recovered", who " RECOVERED")
  } else if (event ~ /^recovery [0-9]+ of slot .*: (CHECKSUM_MISMATCH|SPARE_FAILED|ABANDONED)/) {
    outcome = event; sub(/^[^:]*: /, "", outcome); sub(/,.*$/, "", outcome)
    add_event(t, "unrecovered", who " recovery " outcome)
  } else {
    next
  }
  if (ev_kind[n_events] == "recovered" && slot in down_since) {
    n_out++; out_from[n_out] = down_since[slot]; out_to[n_out] = t; delete down_since[slot]
  }
}
END {
  if (failed) exit 1
  if (record != "") { fail("unterminated quoted event at the end of the file") }
  if (n_rows == 0) { start = 1; fail("no rows after the header: nothing to plot") }
  if (n_weights == 0) { start = 1; fail("no row has a slot and a weight: nothing to plot") }
  for (slot in down_since) { n_out++; out_from[n_out] = down_since[slot]; out_to[n_out] = tmax }

  for (k = 1; k <= n_slots; k++) {
    printf "%s\n\n", wdata[k] > (dir "/weights.dat")
    slots = slots (k > 1 ? " " : "") slot_name[k]
  }
  printf "" > (dir "/accuracy.dat")

  color["kill"] = "#d62728"; dash["kill"] = 2; what["kill"] = "trainer killed"
  color["failed"] = "#ff7f0e"; dash["failed"] = 4; what["failed"] = "declared FAILED"
  color["recovered"] = "#2ca02c"; dash["recovered"] = 1; what["recovered"] = "slot RECOVERED"
  color["unrecovered"] = "#9467bd"; dash["unrecovered"] = 1
  what["unrecovered"] = "recovery not completed"
  color["audit"] = "#000000"; dash["audit"] = 3; what["audit"] = "audit: corruption caught"
  marks = dir "/marks.gp"; labels = dir "/labels.gp"
  printf "" > marks; printf "" > labels
  for (i = 1; i <= n_out; i++) {
    printf "set object %d rect from first %g, graph 0 to first %g, graph 1 behind " \
           "fillcolor rgb \"#fbe3e3\" fillstyle solid 1.0 noborder\n",
           i, out_from[i], (out_to[i] > out_from[i] ? out_to[i] : out_from[i] + 0.2) > marks
  }
  # Recoveries first, so that a failure at the same time draws its dashes over them.
  span = (tmax > 0) ? tmax : 1
  n_drawn = 0
  split("recovered unrecovered kill failed audit", order, " ")
  for (o = 1; o <= 5; o++) {
    for (i = 1; i <= n_events; i++) {
      kind = ev_kind[i]
      if (kind != order[o]) continue
      n_drawn++
      printf "set arrow %d from first %g, graph 0 to first %g, graph 1 nohead front " \
             "linecolor rgb \"%s\" linewidth 2 dashtype %d\n",
             n_drawn, ev_t[i], ev_t[i], color[kind], dash[kind] > marks
    }
  }
  for (i = 1; i <= n_events; i++) {
    kind = ev_kind[i]
    level = (i - 1) % 3
    side = (ev_t[i] > 0.6 * span) ? "right offset -0.6,0" : "left offset 0.6,0"
    printf "set label %d \"%s at %s\" at first %g, screen %.3f %s textcolor rgb \"%s\" front\n",
           i, ev_label[i], seconds(ev_t[i]), ev_t[i], 0.855 + 0.026 * level, side,
           color[kind] > labels
    summary = summary (i > 1 ? "; " : "") ev_label[i] " at " seconds(ev_t[i])
  }
  keys = ""
  split("kill failed recovered unrecovered audit", order, " ")
  for (o = 1; o <= 5; o++) {
    kind = order[o]
    if (!(kind in seen_kind)) continue
    keys = keys sprintf(", keyentry with lines linecolor rgb \"%s\" linewidth 2 dashtype %d " \
                        "title \"%s\"", color[kind], dash[kind], what[kind])
  }
  if (n_out > 0) {
    keys = keys ", keyentry with boxes fillcolor rgb \"#fbe3e3\" fillstyle solid 1.0 " \
           "title \"slot out of service\""
  }
  facts = dir "/facts.sh"
  printf "slots=\"%s\"\nn_slots=%d\nn_acc=%d\nn_events=%d\ntmax=%g\nwmax=%g\n",
         clean(slots), n_slots, n_acc, n_events, tmax, wmax > facts
  printf "final_accuracy=\"%s\"\n", (n_acc > 0 ? sprintf("%.1f%%", acc_last) : "") > facts
  printf "event_summary=\"%s\"\n", summary > facts
  gsub(/"/, "\\\"", keys)
  printf "event_keys=\"%s\"\n", keys > facts
}
' "$csv" || exit 1

slots="" n_slots=0 n_acc=0 n_events=0 tmax=0 wmax=0 final_accuracy="" event_summary="" event_keys=""
# shellcheck disable=SC1091
. "$tmp/facts.sh"

title="Rebound job progress: test accuracy and reliability weights\n$n_slots slot(s) over ${tmax} s"
[ -n "$final_accuracy" ] && title="$title, final test accuracy $final_accuracy"
if awk -v w="$wmax" 'BEGIN { exit !(w <= 1) }'; then wtop=1.1; else wtop="*"; fi
# A little room on the right, so that an event at the last row does not hide in the border.
xtop=$(awk -v t="$tmax" 'BEGIN { print (t > 0) ? t * 1.02 : 1 }')

if [ "$n_acc" -gt 0 ]; then
  accuracy_plot="'$tmp/accuracy.dat' using 1:2 with linespoints pointtype 7 pointsize 0.6 \
linewidth 2 linecolor rgb '#1f77b4' title 'test accuracy'"
  accuracy_range="set yrange [*:*]"
else
  accuracy_plot="NaN notitle"
  accuracy_range="set yrange [0:100]
set label 'no test accuracy reported' at graph 0.5, graph 0.5 center"
fi

cat >"$tmp/plot.gp" <<EOF
set terminal pngcairo noenhanced size $kWidth,$kHeight font 'Sans,11'
set output '$png'
set multiplot title "$title" font 'Sans,13'
set lmargin at screen 0.08
set rmargin at screen 0.77
set xrange [0:$xtop]
set style line 100 linecolor rgb '#d8d8d8' linewidth 1 dashtype 1
set grid xtics ytics linestyle 100 back
set key at screen 0.785, graph 1 left top reverse Left samplen 3
# Slot colours, kept apart from the event lines' red, orange, green and purple.
set linetype 1 linecolor rgb '#1f77b4'
set linetype 2 linecolor rgb '#8c564b'
set linetype 3 linecolor rgb '#17becf'
set linetype 4 linecolor rgb '#7f7f7f'
set linetype 5 linecolor rgb '#e377c2'
set linetype 6 linecolor rgb '#bcbd22'
set linetype 7 linecolor rgb '#393b79'
set linetype 8 linecolor rgb '#000000'
set linetype cycle 8

load '$tmp/marks.gp'
load '$tmp/labels.gp'
set tmargin at screen 0.84
set bmargin at screen 0.52
set ylabel 'test accuracy (%)'
$accuracy_range
plot $accuracy_plot $event_keys

unset label
set tmargin at screen 0.45
set bmargin at screen 0.08
set xlabel 'elapsed time (s)'
set ylabel 'reliability weight'
set yrange [0:$wtop]
slots = "$slots"
plot for [i=1:words(slots)] '$tmp/weights.dat' index (i-1) using 1:2 with linespoints linetype i \
  linewidth 2 pointtype 7 pointsize 0.4 title 'slot '.word(slots, i)
unset multiplot
EOF

if ! gnuplot "$tmp/plot.gp" 2>"$tmp/gnuplot.err"; then
  cat "$tmp/gnuplot.err" >&2
  die "gnuplot failed to draw $png"
fi
[ -s "$png" ] || die "gnuplot wrote no image to $png"
summary="plot_progress: wrote $png (${kWidth}x${kHeight}): $n_slots slot(s),"
summary="$summary $n_acc accuracy point(s), $n_events event(s)"
[ "$n_events" -gt 0 ] && summary="$summary: $event_summary"
echo "$summary"
