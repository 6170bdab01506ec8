"""The images install what their programs load: a default-tier check without a container daemon.

deploy/Dockerfile: every shared library that `ldd` finds for rebound_server, rebound_worker and
reboundctl belongs (`dpkg -S`) to a package that the Dockerfile's `apt-get install` names or that
one of those pulls in (Depends and Pre-Depends, read from this machine's dpkg database, as apt
resolves them). deploy/Dockerfile.python: every module outside the standard library that the
rebound package and the example trainer import belongs to such a package of its list.

The binaries are this test's data, built by Bazel in the test's own configuration (fastbuild),
while the image takes opt builds. Both link the same libraries: the link line comes from the
cc_binary deps and linkopts (third_party/system), not from the compilation mode; `ldd` of the opt
and fastbuild builds of all three listed the same 60-odd libraries (R19). An opt build in the
runfiles would need a configuration transition for a minute of compiling, and this check would
learn nothing more from it.

What it cannot see: a library loaded with dlopen, a file a program reads at run time. Those are
the job of //tests/deploy:image_chroot_test (tools/test.sh --full), which installs exactly these
lists into a Debian 12 root and runs the programs there.
"""

import ast
import os
import subprocess
import sys
import unittest

import images

BINARIES = ["server/rebound_server", "worker/rebound_worker", "tools/reboundctl"]


def python_imports(paths):
    """The top-level module names that the files at `paths` import (absolute imports only)."""
    names = set()
    for path in paths:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def python_sources():
    found = [os.path.join(images.ROOT, "examples/torch/fashion_mnist_cnn.py")]
    for directory, _, files in os.walk(os.path.join(images.ROOT, "python/rebound")):
        found += [os.path.join(directory, f) for f in files if f.endswith(".py")]
    return found


class ServerImageTest(unittest.TestCase):
    maxDiff = None

    @classmethod
    def setUpClass(cls):
        cls.stage = images.final_stage(images.SERVER_IMAGE)
        cls.packages = images.installed_packages()
        cls.linked = {binary: images.linked_libraries(binary) for binary in BINARIES}
        cls.owners = images.owning_packages(
            {path for libraries in cls.linked.values() for path in libraries.values()})

    def missing(self, listed):
        """{package: [(binary, soname)]} of the linked libraries whose package `listed` does not
        bring in."""
        closure = images.dependency_closure(listed, self.packages)
        missing = {}
        for binary, libraries in self.linked.items():
            for soname, path in libraries.items():
                package = self.owners[path]
                self.assertIsNotNone(package, f"{binary}: no package holds {path} ({soname})")
                if package not in closure:
                    missing.setdefault(package, []).append((binary, soname))
        return missing

    def test_the_image_copies_the_binaries_this_test_reads(self):
        self.assertEqual(self.stage.base, "debian:12")
        self.assertEqual(sorted(src for src, _, _ in self.stage.copies), sorted(BINARIES))

    def test_every_listed_package_is_a_debian_package_installed_here(self):
        # A misspelt name would otherwise drop out of the closure unnoticed (and fail only the
        # image build); tools/setup.sh installs every one of them.
        self.assertGreater(len(self.stage.packages), 10)
        for package in self.stage.packages:
            self.assertIn(package, self.packages, f"{package}: not installed here")
            self.assertEqual(self.packages[package][0], "installed", package)

    def test_every_linked_library_comes_from_a_package_the_image_installs(self):
        missing = self.missing(self.stage.packages)
        self.assertEqual(missing, {}, "deploy/Dockerfile's apt-get install lacks these "
                         "packages (package: [(binary, library)])")

    def test_the_check_names_the_package_a_shorter_list_lacks(self):
        # The list before R19: the server's tcmalloc and the /metrics server's cpp-httplib were
        # missing. Taken out again, this check must name exactly them, with the libraries, and
        # libbrotli1, which only cpp-httplib pulls in (its compressed responses).
        listed = [p for p in self.stage.packages
                  if p not in ("libtcmalloc-minimal4", "libcpp-httplib0.11")]
        missing = self.missing(listed)
        self.assertEqual(sorted(missing),
                         ["libbrotli1", "libcpp-httplib0.11", "libtcmalloc-minimal4"])
        self.assertIn(("server/rebound_server", "libtcmalloc_minimal.so.4"),
                      missing["libtcmalloc-minimal4"])
        self.assertIn(("worker/rebound_worker", "libcpp-httplib.so.0.11"),
                      missing["libcpp-httplib0.11"])

    def test_the_binaries_link_what_the_build_says(self):
        # Guards the reading of ldd: the libraries of third_party/system are there, resolved to
        # files that exist.
        server = self.linked["server/rebound_server"]
        for soname in ("libgrpc++.so.1.51", "librocksdb.so.7.8", "libtcmalloc_minimal.so.4",
                       "libc.so.6"):
            self.assertIn(soname, server)
            self.assertTrue(os.path.exists(server[soname]), server[soname])
        self.assertEqual(self.owners[server["libc.so.6"]], "libc6")


class PythonImageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stages = images.read_dockerfile(images.PYTHON_IMAGE)
        cls.stage = cls.stages[-1]
        cls.packages = images.installed_packages()

    def test_the_image_holds_the_package_its_stubs_the_example_and_the_version(self):
        self.assertEqual(self.stage.base, "debian:12")
        copies = {dst: (src, origin) for src, dst, origin in self.stage.copies}
        self.assertEqual(copies, {
            "/opt/rebound/VERSION": ("VERSION", None),
            "/opt/rebound/python/rebound": ("python/rebound", None),
            "/opt/rebound/python/rebound_pb": ("/out/rebound_pb", "stubs"),
            "/opt/rebound/examples/torch/fashion_mnist_cnn.py":
                ("examples/torch/fashion_mnist_cnn.py", None),
        })
        # The package finds VERSION two directories above itself, as in a checkout.
        self.assertEqual(os.path.dirname(os.path.dirname("/opt/rebound/python/rebound")),
                         os.path.dirname("/opt/rebound/VERSION"))
        self.assertEqual(self.stage.env["PYTHONPATH"], "/opt/rebound/python")
        # The stubs stage runs the checkout's generator with Debian's compilers.
        [stubs] = [s for s in self.stages if s.name == "stubs"]
        self.assertEqual(stubs.packages, ["protobuf-compiler-grpc"])
        self.assertIn("/src/python/gen_stubs.sh /out", stubs.runs)

    def test_the_image_runs_as_the_server_images_user(self):
        server = images.final_stage(images.SERVER_IMAGE)
        python = self.stage
        self.assertEqual([r for r in python.runs if "useradd" in r],
                         [r for r in server.runs if "useradd" in r])

    def test_every_imported_module_comes_from_a_package_the_image_installs(self):
        closure = images.dependency_closure(self.stage.packages, self.packages)
        stdlib = set(sys.stdlib_module_names)
        third_party = python_imports(python_sources()) - stdlib - {"rebound", "rebound_pb"}
        # What the client is built on (docs/python.md): if the walk found less, it is broken.
        self.assertLessEqual({"torch", "grpc", "google", "numpy", "xxhash"}, third_party)
        files = {}
        for module in sorted(third_party):
            files[module] = subprocess.run(
                ["/usr/bin/python3", "-c",
                 f"import importlib.util as u; s = u.find_spec({module!r}); "
                 "print(s.origin if s.origin not in (None, 'namespace') else "
                 "list(s.submodule_search_locations)[0])"],
                capture_output=True, text=True, check=True).stdout.strip()
        owners = images.owning_packages(files.values())
        for module, spec in sorted(files.items()):
            package = owners[spec]
            self.assertIsNotNone(package, f"import {module}: no package holds {spec}")
            self.assertIn(package, closure,
                          f"import {module} ({spec}) needs {package}, which "
                          f"deploy/Dockerfile.python's apt-get install does not bring in")

    def test_python3_itself_is_listed(self):
        # The workers' command is /usr/bin/python3: the interpreter must not come by accident
        # (it is python3-minimal's file, which python3 depends on).
        self.assertIn("python3", self.stage.packages)
        closure = images.dependency_closure(["python3"], self.packages)
        self.assertIn(images.owning_package("/usr/bin/python3"), closure)


if __name__ == "__main__":
    unittest.main(verbosity=2)
