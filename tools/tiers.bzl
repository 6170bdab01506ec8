"""Test tiers (docs/testing.md#tiers): Catch2 cases tagged [.full] run only in `tools/test.sh --full`.

A case tagged "[.full]" is hidden (Catch2 v2 runs a hidden case only when a test spec names it)
and tagged "full". tiered_cc_test(name, ...) declares two cc_tests from the same sources and
attributes:
  * `name`: every case but the [full] ones (the default tier and CI);
  * `name + "_full"`: only the [full] cases, tagged "manual" (so //... leaves it out) and "full"
    (tools/test.sh --full finds it by that tag and runs it with the others, also under TSan).

`args`, if given, are Catch2 test specs that select cases (e.g. ["[group]"]); a tag spec also
matches hidden cases, so each is narrowed to its non-[full] or its [full] cases (Catch2 v2 ANDs
filters written without a space between them and ORs separate arguments). A case name given with
--test_arg (tools/test.sh's TSan cases) selects just that case: without `args`, the default
target passes no spec that could widen it.
"""

def _narrowed(args, spec):
    return [arg + spec for arg in args]

def tiered_cc_test(name, args = [], tags = [], **kwargs):
    native.cc_test(
        name = name,
        args = _narrowed(args, "~[full]"),
        tags = tags,
        **kwargs
    )
    native.cc_test(
        name = name + "_full",
        args = _narrowed(args, "[full]") if args else ["[full]"],
        tags = tags + ["manual", "full"],
        **kwargs
    )

def tiered_pytest_test(name, args, tags = [], **kwargs):
    """The same two tiers for a pytest file run by tests/python/run_pytest.sh (an sh_test whose
    `args` start with the test file): `name` runs the cases not marked `@pytest.mark.full`,
    `name + "_full"` (tagged "manual" and "full") passes `--full` first and runs only those."""
    native.sh_test(
        name = name,
        args = args,
        tags = tags,
        **kwargs
    )
    native.sh_test(
        name = name + "_full",
        args = ["--full"] + args,
        tags = tags + ["manual", "full"],
        **kwargs
    )
