#!/usr/bin/env bash
# Plots the convergence study (//study/convergence, docs/convergence.md) as PNGs: for each chosen
# (R, tau) and each failure schedule one figure, with the center's test accuracy against the mean
# local steps per trainer (upper left) and against simulated time (upper right), one line per
# policy (UNIFORM, DYNAMIC, SYNC), and the faulty trainer's (R-1) reliability weight under DYNAMIC
# against simulated time (lower panel).
#
#   tools/plot_convergence.sh RUN_DIR OUTPUT_DIR [R:TAU ...]
#
# RUN_DIR is the benchmark's --out directory (it reads RUN_DIR/runs/R<R>_tau<T>_<schedule>_
# <policy>_seed<S>.csv); OUTPUT_DIR receives convergence_R<R>_tau<T>_<schedule>.png (e.g. docs/).
# Without R:TAU arguments it plots 2:1, 4:4 and 8:16 where present, else every (R, tau) found.
# --seed=S (before RUN_DIR) picks the seed plotted (default 0). A missing policy is left out of a
# figure (and named in the summary). Prints one line per PNG. Exit 0 with every PNG written, 1 when
# RUN_DIR holds no run CSV for a requested cell, a CSV is malformed (the message names file, line
# and column) or gnuplot fails, 64 on usage. Needs gnuplot (Debian's gnuplot-nox, tools/setup.sh).
set -euo pipefail

readonly kHeader="sim_s,mean_steps,center_version,test_loss,test_accuracy"
readonly kWidth=1400 kHeight=900
readonly kDefaultCells="2:1 4:4 8:16"

die() {
  echo "plot_convergence: $*" >&2
  exit 1
}
usage() {
  echo "usage: tools/plot_convergence.sh [--seed=S] RUN_DIR OUTPUT_DIR [R:TAU ...]" >&2
  exit 64
}

seed=0
if [ $# -gt 0 ] && [[ $1 == --seed=* ]]; then
  seed=${1#--seed=}
  [[ $seed =~ ^[0-9]+$ ]] || usage
  shift
fi
[ $# -ge 2 ] || usage
run_dir=$1
out_dir=$2
shift 2
for cell in "$@"; do
  [[ $cell =~ ^[0-9]+:[0-9]+$ ]] || { echo "plot_convergence: bad cell '$cell' (R:TAU)" >&2; usage; }
done

command -v gnuplot >/dev/null 2>&1 ||
  die "gnuplot is not installed: run tools/setup.sh (it installs Debian's gnuplot-nox)"
case $out_dir in
  *\'* | *$'\n'*) die "the output directory must not contain a quote or a line break: $out_dir" ;;
esac
[ -d "$run_dir/runs" ] || die "$run_dir/runs is not a directory: expected the --out of //study/convergence"
mkdir -p "$out_dir" || die "cannot create $out_dir"
[ -w "$out_dir" ] || die "cannot write to $out_dir"

# The cells to plot.
cells=("$@")
if [ ${#cells[@]} -eq 0 ]; then
  for cell in $kDefaultCells; do
    r=${cell%%:*} t=${cell##*:}
    if compgen -G "$run_dir/runs/R${r}_tau${t}_*_seed${seed}.csv" >/dev/null; then cells+=("$cell"); fi
  done
  if [ ${#cells[@]} -eq 0 ]; then
    while IFS= read -r cell; do cells+=("$cell"); done < <(
      find "$run_dir/runs" -name "R*_tau*_seed${seed}.csv" -printf '%f\n' |
        sed -E 's/^R([0-9]+)_tau([0-9]+)_.*/\1:\2/' | sort -t: -k1,1n -k2,2n -u)
  fi
  [ ${#cells[@]} -gt 0 ] || die "no run CSV for seed $seed in $run_dir/runs"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Checks one run CSV and writes "steps sim_s accuracy_percent weight_of_trainer_R-1" rows to $2.
extract() {
  awk -F, -v csv="$1" -v header="$kHeader" -v replicas="$3" '
    function fail(msg) { printf "plot_convergence: %s:%d: %s\n", csv, NR, msg > "/dev/stderr"; bad = 1; exit 1 }
    function is_number(s) { return s ~ /^[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$/ }
    NR == 1 {
      sub(/\r$/, "")
      if (index($0, header ",w0") != 1) fail("not a convergence run CSV: expected the header to start with \047" header ",w0\047")
      if (NF != 5 + replicas) fail("expected " 5 + replicas " columns for R=" replicas ", got " NF)
      next
    }
    {
      sub(/\r$/, "")
      if (NF != 5 + replicas) fail("expected " 5 + replicas " columns, got " NF)
      for (i = 1; i <= NF; i++) if (!is_number($i)) fail("column " i " is not a number: \047" $i "\047")
      print $2, $1, 100 * $5, $(5 + replicas)
      rows++
    }
    END { if (bad) exit 1; if (rows == 0) { NR = 1; fail("no rows after the header") } }
  ' "$1" >"$2"
}

written=0
for cell in "${cells[@]}"; do
  r=${cell%%:*} t=${cell##*:}
  found_cell=0
  for schedule in none straggler kill; do
    plots_steps="" plots_time="" missing="" weight_plot="" ymin=100
    for policy in UNIFORM DYNAMIC SYNC; do
      csv="$run_dir/runs/R${r}_tau${t}_${schedule}_${policy}_seed${seed}.csv"
      if [ ! -f "$csv" ]; then missing="$missing $policy"; continue; fi
      dat="$tmp/R${r}_tau${t}_${schedule}_${policy}.dat"
      extract "$csv" "$dat" "$r" || exit 1
      case $policy in
        UNIFORM) style="linecolor rgb '#1f77b4' linewidth 2 pointtype 7 pointsize 0.5" ;;
        DYNAMIC) style="linecolor rgb '#d62728' linewidth 2 pointtype 5 pointsize 0.5" ;;
        SYNC) style="linecolor rgb '#555555' linewidth 2 dashtype 2 pointtype 9 pointsize 0.5" ;;
      esac
      plots_steps="$plots_steps${plots_steps:+, }'$dat' using 1:3 with linespoints $style title '$policy'"
      plots_time="$plots_time${plots_time:+, }'$dat' using 2:3 with linespoints $style title '$policy'"
      if [ "$policy" = DYNAMIC ]; then
        weight_plot="'$dat' using 2:4 with steps linecolor rgb '#d62728' linewidth 2 title 'DYNAMIC: weight of trainer $((r - 1))'"
      fi
      # The lower end of the accuracy axis: the lowest accuracy after the first tenth of the run.
      ymin=$(awk -v m="$ymin" 'NR == 1 { tmax = 0 } { t[NR] = $2; a[NR] = $3; if ($2 > tmax) tmax = $2 }
        END { for (i = 1; i <= NR; i++) if (t[i] >= 0.1 * tmax && a[i] < m) m = a[i]; print m }' "$dat")
    done
    [ -n "$plots_steps" ] || continue
    found_cell=1
    ylow=$(awk -v m="$ymin" 'BEGIN { v = int(m / 5) * 5 - 5; print (v < 0) ? 0 : v }')
    [ -n "$weight_plot" ] || weight_plot="NaN title 'no DYNAMIC run'"
    case $schedule in
      none) what="no failures" ;;
      straggler) what="trainer $((r - 1)) a straggler" ;;
      kill) what="trainer $((r - 1)) killed periodically, back with fresh state" ;;
    esac
    png="$out_dir/convergence_R${r}_tau${t}_${schedule}.png"
    cat >"$tmp/plot.gp" <<EOF
set terminal pngcairo noenhanced size $kWidth,$kHeight font 'Sans,11'
set output '$png'
set multiplot title "Convergence study (simulated time), R = $r trainers, tau = $t, schedule $schedule: $what (seed $seed)" font 'Sans,13'
set style line 100 linecolor rgb '#d8d8d8' linewidth 1
set grid xtics ytics linestyle 100 back
set key bottom right
set yrange [$ylow:*]
set ylabel 'test accuracy of the center (%)'
set tmargin at screen 0.92
set bmargin at screen 0.40
set lmargin at screen 0.06
set rmargin at screen 0.48
set xlabel 'mean local steps per trainer'
plot $plots_steps
set lmargin at screen 0.55
set rmargin at screen 0.97
set xlabel 'simulated time (s)'
plot $plots_time
set tmargin at screen 0.30
set bmargin at screen 0.07
set lmargin at screen 0.06
set rmargin at screen 0.97
set yrange [0:1.1]
set ylabel 'weight'
set xlabel 'simulated time (s)'
set key top right
plot $weight_plot
unset multiplot
EOF
    if ! gnuplot "$tmp/plot.gp" 2>"$tmp/gnuplot.err"; then
      cat "$tmp/gnuplot.err" >&2
      die "gnuplot failed to draw $png"
    fi
    [ -s "$png" ] || die "gnuplot wrote no image to $png"
    written=$((written + 1))
    echo "plot_convergence: wrote $png${missing:+ (no run for:$missing)}"
  done
  [ "$found_cell" -eq 1 ] || die "no run CSV for R=$r tau=$t seed $seed in $run_dir/runs"
done
echo "plot_convergence: $written figure(s) in $out_dir"
