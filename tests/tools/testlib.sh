# The checks shared by the shell tests of tests/tools/ (sourced, not run). A failed check prints
# what was expected and what came, names the scenario, and is counted; `finish NAME` ends the
# test: exit 1 if any check failed, 0 otherwise.

failures=0
current=""

fail() {
  echo "  FAIL ($current): $*"
  failures=$((failures + 1))
}
expect_eq() {  # what, expected, actual
  [ "$2" = "$3" ] || fail "$1:
    expected '$2'
    got      '$3'"
}
expect_contains() {  # what, needle, haystack
  case $3 in
    *"$2"*) ;;
    *) fail "$1: expected to contain '$2', got '$3'" ;;
  esac
}
expect_lacks() {  # what, needle, haystack
  case $3 in
    *"$2"*) fail "$1: expected not to contain '$2', got '$3'" ;;
    *) ;;
  esac
}
scenario() {
  current=$1
  echo "-- $current"
}
finish() {  # test name
  if [ "$failures" -ne 0 ]; then
    echo "$1: $failures check(s) failed"
    exit 1
  fi
  echo "$1: all checks passed"
  exit 0
}
