"""cuda_library: nvcc-compiled kernels, built only under --config=cuda."""

CUDA_PATH = "/usr/local/cuda"
NVCC = CUDA_PATH + "/bin/nvcc"

# Compatible only with --define=cuda=1; a plain `bazel build //...` skips these targets, so
# CPU-only machines need no CUDA toolkit at all.
CUDA_ONLY = select({
    "//tools:cuda_enabled": [],
    "//conditions:default": ["@platforms//:incompatible"],
})

def cuda_library(name, srcs, hdrs = [], deps = [], gpu_arch = "sm_90", nvcc_flags = [], visibility = None):
    """Compiles .cu `srcs` with nvcc into a static library behind plain C++ `hdrs`.

    Args:
      name: the cc_library to define.
      srcs: .cu files.
      hdrs: host-side C++ headers (no CUDA types) and headers the .cu files include.
      deps: further cc deps of the library.
      gpu_arch: the -arch passed to nvcc (sm_90 = Hopper).
      nvcc_flags: extra nvcc flags, e.g. -gencode lists.
      visibility: of the cc_library.
    """
    objs = []
    for src in srcs:
        obj = src.replace(".cu", ".cu.o")
        objs.append(obj)
        native.genrule(
            name = name + "_nvcc_" + src.replace("/", "_").replace(".", "_"),
            srcs = [src] + hdrs,
            outs = [obj],
            cmd = " ".join([
                NVCC,
                "-std=c++17",
                "-O2",
                "-I.",
                "-Xcompiler",
                "-fPIC",
                "-arch=" + gpu_arch,
                " ".join(nvcc_flags),
                "-c",
                "$(location %s)" % src,
                "-o",
                "$@",
            ]),
            message = "nvcc %s" % src,
            target_compatible_with = CUDA_ONLY,
        )
    native.genrule(
        name = name + "_ar",
        srcs = objs,
        outs = ["lib%s_cuda.a" % name],
        cmd = "ar rcs $@ $(SRCS)",
        target_compatible_with = CUDA_ONLY,
    )
    native.cc_library(
        name = name,
        srcs = [":lib%s_cuda.a" % name],
        hdrs = hdrs,
        deps = deps + ["//third_party/system:cuda_runtime"],
        alwayslink = True,
        target_compatible_with = CUDA_ONLY,
        visibility = visibility,
    )
