"""The images start: each Dockerfile's final stage built as a Debian 12 root, without a container
daemon, and its programs run there (tools/test.sh --full; minutes and the Debian mirror).

debootstrap (minbase, as Debian's debian:12 image) makes a Debian 12 root; for each image a copy
of it runs the Dockerfile's RUN lines as they stand (`apt-get install` of exactly its list, the
user), gets what its COPY lines name (the binaries and the Python package from this test's
runfiles, the stubs stage's rebound_pb from the genrule //python:rebound_pb, which runs the same
python/gen_stubs.sh) and runs, as the Dockerfile's USER in its WORKDIR with its ENV, chrooted:

  deploy/Dockerfile         rebound_server, rebound_worker and reboundctl --version, etcd
                            --version; a one-step job: the server, one trainer to max_steps 1,
                            reboundctl status (the slot FINISHED, center version 1), SIGTERM
  deploy/Dockerfile.python  import rebound.torch and rebound_pb, python3 -m rebound --version,
                            and the example trainer from this image running a one-step job on
                            the server of the other root (both share the host's network), as
                            a deploy/k8s-python trainer pod runs it: its script, worker config
                            and job

The binaries are fastbuild builds (this test's configuration); they link the same libraries as
the opt builds the image takes (image_packages_test.py says how that was checked).

Skipped (unittest's skip, which tools/test.sh reports as skipped, not passed) when it cannot run:
not root (chroot, mounts), no debootstrap (Debian's package; tools/setup.sh installs it), or the
mirror of /etc/apt/sources.list* unreachable. Downloaded packages are kept in
REBOUND_IMAGE_TEST_CACHE (default /var/tmp/rebound-image-test-cache) for the next run.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import unittest
import urllib.request

import images

SUITE = "bookworm"   # Debian 12, the images' FROM
CACHE = os.environ.get("REBOUND_IMAGE_TEST_CACHE", "/var/tmp/rebound-image-test-cache")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# chroot, mount and debootstrap are in sbin, which Bazel's strict action PATH leaves out.
os.environ["PATH"] = "/usr/sbin:/sbin:" + os.environ.get("PATH", "/usr/bin:/bin")


def log(message):
    print(f"image_chroot_test: {time.strftime('%H:%M:%S')} {message}", flush=True)


def apt_sources():
    """The host's apt sources: {path under /etc/apt: text}, and the Debian mirror they name."""
    sources, mirror = {}, None
    for path in ["/etc/apt/sources.list"] + sorted(
            os.path.join("/etc/apt/sources.list.d", f)
            for f in (os.listdir("/etc/apt/sources.list.d")
                      if os.path.isdir("/etc/apt/sources.list.d") else [])):
        if not os.path.isfile(path) or not path.endswith((".list", ".sources")):
            continue
        with open(path) as f:
            text = f.read()
        sources[path] = text
        for uri in re.findall(r"^URIs:\s*(\S+)|^deb\s+(?:\[[^]]*\]\s+)?(\S+)", text, re.M):
            uri = uri[0] or uri[1]
            if mirror is None and not uri.rstrip("/").endswith("-security"):
                mirror = uri.rstrip("/")
    return sources, mirror or "http://deb.debian.org/debian"


def mounts_under(path):
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(path.rstrip("/") + "/")]


class Root:
    """A Debian root made from the base for one Dockerfile's final stage."""

    def __init__(self, base, path, dockerfile):
        self.path = path
        self.dockerfile = dockerfile
        self.stage = images.final_stage(dockerfile)
        log(f"{dockerfile}: copying the base root")
        subprocess.run(["cp", "-a", base, path], check=True)
        self.mounted = []
        self.mount(["-t", "proc", "proc"], "proc")
        os.makedirs(os.path.join(CACHE, "apt"), exist_ok=True)
        self.mount(["--bind", os.path.join(CACHE, "apt")], "var/cache/apt/archives")

    def mount(self, args, target):
        target = os.path.join(self.path, target)
        os.makedirs(target, exist_ok=True)
        subprocess.run(["mount"] + args + [target], check=True)
        self.mounted.append(target)

    def unmount(self):
        for target in reversed(self.mounted):
            subprocess.run(["umount", target], check=False)
        self.mounted = []

    def build(self, sources):
        """The Dockerfile's RUN lines (as root, /bin/sh -c, as `docker build` runs them) with the
        host's apt sources, and its COPY lines from the runfiles."""
        for old in ("etc/apt/sources.list",):
            if os.path.exists(os.path.join(self.path, old)):
                os.remove(os.path.join(self.path, old))
        for path, text in sources.items():
            with open(os.path.join(self.path, path.lstrip("/")), "w") as f:
                f.write(text)
        shutil.copy("/etc/resolv.conf", os.path.join(self.path, "etc/resolv.conf"))
        for run in self.stage.runs:
            log(f"{self.dockerfile}: RUN {run[:100]}...")
            started = time.time()
            result = subprocess.run(["chroot", self.path, "/bin/sh", "-c", run],
                                    env={"PATH": DEFAULT_PATH, "HOME": "/root"},
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise AssertionError(f"{self.dockerfile}: RUN failed ({result.returncode}):\n"
                                     f"{run}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
            log(f"{self.dockerfile}: RUN done in {time.time() - started:.0f} s")
        for source, destination, origin in self.stage.copies:
            if origin == "stubs":
                # The stubs stage's output is //python:rebound_pb, gen_stubs.sh's in Bazel.
                assert source == "/out/rebound_pb", source
                source = "python/rebound_pb"
            target = os.path.join(self.path, destination.lstrip("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.isdir(source):
                shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(source, target)   # the runfiles' symlinks followed, modes kept
            log(f"{self.dockerfile}: COPY {source} {destination}")

    def env(self):
        """The Dockerfile's ENV over a shell's PATH ($PATH expanded as Docker does)."""
        env = {"PATH": DEFAULT_PATH, "HOME": "/var/lib/rebound"}
        for name, value in self.stage.env.items():
            env[name] = re.sub(r"\$(\w+)|\$\{(\w+)\}",
                               lambda m: env.get(m.group(1) or m.group(2), ""), value)
        return env

    def user(self):
        return self.stage.user

    def workdir(self):
        return self.stage.workdir

    def command(self, argv, cwd=None):
        """argv as the image's USER, in its WORKDIR (or cwd), with its ENV: the chroot command."""
        user = self.user()
        script = 'cd "$0" && exec "$@"'
        return ["chroot", f"--userspec={user}:{user}", self.path, "/usr/bin/env", "-i"] + [
            f"{k}={v}" for k, v in self.env().items()] + [
            "/bin/sh", "-c", script, cwd or self.workdir()] + argv

    def run(self, argv, cwd=None, timeout=120):
        return subprocess.run(self.command(argv, cwd), capture_output=True, text=True,
                              timeout=timeout)

    def write(self, path, text):
        """A file in the root, owned by the image's user."""
        full = os.path.join(self.path, path.lstrip("/"))
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)
        uid = int(self.user())
        for p in (os.path.dirname(full), full):
            os.chown(p, uid, uid)
        return full


def one_step_job(text):
    """A shipped job cut to one trainer, no spare, no evaluator, max_steps 1 (a learning-rate
    warm-up must end before the last step, so none)."""
    replacements = [(r"replicas: \d+", "replicas: 1"), (r"spares: \d+", "spares: 0"),
                    (r"evaluator: true", "evaluator: false"), (r"max_steps: \d+", "max_steps: 1"),
                    (r"warmup_steps: \d+", "warmup_steps: 0")]
    for pattern, replacement in replacements:
        text, n = re.subn(r"(?m)^(\s*)" + pattern, r"\g<1>" + replacement, text)
        assert n <= 1, f"{pattern} appears {n} times"
    return text


class ImageChrootTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.roots = []
        cls.work = None
        if os.geteuid() != 0:
            raise unittest.SkipTest("not root: chroot and mounts need root")
        debootstrap = shutil.which("debootstrap")
        if debootstrap is None:
            raise unittest.SkipTest("debootstrap is not installed (tools/setup.sh installs it)")
        sources, mirror = apt_sources()
        try:
            urllib.request.urlopen(f"{mirror}/dists/{SUITE}/Release", timeout=20).read(64)
        except OSError as error:
            raise unittest.SkipTest(f"the Debian mirror {mirror} is unreachable: {error}")
        started = time.time()
        cls.work = tempfile.mkdtemp(prefix="rebound-image-", dir=os.environ.get("TEST_TMPDIR"))
        try:
            base = os.path.join(cls.work, "base")
            os.makedirs(os.path.join(CACHE, "debootstrap"), exist_ok=True)
            log(f"debootstrap --variant=minbase {SUITE} from {mirror}")
            subprocess.run([debootstrap, "--variant=minbase",
                            f"--cache-dir={os.path.join(CACHE, 'debootstrap')}", SUITE, base,
                            mirror], check=True, capture_output=True)
            log(f"base root in {time.time() - started:.0f} s")
            cls.server = Root(base, os.path.join(cls.work, "server"), images.SERVER_IMAGE)
            cls.roots.append(cls.server)
            cls.server.build(sources)
            cls.python = Root(base, os.path.join(cls.work, "python"), images.PYTHON_IMAGE)
            cls.roots.append(cls.python)
            cls.python.build(sources)
            shutil.rmtree(base)
        except BaseException:
            cls.tearDownClass()
            raise
        log(f"both roots built in {time.time() - started:.0f} s")
        with open("VERSION") as f:
            cls.version = f.read().strip()

    @classmethod
    def tearDownClass(cls):
        for root in cls.roots:
            root.unmount()
        if cls.work is None:
            return
        left = mounts_under(cls.work)
        if left:
            # Never remove a tree with a mount inside: it would reach into the host.
            print(f"image_chroot_test: {cls.work} left in place, still mounted: {left}")
            return
        shutil.rmtree(cls.work, ignore_errors=True)

    def start_server(self, job_text, name):
        """rebound_server in the server root on 127.0.0.1:<any>, the job `job_text`; returns
        (process, port)."""
        directory = f"/var/lib/rebound/{name}"
        self.server.write(f"{directory}/job.pbtxt", job_text)
        self.server.write(f"{directory}/server.pbtxt",
                          'listen_address: "127.0.0.1:0"\njob_file: "job.pbtxt"\n'
                          f'durability {{\n  data_dir: "{directory}/data"\n  fsync: true\n}}\n')
        port_file = os.path.join(self.server.path, directory.lstrip("/"), "port")
        process = subprocess.Popen(
            self.server.command(["rebound_server", "--config=server.pbtxt", "--port_file=port"],
                                cwd=directory),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.addCleanup(self.stop, process)
        deadline = time.time() + 60
        port = ""
        while not port:
            if process.poll() is not None:
                self.fail(f"the server exited {process.returncode}: {process.stdout.read()}")
            self.assertLess(time.time(), deadline, "the server wrote no port in 60 s")
            time.sleep(0.2)
            if os.path.exists(port_file):
                with open(port_file) as f:
                    port = f.read().strip()
        return process, int(port)

    @staticmethod
    def stop(process):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def status(self, port):
        result = self.server.run(["reboundctl", f"--server=127.0.0.1:{port}", "--output=json",
                                  "status"])
        self.assertEqual(result.returncode, 0, result.stderr)
        return json.loads(result.stdout)

    def assert_finished_after_one_step(self, status, job_id):
        self.assertEqual(status["job_id"], job_id)
        [slot] = status["slots"]
        self.assertEqual(slot["state"], "FINISHED", slot)
        self.assertEqual(slot["step"], "1")
        [center] = status["centers"]
        self.assertEqual(center["version"], "1")
        self.assertEqual(status["server_version"], f"rebound {self.version} (commit unknown)")

    def test_the_server_image_runs_every_binary_it_ships(self):
        for binary in ("rebound_server", "rebound_worker", "reboundctl"):
            result = self.server.run([binary, "--version"])
            self.assertEqual(result.returncode, 0, f"{binary}: {result.stdout}{result.stderr}")
            self.assertIn(f"rebound {self.version} (commit ", result.stdout + result.stderr,
                          binary)
        # deploy/k8s/etcd.yaml runs /usr/bin/etcd from this image.
        result = self.server.run(["/usr/bin/etcd", "--version"])
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertRegex(result.stdout, r"etcd Version: 3\.")

    def test_a_one_step_job_runs_in_the_server_image(self):
        with open("configs/job.pbtxt") as f:
            job = one_step_job(f.read())
        server, port = self.start_server(job, "cpp-job")
        with open("configs/worker.pbtxt") as f:
            self.server.write("/var/lib/rebound/cpp-job/worker.pbtxt", f.read())
        worker = self.server.run(["rebound_worker", "--config=worker.pbtxt",
                                  f"--server=127.0.0.1:{port}", "--role=trainer"],
                                 cwd="/var/lib/rebound/cpp-job", timeout=180)
        self.assertEqual(worker.returncode, 0, worker.stdout + worker.stderr)
        self.assert_finished_after_one_step(self.status(port), "fashion-mnist-local")
        server.send_signal(signal.SIGTERM)
        self.assertEqual(server.wait(timeout=30), 0)

    def test_the_python_image_imports_rebound_torch_as_its_user(self):
        result = self.python.run(["python3", "-c",
                                  "import rebound, rebound.torch, rebound_pb.rebound_pb2, torch; "
                                  "print(rebound.__version__, rebound.torch.__file__, "
                                  "torch.__version__)"], cwd="/")
        self.assertEqual(result.returncode, 0, result.stderr)
        version, path, torch_version = result.stdout.split()
        self.assertEqual(version, self.version)
        self.assertEqual(path, "/opt/rebound/python/rebound/torch/__init__.py")
        self.assertRegex(torch_version, r"^1\.13")   # Debian 12's python3-torch
        result = self.python.run(["python3", "-m", "rebound", "--version"])
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout.strip(), f"rebound {self.version} (commit unknown)")

    def test_a_python_trainer_of_the_python_image_runs_a_one_step_job(self):
        # What a deploy/k8s-python trainer pod runs: its script (the ConfigMap rebound-script,
        # mounted at /opt/rebound/script), its worker.pbtxt and its job, cut to one step; only
        # the server's address differs.
        with open("deploy/k8s-python/config/job.pbtxt") as f:
            job = one_step_job(f.read())
        server, port = self.start_server(job, "torch-job")
        with open("deploy/k8s-python/script/train.py") as f:
            self.python.write("/opt/rebound/script/train.py", f.read())
        with open("deploy/k8s-python/config/worker.pbtxt") as f:
            self.python.write("/etc/rebound/worker.pbtxt", f.read())
        trainer = self.python.run(
            ["/usr/bin/python3", "/opt/rebound/script/train.py",
             "--config=/etc/rebound/worker.pbtxt", f"--server=127.0.0.1:{port}",
             "--name=rebound-trainer-0", "--train-limit=640"], timeout=300)
        self.assertEqual(trainer.returncode, 0, trainer.stdout + trainer.stderr)
        self.assert_finished_after_one_step(self.status(port), "fashion-mnist-torch-cluster")
        server.send_signal(signal.SIGTERM)
        self.assertEqual(server.wait(timeout=30), 0)

if __name__ == "__main__":
    unittest.main(verbosity=2)
