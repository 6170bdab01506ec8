"""python3 -m rebound export --server HOST:PORT -o FILE [--operator_token_file F] [--token_file F]
python3 -m rebound --version

--version prints "rebound <version> (commit <commit>)" as every binary's --version does
(docs/upgrading.md).

Writes the server's center (ExportCenter, an operator call; rebound.torch.export) to FILE: a
PyTorch state_dict saved with torch.save when FILE ends in .pt (``torch.load(FILE)`` gives it
back, ``model.load_state_dict`` takes it for a declared model), else safetensors as `reboundctl
export` writes it. The file is written to FILE.tmp and renamed. Prints the center versions and the
file's size. Exit codes: 0, 1 (the server refused: e.g. no operator token), 2 (unreachable),
64 (usage).
"""

import argparse
import os
import sys

import rebound


def _export(args):
    from rebound import client as rclient
    from rebound.torch import export as rexport
    import torch
    try:
        state, versions = rexport.export_center(args.server, args.operator_token_file,
                                                args.token_file, deadline_s=args.timeout_s)
    except rclient.CallError as error:
        print("python3 -m rebound export: the server refused: %s" % error, file=sys.stderr)
        return 1
    except rclient.Unreachable as error:
        print("python3 -m rebound export: %s" % error, file=sys.stderr)
        return 2
    tmp = args.o + ".tmp"
    if args.o.endswith(".pt"):
        torch.save(state, tmp)
        kind = "a torch.save'd state_dict"
    else:
        with open(tmp, "wb") as f:
            f.write(rexport.safetensors_bytes(state, {
                "format": "pt", "rebound.center_versions": ",".join(map(str, versions))}))
        kind = "safetensors"
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, args.o)
    print("exported center version %s (%d tensors) to %s: %d bytes, %s" % (
        ",".join(map(str, versions)), len(state), args.o, os.path.getsize(args.o), kind))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m rebound")
    parser.add_argument("--version", action="store_true",
                        help="print the version and the git commit, as the binaries' --version")
    commands = parser.add_subparsers(dest="command")
    export = commands.add_parser("export", help="the server's center to a .pt or safetensors file")
    export.add_argument("--server", default="127.0.0.1:7070")
    export.add_argument("-o", required=True, help="the file (.pt: torch.save; else safetensors)")
    export.add_argument("--operator_token_file")
    export.add_argument("--token_file")
    export.add_argument("--timeout_s", type=float, default=60.0)
    try:
        args = parser.parse_args(argv)
    except SystemExit as usage:
        return 64 if usage.code else 0
    if args.version:
        print(rebound.version_line())
        return 0
    if args.command != "export":
        parser.print_usage(sys.stderr)
        return 64
    return _export(args)


if __name__ == "__main__":
    sys.exit(main())
