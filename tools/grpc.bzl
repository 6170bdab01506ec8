"""cc_grpc_library: C++ code generation with Debian's protoc and grpc_cpp_plugin."""

PROTOC = "/usr/bin/protoc"
GRPC_CPP_PLUGIN = "/usr/bin/grpc_cpp_plugin"

def cc_grpc_library(name, srcs, grpc = True, deps = [], proto_deps = [], visibility = None, **kwargs):
    """Generates and compiles the C++ messages (and gRPC stubs) of `srcs`.

    Args:
      name: the cc_library to define.
      srcs: .proto files of this package.
      grpc: also generate service stubs.
      deps: cc_grpc_library targets that compile `proto_deps`.
      proto_deps: .proto files of other packages imported by `srcs` (exported there).
      visibility: of the cc_library.
      **kwargs: passed to the cc_library.

    C++ code includes the outputs by workspace path, e.g. "proto/rebound.grpc.pb.h".
    google/protobuf/*.proto are found in /usr/include by protoc itself.
    """
    outs = []
    for src in srcs:
        if not src.endswith(".proto"):
            fail("cc_grpc_library srcs must be .proto files: " + src)
        base = src[:-len(".proto")]
        outs += [base + ".pb.h", base + ".pb.cc"]
        if grpc:
            outs += [base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    cmd = PROTOC + " -I. --cpp_out=$(GENDIR)"
    if grpc:
        cmd += " --grpc_out=$(GENDIR) --plugin=protoc-gen-grpc=" + GRPC_CPP_PLUGIN
    cmd += " " + " ".join(["$(location %s)" % s for s in srcs])
    native.genrule(
        name = name + "_gen",
        srcs = srcs + proto_deps,
        outs = outs,
        cmd = cmd,
        message = "protoc (system) %s" % name,
        visibility = ["//visibility:private"],
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = deps + (["//third_party/system:grpc++"] if grpc else ["//third_party/system:protobuf"]),
        visibility = visibility,
        **kwargs
    )
