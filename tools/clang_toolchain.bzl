"""A second auto-configured C++ toolchain, for clang (the fuzzers' --config=fuzz).

Bazel's own @local_config_cc is configured from the CC environment variable, so building with
`--repo_env=CC=clang` re-configures it, and switching back re-configures it again. This rule runs
the same auto-configuration (Bazel's cc_autoconf_impl) with the compiler fixed to clang, under
another name, so both toolchains exist side by side and neither is ever re-configured. It is
fetched only when --crosstool_top names it, and it downloads nothing.
"""

load("@bazel_tools//tools/cpp:cc_configure.bzl", "cc_autoconf_impl")

def _clang_autoconf_impl(repository_ctx):
    clang = repository_ctx.which(repository_ctx.attr.compiler)
    if clang == None:
        fail("%s not found on PATH: tools/setup.sh installs Debian's clang" % repository_ctx.attr.compiler)
    cc_autoconf_impl(repository_ctx, overriden_tools = {"gcc": str(clang)})

clang_autoconf = repository_rule(
    implementation = _clang_autoconf_impl,
    attrs = {"compiler": attr.string(default = "clang")},
    configure = True,
)
