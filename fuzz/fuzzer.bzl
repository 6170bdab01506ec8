"""rebound_fuzzer: a libFuzzer target that also builds, and runs over its corpus, without libFuzzer.

For a target `name` (srcs define LLVMFuzzerTestOneInput, and optionally LLVMFuzzerInitialize):
  * `name`: the fuzzer. Under --config=fuzz (clang, ASan, --define=rebound_fuzz=1) it links
    libFuzzer's main (-fsanitize=fuzzer); in the default gcc build it links
    fuzz/standalone_main.cc, which runs the files or directories named on its command line.
  * `name + "_regression_test"`: runs the target once on every file of its corpus
    (fuzz/corpus/<name>/: the seeds and every crash found, kept as regressions), in every build.
"""

def rebound_fuzzer(name, srcs, deps = []):
    corpus = "corpus/" + name
    native.cc_library(
        name = name + "_lib",
        testonly = True,
        srcs = srcs,
        deps = deps + ["//fuzz:fuzz_check"],
        alwayslink = True,
    )
    native.cc_binary(
        name = name,
        testonly = True,
        deps = [":" + name + "_lib"] + select({
            "//fuzz:fuzzing": [],
            "//conditions:default": ["//fuzz:standalone_main"],
        }),
        linkopts = select({
            "//fuzz:fuzzing": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
    )
    native.cc_test(
        name = name + "_regression_test",
        size = "small",
        args = [native.package_name() + "/" + corpus],
        data = native.glob([corpus + "/*"]),
        deps = [
            ":" + name + "_lib",
            "//fuzz:standalone_main",
        ],
    )
