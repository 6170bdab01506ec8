"""deploy/ agrees with the binaries, the configs and itself.

Kubernetes (deploy/k8s): every manifest parses; the containers run the binaries where
deploy/Dockerfile puts them, with flags those binaries define (the DEFINE_ flags of
server/main.cc, worker/main.cc; etcd's from `etcd --help`) and --config paths that the ConfigMap
provides; ports, probes, the data volumes and the topology agree between the manifests and the
configs; the server group (a StatefulSet of 1 + replication.standbys members, only the leader
ready, the workers' Service routing to it) is coordinated by the etcd StatefulSet its config
names; the init containers that give a worker its pod IP as peer address and a server member its
pod IP as advertised host really write those configs.

Slurm (deploy/slurm/rebound.sbatch): it passes `bash -n`, passes only flags the binaries (and
etcd) define, names configs that exist, and, run under stand-ins for srun, scontrol, etcd and the
binaries, starts the server on the first node and the workers on the others, restarts a server
that dies and a worker that is fenced, and stops the workers before the server; with
REBOUND_STANDBYS, starts etcd on the first nodes (or uses given endpoints) and one member per
node, gives the workers every member's address, restarts a member that dies, and stops etcd
last; with REBOUND_SHARD_GROUPS, starts one server (or group) per shard group on the first
nodes, each config with its shard block naming every group, the job with sharding.groups, and
refuses a count that disagrees with the job or the allocation.

Kubernetes, sharded (deploy/k8s-sharded, an overlay of deploy/k8s): one StatefulSet and Services
per shard group beyond group 0's; every group's config names every group's Service in the same
order, its own group and its own etcd keys; the overlay's configs equal the base's but for the
sharding; each group's StatefulSet is group 0's but for its names, labels and config; and,
where kubectl is installed, `kubectl kustomize` builds what this test reads.

Kubernetes, Python workers (deploy/k8s-python, an overlay of deploy/k8s): only the trainers',
spares' and evaluator's pod specs change, keeping their counts and labels; they run
/usr/bin/python3 on the user's script (the ConfigMap rebound-script) from the image of
deploy/Dockerfile.python, as its user, with the ConfigMap's configs mounted where the flags name
them; the shipped script runs the example the image copies, and the example's own argument parser
hands rebound.torch.run the server, name, config and role each workload means; the Python client
loads the worker config; the job is configs/torch_job.pbtxt but for its id, spares and reconnect
grace, and agrees with the workloads and the example's batch size and tau.
"""

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import unittest

import yaml

import images

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(ROOT, "deploy", "k8s")
K8S_SHARDED = os.path.join(ROOT, "deploy", "k8s-sharded")
K8S_PYTHON = os.path.join(ROOT, "deploy", "k8s-python")
SBATCH = os.path.join(ROOT, "deploy", "slurm", "rebound.sbatch")
SUPERVISE = os.path.join(ROOT, "deploy", "slurm", "supervise-worker.sh")

SERVER_BIN = "/opt/rebound/server/rebound_server"
WORKER_BIN = "/opt/rebound/worker/rebound_worker"
ETCD_BIN = "/usr/bin/etcd"   # Debian's etcd-server, installed by tools/setup.sh and the image


def read(path):
    """A file's text; relative paths are the repository's."""
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def defined_flags(source):
    """The gflags a main.cc defines: DEFINE_string(config, ...) -> "config"."""
    return set(re.findall(r"^DEFINE_\w+\((\w+),", read(source), re.M))


FLAGS = {
    "rebound_server": defined_flags("server/main.cc"),
    "rebound_worker": defined_flags("worker/main.cc"),
    "reboundctl": defined_flags("tools/reboundctl.cc"),
}


def parse_pbtxt(text):
    """A protobuf text file as {"dotted.field": [values]} (scalars only, strings unquoted)."""
    tokens = re.findall(r'"(?:[^"\\]|\\.)*"|#[^\n]*|[{}:]|[^\s{}:"#]+', text)
    tokens = [t for t in tokens if not t.startswith("#")]
    fields, path, i = {}, [], 0
    while i < len(tokens):
        token = tokens[i]
        if token == "}":
            path.pop()
            i += 1
        elif tokens[i + 1] == "{":
            path.append(token)
            i += 2
        elif tokens[i + 1] == ":" and tokens[i + 2] == "{":
            path.append(token)
            i += 3
        else:
            assert tokens[i + 1] == ":", f"unexpected {tokens[i + 1]!r} after {token!r}"
            value = tokens[i + 2]
            if value.startswith('"'):
                value = value[1:-1]
            fields.setdefault(".".join(path + [token]), []).append(value)
            i += 3
    assert not path, f"unclosed {path}"
    return fields


def one(fields, name, default=None):
    values = fields.get(name)
    if values is None:
        return default
    assert len(values) == 1, f"{name} set {len(values)} times"
    return values[0]


def split_flags(args):
    """["--config=/x", "--role", "spare"] -> [("config", "/x"), ("role", "spare")]."""
    flags, i = [], 0
    while i < len(args):
        arg = args[i]
        assert arg.startswith("--"), f"positional argument {arg!r}"
        if "=" in arg:
            name, value = arg[2:].split("=", 1)
        else:
            name, value = arg[2:], (args[i + 1] if i + 1 < len(args) else "")
            i += 1
        flags.append((name, value))
        i += 1
    return flags


def load_kustomization(root=K8S):
    with open(os.path.join(root, "kustomization.yaml")) as f:
        return yaml.safe_load(f)


def load_manifests(root=K8S):
    """{(kind, name): object} over the kustomization's resources; a resource that is a directory
    is a base (its own kustomization), as kustomize reads it."""
    objects = {}
    for resource in load_kustomization(root)["resources"]:
        path = os.path.normpath(os.path.join(root, resource))
        if os.path.isdir(path):
            objects.update(load_manifests(path))
            continue
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def pod_spec(workload):
    return workload["spec"]["template"]["spec"]


def etcd_flags():
    """The flags `etcd --help` lists: "--initial-cluster ''" -> "initial-cluster"."""
    assert os.access(ETCD_BIN, os.X_OK), f"{ETCD_BIN} is missing: run tools/setup.sh"
    result = subprocess.run([ETCD_BIN, "--help"], capture_output=True, text=True, timeout=30)
    return set(re.findall(r"^\s+--([a-z0-9-]+)", result.stdout + result.stderr, re.M))


def config_map_files(root=K8S):
    """The ConfigMap generators' files: {name: {key: path}}, a base's first, then the overlay's
    (behavior merge: its keys replace or add to the base's)."""
    maps = {}
    kustomization = load_kustomization(root)
    for resource in kustomization.get("resources", []):
        path = os.path.normpath(os.path.join(root, resource))
        if os.path.isdir(path):
            maps.update(config_map_files(path))
    for generator in kustomization.get("configMapGenerator", []):
        files = {os.path.basename(f): os.path.join(root, f) for f in generator["files"]}
        if generator.get("behavior") == "merge":
            maps.setdefault(generator["name"], {}).update(files)
        else:
            maps[generator["name"]] = files
    return maps


def workloads(objects):
    return {key: obj for key, obj in objects.items()
            if key[0] in ("StatefulSet", "Deployment", "Job")}


def mount_of(container, path):
    """The volumeMount of `container` that holds `path`: (volume name, mountPath)."""
    for mount in container.get("volumeMounts", []):
        if os.path.dirname(path) == mount["mountPath"].rstrip("/"):
            return mount["name"], mount["mountPath"]
    return None, None


def dockerfile_copies():
    """{destination: source} of deploy/Dockerfile's COPY lines."""
    return {dst: src for src, dst in
            re.findall(r"^COPY\s+(\S+)\s+(\S+)\s*$", read("deploy/Dockerfile"), re.M)}


class KubernetesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.objects = load_manifests()
        cls.maps = config_map_files()
        files = cls.maps["rebound-config"]
        cls.job = parse_pbtxt(read(files["job.pbtxt"]))
        cls.server_config = parse_pbtxt(read(files["server.pbtxt"]))
        cls.worker_config = parse_pbtxt(read(files["worker.pbtxt"]))
        cls.server_sts = cls.objects[("StatefulSet", "rebound-server")]
        cls.server_svc = cls.objects[("Service", "rebound-server")]
        cls.peers_svc = cls.objects[("Service", "rebound-server-peers")]
        cls.etcd_sts = cls.objects[("StatefulSet", "rebound-etcd")]
        cls.etcd_svc = cls.objects[("Service", "rebound-etcd")]
        cls.trainers = cls.objects[("Job", "rebound-trainer")]
        cls.spares = cls.objects[("Deployment", "rebound-spare")]
        cls.evaluator = cls.objects[("Job", "rebound-evaluator")]

    def rebound_containers(self):
        """(workload, container, binary) for every container that runs a Rebound binary (all
        but etcd's)."""
        found = []
        for key, workload in workloads(self.objects).items():
            for container in pod_spec(workload)["containers"]:
                if container["command"] == [ETCD_BIN]:
                    continue
                found.append((key, container, os.path.basename(container["command"][0])))
        return found

    def test_every_yaml_file_parses_and_is_deployed(self):
        yamls = sorted(f for f in os.listdir(K8S) if f.endswith((".yaml", ".yml")))
        for name in yamls:
            with open(os.path.join(K8S, name)) as f:
                docs = [d for d in yaml.safe_load_all(f) if d is not None]
            self.assertTrue(docs, name)
            for doc in docs:
                self.assertIn("apiVersion", doc, name)
                self.assertIn("kind", doc, name)
                if doc["kind"] != "Kustomization":
                    self.assertIn("name", doc["metadata"], name)
        resources = load_kustomization()["resources"]
        self.assertEqual(sorted(resources + ["kustomization.yaml"]), yamls)
        for files in self.maps.values():
            for path in files.values():
                self.assertTrue(os.path.isfile(path), path)

    def test_the_manifests_hold_what_the_design_asks_for(self):
        # A server group of three pods (a leader, two standbys) with a headless Service of their
        # own names and a ClusterIP Service for the workers, three etcd members, trainers as an
        # Indexed Job, spares as a Deployment, one evaluator, the configs in one ConfigMap.
        self.assertEqual(self.server_sts["spec"]["replicas"], 3)
        self.assertEqual(self.peers_svc["spec"]["clusterIP"], "None")
        self.assertNotIn("clusterIP", self.server_svc["spec"])   # a virtual IP: ready pods only
        self.assertNotIn("publishNotReadyAddresses", self.server_svc["spec"])
        self.assertEqual(self.etcd_sts["spec"]["replicas"], 3)
        self.assertEqual(self.etcd_svc["spec"]["clusterIP"], "None")
        self.assertEqual(self.trainers["spec"]["completionMode"], "Indexed")
        self.assertEqual(list(self.maps), ["rebound-config"])
        self.assertEqual(sorted(f"{kind}/{name}" for kind, name in self.objects),
                         ["Deployment/rebound-spare", "Job/rebound-evaluator",
                          "Job/rebound-trainer", "PodDisruptionBudget/rebound-etcd",
                          "Service/rebound-etcd", "Service/rebound-server",
                          "Service/rebound-server-peers", "StatefulSet/rebound-etcd",
                          "StatefulSet/rebound-server"])

    def test_every_container_runs_the_image_built_by_the_dockerfile(self):
        self.assertRegex(read("deploy/Dockerfile"), r"(?m)^FROM debian:12\s*$")
        # etcd.yaml runs Debian's etcd from the same image.
        self.assertRegex(read("deploy/Dockerfile"), r"(?m)^\s+etcd-server \\$")
        images = {i["name"]: i for i in load_kustomization()["images"]}
        self.assertEqual(images["rebound"].get("newTag"), "latest")
        for key, workload in workloads(self.objects).items():
            spec = pod_spec(workload)
            for container in spec["containers"] + spec.get("initContainers", []):
                self.assertEqual(container["image"], "rebound:latest", key)

    def test_containers_run_the_binaries_where_the_dockerfile_copies_them(self):
        copies = dockerfile_copies()
        # The image's layout under /opt/rebound is bazel-bin's: //server:rebound_server at
        # server/rebound_server, and so on, binaries whose flags FLAGS read from their sources.
        for dst, src in copies.items():
            self.assertEqual(dst, "/opt/rebound/" + src)
            self.assertIn(os.path.basename(src), FLAGS)
        self.assertEqual(set(copies),
                         {SERVER_BIN, WORKER_BIN, "/opt/rebound/tools/reboundctl"})
        expected = {("StatefulSet", "rebound-server"): SERVER_BIN}
        self.assertEqual(len(self.rebound_containers()), len(workloads(self.objects)) - 1)
        for key, container, _ in self.rebound_containers():
            self.assertEqual(len(container["command"]), 1, key)
            self.assertEqual(container["command"][0], expected.get(key, WORKER_BIN), key)

    def test_every_flag_is_defined_by_its_binary(self):
        for key, container, binary in self.rebound_containers():
            env = {e["name"] for e in container.get("env", [])}
            flags = split_flags(container.get("args", []))
            self.assertIn("config", [name for name, _ in flags], key)
            for name, value in flags:
                self.assertIn(name, FLAGS[binary], f"{key}: --{name} is not a flag of {binary}")
                for var in re.findall(r"\$\((\w+)\)", value):
                    self.assertIn(var, env, f"{key}: --{name} uses $({var}), not in env")

    def test_workers_ask_for_the_roles_of_their_workload(self):
        roles = {}
        for key, container, binary in self.rebound_containers():
            if binary == "rebound_worker":
                roles[key[1]] = dict(split_flags(container["args"]))["role"]
        # Trainers take free slots and join as spares once none is left (a restarted trainer
        # whose slot a spare rebuilt would be refused as --role=trainer).
        self.assertEqual(roles, {"rebound-trainer": "auto", "rebound-spare": "spare",
                                 "rebound-evaluator": "evaluator"})

    def test_every_config_path_is_provided_by_the_config_map(self):
        files = self.maps["rebound-config"]
        for key, workload in workloads(self.objects).items():
            spec = pod_spec(workload)
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for container in spec["containers"]:
                if container["command"] == [ETCD_BIN]:
                    continue   # flags only
                path = dict(split_flags(container["args"]))["config"]
                volume, mount_path = mount_of(container, path)
                self.assertIsNotNone(volume, f"{key}: nothing mounted at {path}")
                source = volumes[volume]
                if "configMap" in source:
                    self.assertIn(source["configMap"]["name"], self.maps, key)
                    self.assertIn(os.path.basename(path), files, key)
                    continue
                # A config written at start by an init container from the ConfigMap's file.
                self.assertIn("emptyDir", source, key)
                writers = [c for c in spec.get("initContainers", [])
                           if mount_of(c, path)[0] == volume]
                self.assertEqual(len(writers), 1, f"{key}: who writes {path}?")
                script = writers[0]["args"][0]
                self.assertIn("> " + path, script, key)
                config_mounts = [m for m in writers[0]["volumeMounts"]
                                 if "configMap" in volumes[m["name"]]]
                self.assertEqual(len(config_mounts), 1, key)
                template = os.path.join(config_mounts[0]["mountPath"], os.path.basename(path))
                self.assertIn(template, script, key)
                self.assertIn(os.path.basename(template), files, key)
        # The server's job file sits beside its config, in the same ConfigMap; the init container
        # that writes the member's copy of the config copies the job beside it.
        job_file = one(self.server_config, "job_file")
        self.assertIn(job_file, files)
        self.assertIsNone(one(self.server_config, "job"))
        [init] = pod_spec(self.server_sts)["initContainers"]
        self.assertIn(f"cp /etc/rebound/{job_file} /run/rebound/{job_file}", init["args"][0])

    def test_ports_agree_between_configs_services_containers_and_probes(self):
        host, port = one(self.server_config, "listen_address").rsplit(":", 1)
        self.assertEqual(host, "0.0.0.0")
        port = int(port)
        peer_host, server_peer_port = one(
            self.server_config, "replication.peer_listen_address").rsplit(":", 1)
        self.assertEqual(peer_host, "0.0.0.0")
        server_peer_port = int(server_peer_port)
        [container] = pod_spec(self.server_sts)["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        self.assertEqual({k: v for k, v in ports.items() if k != "metrics"},
                         {"grpc": port, "peer": server_peer_port})
        [service_port] = self.server_svc["spec"]["ports"]
        self.assertEqual(service_port["port"], port)
        self.assertEqual(service_port["targetPort"], "grpc")
        self.assertEqual({p["name"]: (p["port"], p["targetPort"])
                          for p in self.peers_svc["spec"]["ports"]},
                         {"grpc": (port, "grpc"), "peer": (server_peer_port, "peer")})
        # Only the leader listens on the workers' port and is SERVING there: the readiness probe
        # (and so the workers' Service) finds the leader. Every member serves its peer port,
        # whatever its role and while it loads: startup and liveness knock there.
        self.assertEqual(container["readinessProbe"],
                         {**container["readinessProbe"], "grpc": {"port": port}})
        for probe in ("startupProbe", "livenessProbe"):
            self.assertEqual(container[probe],
                             {**container[probe], "tcpSocket": {"port": server_peer_port}}, probe)
            self.assertNotIn("grpc", container[probe], f"{probe}: a standby is NOT_SERVING")
        # The members' stable names come from the headless Service; the workers dial the
        # Service that routes to the ready member.
        self.assertEqual(self.server_sts["spec"]["serviceName"], "rebound-server-peers")
        self.assertEqual(one(self.worker_config, "server_address"), f"rebound-server:{port}")
        # The peer port of the worker config is the port the worker pods declare.
        peer_host, peer_port = one(self.worker_config, "peer_listen_address").rsplit(":", 1)
        self.assertEqual(peer_host, "0.0.0.0")
        for workload in (self.trainers, self.spares):
            [worker] = pod_spec(workload)["containers"]
            self.assertEqual({p["name"]: p["containerPort"] for p in worker["ports"]
                              if p["name"] != "metrics"},
                             {"peer": int(peer_port)})

    def test_selectors_match_the_pods(self):
        labels = self.server_sts["spec"]["template"]["metadata"]["labels"]
        self.assertLessEqual(self.server_svc["spec"]["selector"].items(), labels.items())
        self.assertLessEqual(self.peers_svc["spec"]["selector"].items(), labels.items())
        etcd_labels = self.etcd_sts["spec"]["template"]["metadata"]["labels"]
        self.assertLessEqual(self.etcd_svc["spec"]["selector"].items(), etcd_labels.items())
        self.assertFalse(self.etcd_svc["spec"]["selector"].items() <= labels.items())
        self.assertFalse(self.server_svc["spec"]["selector"].items() <= etcd_labels.items())
        pdb = self.objects[("PodDisruptionBudget", "rebound-etcd")]
        self.assertEqual(pdb["spec"]["selector"]["matchLabels"], etcd_labels)
        for workload in (self.server_sts, self.etcd_sts, self.spares):
            self.assertLessEqual(workload["spec"]["selector"]["matchLabels"].items(),
                                 workload["spec"]["template"]["metadata"]["labels"].items())

    def test_the_data_directory_is_on_the_persistent_volume(self):
        data_dir = one(self.server_config, "durability.data_dir")
        self.assertEqual(one(self.server_config, "durability.fsync"), "true")
        [claim] = self.server_sts["spec"]["volumeClaimTemplates"]
        [container] = pod_spec(self.server_sts)["containers"]
        [mount] = [m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
        self.assertTrue(data_dir.startswith(mount["mountPath"].rstrip("/") + "/"), data_dir)
        self.assertIn("storage", claim["spec"]["resources"]["requests"])

    def test_the_group_runs_one_member_per_node_and_never_waits_for_a_standby(self):
        standbys = int(one(self.server_config, "replication.standbys"))
        self.assertEqual(self.server_sts["spec"]["replicas"], 1 + standbys)
        self.assertEqual(one(self.server_config, "replication.sync"), "true")
        # A standby is never ready: neither the pods' start nor an update may wait for it.
        self.assertEqual(self.server_sts["spec"]["podManagementPolicy"], "Parallel")
        self.assertEqual(self.server_sts["spec"]["updateStrategy"], {"type": "OnDelete"})
        self.assertEqual(self.etcd_sts["spec"]["podManagementPolicy"], "Parallel")
        for sts in (self.server_sts, self.etcd_sts):
            spec = pod_spec(sts)
            [term] = spec["affinity"]["podAntiAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"]
            self.assertEqual(term["topologyKey"], "kubernetes.io/hostname")
            self.assertEqual(term["labelSelector"]["matchLabels"],
                             sts["spec"]["template"]["metadata"]["labels"])
        # Each member its own name (--name) and its own volume.
        [container] = pod_spec(self.server_sts)["containers"]
        self.assertEqual(dict(split_flags(container["args"]))["name"], "$(POD_NAME)")
        self.assertIsNone(one(self.server_config, "replication.name"))
        self.assertEqual({e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
                          for e in container["env"]}, {"POD_NAME": "metadata.name"})

    def test_the_group_is_coordinated_by_the_etcd_of_the_manifests(self):
        sts, svc = self.etcd_sts["metadata"]["name"], self.etcd_svc["metadata"]["name"]
        self.assertEqual(self.etcd_sts["spec"]["serviceName"], svc)
        self.assertTrue(self.etcd_svc["spec"]["publishNotReadyAddresses"])
        members = [f"{sts}-{i}" for i in range(self.etcd_sts["spec"]["replicas"])]
        ports = {p["name"]: p["port"] for p in self.etcd_svc["spec"]["ports"]}
        self.assertEqual(self.server_config["replication.etcd_endpoints"],
                         [f"{m}.{svc}:{ports['client']}" for m in members])
        [container] = pod_spec(self.etcd_sts)["containers"]
        self.assertEqual(container["command"], [ETCD_BIN])
        self.assertEqual({p["name"]: p["containerPort"] for p in container["ports"]}, ports)
        flags = dict(split_flags(container["args"]))
        known = etcd_flags()
        for name in flags:
            self.assertIn(name, known, f"--{name} is not a flag of etcd")
        self.assertEqual(flags["name"], "$(POD_NAME)")
        self.assertEqual(flags["initial-cluster"],
                         ",".join(f"{m}=http://{m}.{svc}:{ports['peer']}" for m in members))
        self.assertEqual(flags["initial-advertise-peer-urls"],
                         f"http://$(POD_NAME).{svc}:{ports['peer']}")
        self.assertEqual(flags["advertise-client-urls"],
                         f"http://$(POD_NAME).{svc}:{ports['client']}")
        self.assertEqual(flags["listen-client-urls"], f"http://0.0.0.0:{ports['client']}")
        self.assertEqual(flags["listen-peer-urls"], f"http://0.0.0.0:{ports['peer']}")
        self.assertEqual(flags["initial-cluster-state"], "new")
        self.assertEqual({e["name"] for e in container["env"]}, {"POD_NAME"})
        # Its data on its own volume, below the mount point.
        [claim] = self.etcd_sts["spec"]["volumeClaimTemplates"]
        [mount] = [m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
        self.assertTrue(flags["data-dir"].startswith(mount["mountPath"].rstrip("/") + "/"))
        self.assertEqual(container["readinessProbe"]["httpGet"],
                         {"path": "/health", "port": ports["client"]})

    def test_the_init_container_gives_each_member_its_pod_ip_as_advertised_host(self):
        files = self.maps["rebound-config"]
        [init] = pod_spec(self.server_sts)["initContainers"]
        self.assertEqual(init["command"], ["/bin/sh", "-c"])
        self.assertEqual([e["valueFrom"]["fieldRef"]["fieldPath"] for e in init["env"]],
                         ["status.podIP"])
        script = init["args"][0]
        for pod_ip, host in (("10.244.2.9", "10.244.2.9"), ("fd00:10:244::9", "[fd00:10:244::9]")):
            with tempfile.TemporaryDirectory() as tmp:
                local = script
                for mount in init["volumeMounts"]:
                    here = os.path.join(tmp, mount["name"])
                    os.makedirs(here)
                    local = local.replace(mount["mountPath"], here)
                for name in ("server.pbtxt", "job.pbtxt"):
                    with open(files[name]) as src, \
                            open(os.path.join(tmp, "config", name), "w") as dst:
                        dst.write(src.read())
                subprocess.run(["/bin/sh", "-c", local], check=True,
                               env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                    "POD_IP": pod_ip})
                with open(os.path.join(tmp, "run", "server.pbtxt")) as f:
                    rendered = parse_pbtxt(f.read())
                with open(os.path.join(tmp, "run", "job.pbtxt")) as f:
                    self.assertEqual(f.read(), read(files["job.pbtxt"]))
            self.assertEqual(one(rendered, "replication.advertise_host"), host)
            # Nothing else changes.
            self.assertEqual({k: v for k, v in rendered.items()
                              if k != "replication.advertise_host"},
                             {k: v for k, v in self.server_config.items()
                              if k != "replication.advertise_host"})

    def test_the_workers_retry_fast_enough_for_a_failover_and_long_enough_for_an_outage(self):
        self.assertLessEqual(int(one(self.worker_config, "backoff_max_ms")), 500)
        self.assertGreaterEqual(int(one(self.worker_config, "give_up_after_ms")), 600000)

    def test_every_rebound_pod_serves_metrics_where_its_annotations_and_the_podmonitor_look(self):
        configs = {"server": self.server_config, "worker": self.worker_config}
        ports = {}
        for name, config in configs.items():
            self.assertEqual(one(config, "metrics.enabled", "true"), "true", name)
            self.assertEqual(one(config, "metrics.bind_address"), "0.0.0.0", name)
            ports[name] = int(one(config, "metrics.port"))
        self.assertNotEqual(ports["server"], ports["worker"])
        pods = {"server": [self.server_sts],
                "worker": [self.trainers, self.spares, self.evaluator]}
        components = {}
        for name, workloads_of in pods.items():
            for workload in workloads_of:
                template = workload["spec"]["template"]
                annotations = template["metadata"]["annotations"]
                where = workload["metadata"]["name"]
                self.assertEqual(annotations["prometheus.io/scrape"], "true", where)
                self.assertEqual(annotations["prometheus.io/port"], str(ports[name]), where)
                self.assertEqual(annotations["prometheus.io/path"], "/metrics", where)
                [container] = [c for c in template["spec"]["containers"]
                               if c["command"] != [ETCD_BIN]]
                declared = {p["name"]: p["containerPort"] for p in container["ports"]}
                self.assertEqual(declared["metrics"], ports[name], where)
                components.setdefault(name, set()).add(
                    template["metadata"]["labels"]["app.kubernetes.io/component"])
        # The Prometheus Operator's PodMonitors: the same pods, port "metrics", the job names the
        # alert rules use.
        with open(os.path.join(ROOT, "deploy", "prometheus", "podmonitor.yaml")) as f:
            monitors = {d["metadata"]["name"]: d for d in yaml.safe_load_all(f) if d}
        self.assertEqual(set(monitors), {"rebound-server", "rebound-worker"})
        for name, monitor in monitors.items():
            role = name.split("-", 1)[1]
            self.assertEqual(monitor["kind"], "PodMonitor")
            selected = {e["key"]: set(e["values"])
                        for e in monitor["spec"]["selector"]["matchExpressions"]
                        if e["operator"] == "In"}
            self.assertEqual(selected["app.kubernetes.io/name"], {"rebound"}, name)
            self.assertLessEqual(components[role], selected["app.kubernetes.io/component"], name)
            [endpoint] = monitor["spec"]["podMetricsEndpoints"]
            self.assertEqual(endpoint["port"], "metrics", name)
            self.assertEqual(endpoint["path"], "/metrics", name)
            self.assertIn({"targetLabel": "job", "replacement": name}, endpoint["relabelings"],
                          name)
        # The servers' job name is the one the alert rules and the dashboard query; the workers'
        # that of deploy/prometheus/prometheus.yml.
        with open(os.path.join(ROOT, "deploy", "prometheus", "alerts.yml")) as f:
            self.assertIn('job="rebound-server"', f.read())
        with open(os.path.join(ROOT, "deploy", "prometheus", "prometheus.yml")) as f:
            scrape = yaml.safe_load(f)
        self.assertEqual({j["job_name"] for j in scrape["scrape_configs"]}, set(monitors))

    def test_the_jobs_replace_a_worker_only_on_the_exit_codes_a_restart_can_fix(self):
        # docs/operations.md's table: "restart it" on 3, "check the server" on 4; every other
        # non-zero code would come back the same.
        table = {}
        with open(os.path.join("docs", "operations.md")) as f:
            for line in f:
                m = re.match(r"^\| (\d) \| .* \| (.*) \|$", line.strip())
                if m:
                    table[int(m.group(1))] = m.group(2)
        self.assertEqual(sorted(table), [0, 1, 2, 3, 4, 5])
        restarted = {3, 4}
        for code in restarted:
            self.assertNotIn("do not restart", table[code])
        self.assertIn("do not restart", table[2])
        for job in (self.trainers, self.evaluator):
            name = job["metadata"]["name"]
            self.assertEqual(pod_spec(job)["restartPolicy"], "Never", name)
            rules = job["spec"]["podFailurePolicy"]["rules"]
            fail = [r for r in rules if r["action"] == "FailJob"]
            self.assertEqual(len(fail), 1, name)
            self.assertEqual(fail[0]["onExitCodes"]["operator"], "In", name)
            self.assertEqual(fail[0]["onExitCodes"]["containerName"], "worker", name)
            self.assertEqual(set(fail[0]["onExitCodes"]["values"]),
                             set(table) - restarted - {0}, name)
            self.assertIn({"action": "Ignore",
                           "onPodConditions": [{"type": "DisruptionTarget"}]}, rules, name)
            self.assertIn("worker", [c["name"] for c in pod_spec(job)["containers"]], name)
            self.assertGreater(job["spec"]["backoffLimit"], 0, name)

    def test_the_workloads_match_the_jobs_topology(self):
        slots = int(one(self.job, "topology.replicas", "1")) * int(
            one(self.job, "topology.stages", "1"))
        self.assertEqual(self.trainers["spec"]["completions"], slots)
        self.assertEqual(self.trainers["spec"]["parallelism"], slots)
        self.assertEqual(self.spares["spec"]["replicas"], int(one(self.job, "topology.spares")))
        self.assertEqual(one(self.job, "topology.evaluator"), "true")
        self.assertEqual(self.evaluator["spec"]["completions"], 1)
        self.assertEqual(one(self.worker_config, "job_id"), one(self.job, "job_id"))
        self.assertGreater(int(one(self.job, "topology.spares")), 0)

    def test_the_init_containers_give_each_worker_its_pod_ip_as_peer_address(self):
        template = self.maps["rebound-config"]["worker.pbtxt"]
        with open(template) as f:
            original = f.read()
        port = one(self.worker_config, "peer_listen_address").rsplit(":", 1)[1]
        scripts = set()
        for workload in (self.trainers, self.spares):
            [init] = pod_spec(workload)["initContainers"]
            self.assertEqual(init["command"], ["/bin/sh", "-c"])
            self.assertEqual([e["valueFrom"]["fieldRef"]["fieldPath"] for e in init["env"]],
                             ["status.podIP"])
            scripts.add(init["args"][0])
        self.assertEqual(len(scripts), 1, "the trainers and spares render the same way")
        [script] = scripts
        [init] = pod_spec(self.trainers)["initContainers"]
        for pod_ip, host in (("10.244.1.7", "10.244.1.7"), ("fd00:10:244::7", "[fd00:10:244::7]")):
            with tempfile.TemporaryDirectory() as tmp:
                local = script
                for mount in init["volumeMounts"]:
                    here = os.path.join(tmp, mount["name"])
                    os.makedirs(here)
                    local = local.replace(mount["mountPath"], here)
                with open(os.path.join(tmp, "config", "worker.pbtxt"), "w") as f:
                    f.write(original)
                subprocess.run(["/bin/sh", "-c", local], check=True,
                               env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                    "POD_IP": pod_ip})
                with open(os.path.join(tmp, "run", "worker.pbtxt")) as f:
                    rendered = f.read()
            fields = parse_pbtxt(rendered)
            self.assertEqual(one(fields, "peer_listen_address"), f"{host}:{port}")
            # Nothing else changes.
            self.assertEqual({k: v for k, v in fields.items() if k != "peer_listen_address"},
                             {k: v for k, v in self.worker_config.items()
                              if k != "peer_listen_address"})


class ShardedKubernetesTest(unittest.TestCase):
    """deploy/k8s-sharded: the base's job with its center sharded across the overlay's groups."""

    @classmethod
    def setUpClass(cls):
        cls.kustomization = load_kustomization(K8S_SHARDED)
        cls.objects = load_manifests(K8S_SHARDED)
        cls.base_objects = load_manifests(K8S)
        cls.files = config_map_files(K8S_SHARDED)["rebound-config"]
        cls.base_files = config_map_files(K8S)["rebound-config"]
        cls.job = parse_pbtxt(read(cls.files["job.pbtxt"]))
        cls.groups = int(one(cls.job, "sharding.groups"))
        # Group g: its StatefulSet, its Services and the config its members run.
        cls.sts, cls.svc, cls.peers, cls.config_key = [], [], [], []
        for g in range(cls.groups):
            name = "rebound-server" if g == 0 else f"rebound-server-g{g}"
            cls.sts.append(cls.objects[("StatefulSet", name)])
            cls.svc.append(cls.objects[("Service", name)])
            cls.peers.append(cls.objects[("Service", f"{name}-peers")])
            cls.config_key.append("server.pbtxt" if g == 0 else f"server-g{g}.pbtxt")
        cls.configs = [parse_pbtxt(read(cls.files[key])) for key in cls.config_key]

    def test_the_overlay_is_the_base_plus_one_statefulset_and_two_services_per_group(self):
        self.assertEqual(self.kustomization["resources"][0], "../k8s")
        self.assertGreaterEqual(self.groups, 2)
        added = set(self.objects) - set(self.base_objects)
        self.assertEqual(added, {(kind, f"rebound-server-g{g}{suffix}")
                                 for g in range(1, self.groups)
                                 for kind, suffix in (("StatefulSet", ""), ("Service", ""),
                                                      ("Service", "-peers"))})
        self.assertEqual(len([k for k in self.objects if k[0] == "StatefulSet"]),
                         self.groups + 1)   # + etcd
        [generator] = self.kustomization["configMapGenerator"]
        self.assertEqual(generator["name"], "rebound-config")
        self.assertEqual(generator["behavior"], "merge")
        self.assertEqual(set(self.files), {"job.pbtxt", "worker.pbtxt"} | set(self.config_key))
        self.assertEqual(self.files["worker.pbtxt"], self.base_files["worker.pbtxt"])
        # The workers are the base's: they dial group 0 and learn the others at registration.
        for key in self.objects:
            if key[0] in ("Job", "Deployment"):
                self.assertEqual(self.objects[key], self.base_objects[key], key)

    def test_every_group_names_every_groups_service_in_order_and_its_own_group(self):
        port = int(one(self.configs[0], "listen_address").rsplit(":", 1)[1])
        expected = []
        for g in range(self.groups):
            [service_port] = self.svc[g]["spec"]["ports"]
            self.assertEqual(service_port["port"], port)
            self.assertNotIn("clusterIP", self.svc[g]["spec"])   # a virtual IP: the leader only
            expected.append(f"{self.svc[g]['metadata']['name']}:{port}")
        for g, config in enumerate(self.configs):
            self.assertEqual(config["shard.group_addresses"], expected, self.config_key[g])
            self.assertEqual(one(config, "shard.group"), str(g), self.config_key[g])
        # Each group elects its own leader under its own etcd keys, in the one etcd.
        self.assertEqual([one(c, "replication.group") for c in self.configs],
                         [str(g) for g in range(self.groups)])
        for config in self.configs:
            self.assertEqual(config["replication.etcd_endpoints"],
                             self.configs[0]["replication.etcd_endpoints"])
        # The workers dial group 0's Service, the first entry.
        worker = parse_pbtxt(read(self.files["worker.pbtxt"]))
        self.assertEqual(one(worker, "server_address"), expected[0])

    def test_each_group_runs_its_own_config_with_its_own_size(self):
        for g in range(self.groups):
            spec = pod_spec(self.sts[g])
            [init] = spec["initContainers"]
            script = init["args"][0]
            self.assertIn(f"/etc/rebound/{self.config_key[g]} > /run/rebound/server.pbtxt",
                          script)
            self.assertIn("cp /etc/rebound/job.pbtxt /run/rebound/job.pbtxt", script)
            [container] = spec["containers"]
            self.assertEqual(dict(split_flags(container["args"]))["config"],
                             "/run/rebound/server.pbtxt")
            self.assertEqual(self.sts[g]["spec"]["replicas"],
                             1 + int(one(self.configs[g], "replication.standbys")))
            self.assertEqual(one(self.configs[g], "job_file"), "job.pbtxt")

    def test_each_groups_services_and_anti_affinity_select_its_own_pods_only(self):
        labels = [sts["spec"]["template"]["metadata"]["labels"] for sts in self.sts]
        for g in range(self.groups):
            self.assertEqual(self.sts[g]["spec"]["serviceName"],
                             self.peers[g]["metadata"]["name"])
            self.assertEqual(self.peers[g]["spec"]["clusterIP"], "None")
            term = pod_spec(self.sts[g])["affinity"]["podAntiAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"][0]
            for selector in (self.svc[g]["spec"]["selector"], self.peers[g]["spec"]["selector"],
                             self.sts[g]["spec"]["selector"]["matchLabels"],
                             term["labelSelector"]["matchLabels"]):
                for h in range(self.groups):
                    self.assertEqual(selector.items() <= labels[h].items(), g == h, (g, h))

    def test_each_group_is_group_0_but_for_its_names_labels_and_config(self):
        def renamed(obj, g):
            text = yaml.safe_dump(obj, sort_keys=True)
            text = text.replace(f"rebound-server-g{g}", "rebound-server")
            text = text.replace(f"component: server-g{g}", "component: server")
            text = text.replace(f"/etc/rebound/server-g{g}.pbtxt", "/etc/rebound/server.pbtxt")
            return yaml.safe_load(text)
        for g in range(1, self.groups):
            for kind, i in (("StatefulSet", self.sts), ("Service", self.svc),
                            ("Service", self.peers)):
                self.assertEqual(renamed(i[g], g), i[0], (kind, g))

    def test_the_overlays_configs_are_the_bases_but_for_the_sharding(self):
        base_job = parse_pbtxt(read(self.base_files["job.pbtxt"]))
        self.assertEqual({k: v for k, v in self.job.items() if not k.startswith("sharding.")},
                         base_job)
        base_server = parse_pbtxt(read(self.base_files["server.pbtxt"]))
        for g, config in enumerate(self.configs):
            self.assertEqual({k: v for k, v in config.items()
                              if not k.startswith("shard.") and k != "replication.group"},
                             {k: v for k, v in base_server.items() if k != "replication.group"},
                             self.config_key[g])

    def test_the_init_container_renders_each_groups_config_with_the_pod_ip(self):
        for g in range(self.groups):
            [init] = pod_spec(self.sts[g])["initContainers"]
            with tempfile.TemporaryDirectory() as tmp:
                local = init["args"][0]
                for mount in init["volumeMounts"]:
                    here = os.path.join(tmp, mount["name"])
                    os.makedirs(here)
                    local = local.replace(mount["mountPath"], here)
                for name in (self.config_key[g], "job.pbtxt"):
                    with open(self.files[name]) as src, \
                            open(os.path.join(tmp, "config", name), "w") as dst:
                        dst.write(src.read())
                subprocess.run(["/bin/sh", "-c", local], check=True,
                               env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                    "POD_IP": "10.244.3.4"})
                with open(os.path.join(tmp, "run", "server.pbtxt")) as f:
                    rendered = parse_pbtxt(f.read())
            self.assertEqual(one(rendered, "replication.advertise_host"), "10.244.3.4")
            self.assertEqual(one(rendered, "shard.group"), str(g))

    def test_kubectl_kustomize_builds_what_this_test_reads(self):
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            self.skipTest("kubectl is not installed (it is no Debian package here)")
        # A copy: kustomize does not take the symlinks of Bazel's runfiles for files.
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(os.path.join(ROOT, "deploy"), os.path.join(tmp, "deploy"))
            result = subprocess.run([kubectl, "kustomize", os.path.join(tmp, "deploy",
                                                                        "k8s-sharded")],
                                    capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 0, result.stderr)
        built = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(result.stdout)}
        config_map = built.pop(("ConfigMap", "rebound-config"))
        self.assertEqual(set(built), set(self.objects))
        for key, obj in self.objects.items():
            self.assertEqual(built[key]["spec"], obj["spec"], key)
        self.assertEqual(config_map["data"], {key: read(path) for key, path in self.files.items()})


def apply_json_patches(objects, root):
    """The kustomization's `patches` at `root` applied to `objects`: JSON patches (RFC 6902) of
    op "replace" or "remove" at a path, the kinds deploy/ uses (anything else fails here); as
    RFC 6902 says, the path must exist."""
    objects = json.loads(json.dumps({f"{k[0]}/{k[1]}": v for k, v in objects.items()}))
    for patch in load_kustomization(root).get("patches", []):
        target = patch["target"]
        obj = objects[f"{target['kind']}/{target['name']}"]
        with open(os.path.join(root, patch["path"])) as f:
            operations = yaml.safe_load(f)
        for operation in operations:
            assert operation["op"] in ("replace", "remove"), operation["op"]
            *parents, last = operation["path"].lstrip("/").split("/")
            node = obj
            for key in parents:
                node = node[key]
            assert last in node, f"{operation['op']} of {operation['path']}: nothing there"
            if operation["op"] == "remove":
                del node[last]
            else:
                node[last] = operation["value"]
    return {tuple(k.split("/", 1)): v for k, v in objects.items()}


PYTHON_COMMAND = ["/usr/bin/python3", "/opt/rebound/script/train.py"]


class PythonKubernetesTest(unittest.TestCase):
    """deploy/k8s-python: the base's job with the trainers, spares and evaluator running the
    user's script (script/train.py, a ConfigMap) from the image of deploy/Dockerfile.python."""

    @classmethod
    def setUpClass(cls):
        cls.kustomization = load_kustomization(K8S_PYTHON)
        cls.base_objects = load_manifests(K8S)
        cls.objects = apply_json_patches(load_manifests(K8S_PYTHON), K8S_PYTHON)
        maps = config_map_files(K8S_PYTHON)
        cls.files = maps["rebound-config"]
        cls.script_files = maps["rebound-script"]
        cls.base_files = config_map_files(K8S)["rebound-config"]
        cls.job = parse_pbtxt(read(cls.files["job.pbtxt"]))
        cls.worker_config = parse_pbtxt(read(cls.files["worker.pbtxt"]))
        cls.workers = {"trainer": cls.objects[("Job", "rebound-trainer")],
                       "spare": cls.objects[("Deployment", "rebound-spare")],
                       "evaluator": cls.objects[("Job", "rebound-evaluator")]}

    def container(self, role):
        [container] = pod_spec(self.workers[role])["containers"]
        return container

    def test_every_yaml_file_is_the_kustomization_or_one_of_its_patches(self):
        yamls = sorted(f for f in os.listdir(K8S_PYTHON) if f.endswith((".yaml", ".yml")))
        patches = [p["path"] for p in self.kustomization["patches"]]
        self.assertEqual(sorted(patches + ["kustomization.yaml"]), yamls)
        self.assertEqual(self.kustomization["resources"], ["../k8s"])
        self.assertEqual(sorted(f"{kind}/{name}" for kind, name in self.objects),
                         sorted(f"{kind}/{name}" for kind, name in self.base_objects))
        self.assertEqual({p["target"]["name"] for p in self.kustomization["patches"]},
                         {w["metadata"]["name"] for w in self.workers.values()})

    def test_only_the_worker_pods_change_and_they_keep_their_counts_and_labels(self):
        for key, obj in self.objects.items():
            base = self.base_objects[key]
            if obj in self.workers.values():
                self.assertEqual({k: v for k, v in obj["spec"].items() if k != "template"},
                                 {k: v for k, v in base["spec"].items() if k != "template"}, key)
                # The labels stay; the base's prometheus.io annotations go (no /metrics in Python).
                self.assertEqual(obj["spec"]["template"]["metadata"],
                                 {k: v for k, v in base["spec"]["template"]["metadata"].items()
                                  if k != "annotations"}, key)
                self.assertIn("annotations", base["spec"]["template"]["metadata"], key)
                self.assertNotEqual(pod_spec(obj), pod_spec(base), key)
            else:
                self.assertEqual(obj, base, key)

    def test_the_workers_run_the_script_from_the_python_image_as_its_user(self):
        tags = {i["name"]: i for i in self.kustomization["images"]}
        self.assertEqual(tags["rebound-python"].get("newTag"), "latest")
        dockerfile = read("deploy/Dockerfile.python")
        self.assertRegex(dockerfile, r"(?m)^USER 10001$")
        self.assertRegex(dockerfile, r"--uid 10001 ")
        for role, workload in self.workers.items():
            spec = pod_spec(workload)
            self.assertNotIn("initContainers", spec, role)
            container = self.container(role)
            self.assertEqual(container["image"], "rebound-python:latest", role)
            self.assertEqual(container["command"], PYTHON_COMMAND, role)
            self.assertNotIn("ports", container, role)   # no WorkerPeer in Python
            self.assertEqual(spec["securityContext"]["runAsUser"], 10001, role)
            self.assertEqual({e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
                              for e in container["env"]}, {"POD_NAME": "metadata.name"}, role)
        # The base Jobs' podFailurePolicy needs restartPolicy Never.
        self.assertEqual(pod_spec(self.workers["trainer"])["restartPolicy"], "Never")
        self.assertEqual(pod_spec(self.workers["evaluator"])["restartPolicy"], "Never")

    def test_the_script_and_the_configs_are_mounted_where_the_command_reads_them(self):
        self.assertEqual(set(self.script_files), {"train.py"})
        for role in self.workers:
            spec = pod_spec(self.workers[role])
            volumes = {v["name"]: v for v in spec["volumes"]}
            container = self.container(role)
            paths = [PYTHON_COMMAND[1], dict(split_flags(container["args"]))["config"]]
            for path, config_map in zip(paths, ("rebound-script", "rebound-config")):
                volume, _ = mount_of(container, path)
                self.assertIsNotNone(volume, f"{role}: nothing mounted at {path}")
                self.assertEqual(volumes[volume]["configMap"]["name"], config_map, role)
                files = self.script_files if config_map == "rebound-script" else self.files
                self.assertIn(os.path.basename(path), files, role)

    def test_the_shipped_script_runs_the_example_the_python_image_holds(self):
        script = read(self.script_files["train.py"])
        [example] = re.findall(r'^EXAMPLE = "(\S+)"$', script, re.M)
        copies = {dst: src for src, dst, _ in images.final_stage(images.PYTHON_IMAGE).copies}
        self.assertEqual(copies.get(example), "examples/torch/fashion_mnist_cnn.py")
        # Run as the pods run it, with the example at its place here: --help is the example's.
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, "train.py")
            with open(local, "w") as f:
                f.write(script.replace(example, os.path.join(ROOT, copies[example])))
            result = subprocess.run(["/usr/bin/python3", local, "--help"], capture_output=True,
                                    text=True, timeout=120,
                                    env={**os.environ, "PYTHONPATH": ":".join(
                                        [os.path.join(ROOT, "python")] +
                                        os.environ.get("PYTHONPATH", "").split(":"))})
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("--plain-epochs", result.stdout)

    def test_the_script_gets_the_flags_and_roles_rebound_torch_run_takes(self):
        sys.path.insert(0, os.path.join(ROOT, "python"))
        sys.path.insert(0, os.path.join(ROOT, "examples", "torch"))
        try:
            import fashion_mnist_cnn as example
            from rebound.torch import runner
        finally:
            del sys.path[:2]
        expected_roles = {"trainer": None, "spare": "spare", "evaluator": "evaluator"}
        for role, container in ((r, self.container(r)) for r in self.workers):
            argv = [a.replace("$(POD_NAME)", "pod-0") for a in container["args"]]
            kwargs = example.run_kwargs(example.parse_args(argv))
            # A trainer asks for no role: the server gives it a free slot, or makes it a spare.
            self.assertEqual(kwargs.get("role"), expected_roles[role], role)
            self.assertEqual(kwargs["server"], one(self.worker_config, "server_address"), role)
            self.assertEqual(kwargs["name"], "pod-0", role)
            self.assertEqual(os.path.basename(kwargs["config"]), "worker.pbtxt", role)
        # The Python client takes the config (it validates as rebound_worker does).
        config, token_file = runner.load_worker_config(self.files["worker.pbtxt"])
        self.assertEqual(config.job_id, one(self.job, "job_id"))
        self.assertEqual(token_file, "")
        # The example's batch size and tau are the job's (a mismatch is refused at registration).
        defaults = example.parse_args(["--server=rebound-server:7070"])
        self.assertEqual(str(defaults.batch_size), one(self.job, "data.batch_size"))
        self.assertEqual(str(defaults.tau), one(self.job, "easgd.sync_period"))

    def test_the_job_is_the_torch_demo_job_with_the_clusters_counts(self):
        demo = parse_pbtxt(read("configs/torch_job.pbtxt"))
        differ = {k for k in set(demo) | set(self.job) if demo.get(k) != self.job.get(k)}
        self.assertEqual(differ, {"job_id", "topology.spares", "fault_tolerance.reconnect_grace_ms"})
        self.assertEqual(one(self.job, "model.declared_by_worker"), "true")
        self.assertEqual(one(self.job, "fault_tolerance.reconnect_grace_ms"),
                         one(parse_pbtxt(read(self.base_files["job.pbtxt"])),
                             "fault_tolerance.reconnect_grace_ms"))
        slots = int(one(self.job, "topology.replicas")) * int(one(self.job, "topology.stages"))
        self.assertEqual(self.workers["trainer"]["spec"]["completions"], slots)
        self.assertEqual(self.workers["spare"]["spec"]["replicas"],
                         int(one(self.job, "topology.spares")))
        self.assertEqual(one(self.job, "topology.evaluator"), "true")
        self.assertNotEqual(one(self.job, "job_id"),
                            one(parse_pbtxt(read(self.base_files["job.pbtxt"])), "job_id"))

    def test_the_worker_config_is_the_bases_but_for_the_job_id_and_metrics(self):
        # A Python worker serves no /metrics: its config has no metrics block.
        base = parse_pbtxt(read(self.base_files["worker.pbtxt"]))
        self.assertIn("metrics.port", base)
        self.assertFalse([k for k in self.worker_config if k.startswith("metrics.")])
        self.assertEqual({k: v for k, v in self.worker_config.items() if k != "job_id"},
                         {k: v for k, v in base.items()
                          if k != "job_id" and not k.startswith("metrics.")})
        self.assertEqual(one(self.worker_config, "job_id"), one(self.job, "job_id"))
        self.assertEqual(set(self.files), {"job.pbtxt", "server.pbtxt", "worker.pbtxt"})
        self.assertEqual(self.files["server.pbtxt"], self.base_files["server.pbtxt"])

    def test_kubectl_kustomize_builds_what_this_test_reads(self):
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            self.skipTest("kubectl is not installed (it is no Debian package here)")
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(os.path.join(ROOT, "deploy"), os.path.join(tmp, "deploy"))
            result = subprocess.run([kubectl, "kustomize", os.path.join(tmp, "deploy",
                                                                        "k8s-python")],
                                    capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 0, result.stderr)
        built = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(result.stdout)}
        script_map = built.pop(("ConfigMap", "rebound-script"))
        config_map = built.pop(("ConfigMap", "rebound-config"))
        self.assertEqual(set(built), set(self.objects))
        for key, obj in self.objects.items():
            self.assertEqual(built[key]["spec"], obj["spec"], key)
        self.assertEqual(config_map["data"], {key: read(path) for key, path in self.files.items()})
        self.assertEqual(script_map["data"],
                         {key: read(path) for key, path in self.script_files.items()})


def logical_lines(text):
    return text.replace("\\\n", " ").splitlines()


class SlurmTest(unittest.TestCase):
    def test_the_scripts_parse(self):
        for script in (SBATCH, SUPERVISE):
            subprocess.run(["bash", "-n", script], check=True)
            self.assertTrue(os.access(script, os.X_OK), script)

    def test_it_runs_the_binaries_of_the_image_layout_with_their_flags(self):
        text = read("deploy/slurm/rebound.sbatch")
        variables = dict(re.findall(r"^(\w+_bin)=\$bin/(\S+)$", text, re.M))
        self.assertEqual(variables, {"server_bin": "server/rebound_server",
                                     "worker_bin": "worker/rebound_worker",
                                     "ctl_bin": "tools/reboundctl"})
        copies = dockerfile_copies()
        # The workers run "${worker_cmd[@]}" (rebound_worker, or python3 on the user's script,
        # which takes the worker's flags: SlurmRunTest checks those against the example's
        # parser), with the role in role_flag.
        self.assertIn('worker_cmd=("$worker_bin")', text)
        patterns = [(r'"\$' + var + r'"([^&|>;]*)', path) for var, path in variables.items()]
        patterns += [(r'"\$\{worker_cmd\[@\]\}"([^&|>;]*)', variables["worker_bin"]),
                     (r"role_flag=\((--[^)]*)\)", variables["worker_bin"])]
        used = set()
        for line in logical_lines(text):
            for pattern, path in patterns:
                for rest in re.findall(pattern, line):
                    binary = os.path.basename(path)
                    self.assertIn("/opt/rebound/" + path, copies)
                    for name in re.findall(r"(?:^|\s)--(\w+)", rest):
                        self.assertIn(name, FLAGS[binary], f"--{name} is not a flag of {binary}")
                        used.add((binary, name))
        self.assertLessEqual({("rebound_server", "config"), ("rebound_worker", "config"),
                              ("rebound_worker", "server"), ("rebound_worker", "role"),
                              ("reboundctl", "server")}, used)
        # The etcd members it starts for a group: etcd's own flags.
        known = etcd_flags()
        etcd_lines = [l for l in logical_lines(text) if '"$etcd_bin"' in l]
        self.assertEqual(len(etcd_lines), 1)
        names = re.findall(r"(?:^|\s)--([a-z-]+)=", etcd_lines[0].split('"$etcd_bin"', 1)[1])
        self.assertGreaterEqual(len(names), 8)
        for name in names:
            self.assertIn(name, known, f"--{name} is not a flag of etcd")

    def test_it_reads_configs_that_exist(self):
        text = read("deploy/slurm/rebound.sbatch")
        configs = set(re.findall(r"\$repo/(configs/\w+\.pbtxt)", text))
        self.assertEqual(configs, {"configs/job.pbtxt", "configs/worker.pbtxt",
                                   "configs/torch_job.pbtxt"})
        for path in configs:
            self.assertTrue(os.path.isfile(os.path.join(ROOT, path)), path)
        # The line the script rewrites is there.
        self.assertIn("peer_listen_address",
                      parse_pbtxt(read("configs/worker.pbtxt")))


FAKE_SRUN = r"""#!/bin/bash
# srun's stand-in: runs the step's tasks on this machine.
ntasks=1; out=/dev/null; opts=()
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --ntasks=*) ntasks=${1#--ntasks=} ;;
    --output=*) out=${1#--output=} ;;
  esac
  opts+=("$1"); shift
done
echo "srun ${opts[*]} :: $(basename "$1")" >> "$FAKE_LOG"
pids=()
trap 'kill -TERM "${pids[@]}" 2> /dev/null' TERM
for ((t = 0; t < ntasks; t++)); do
  SLURM_PROCID=$t "$@" >> "${out//%t/$t}" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do
  while kill -0 "$p" 2> /dev/null; do wait "$p"; done
  wait "$p"; s=$?
  if (( s > rc )); then rc=$s; fi
done
exit $rc
"""

FAKE_SCONTROL = r"""#!/bin/bash
[[ $1 == show && $2 == hostnames ]] || exit 1
printf '%s\n' ${FAKE_NODES:-n1 n2 n3}
"""

FAKE_SERVER = r"""#!/bin/bash
echo "server $*" >> "$FAKE_LOG"
# mkdir is atomic: of servers started at once (a group's members), exactly one crashes.
if [[ -n ${FAKE_CRASH_ONCE:-} ]] && mkdir "$FAKE_DIR/crashed" 2> /dev/null; then
  touch "$FAKE_DIR/serving"; sleep 4
  rm "$FAKE_DIR/serving"; echo "server crash" >> "$FAKE_LOG"; exit 1
fi
trap 'rm -f "$FAKE_DIR/serving"; echo "server TERM" >> "$FAKE_LOG"; exit 0' TERM
touch "$FAKE_DIR/serving"
while :; do sleep 0.05; done
"""

FAKE_WORKER = r"""#!/bin/bash
echo "worker $*" >> "$FAKE_LOG"
if [[ -n ${FAKE_FENCE_EVALUATOR_ONCE:-} && $* == *--role=evaluator* && ! -e $FAKE_DIR/fenced ]]; then
  touch "$FAKE_DIR/fenced"; echo "evaluator fenced" >> "$FAKE_LOG"; exit 3
fi
trap 'echo "worker TERM" >> "$FAKE_LOG"; exit 0' TERM
end=$((SECONDS + FAKE_WORKER_S))
while (( SECONDS < end )); do sleep 0.05; done
"""

FAKE_ETCD = r"""#!/bin/bash
echo "etcd $*" >> "$FAKE_LOG"
trap 'echo "etcd TERM" >> "$FAKE_LOG"; exit 0' TERM
while :; do sleep 0.05; done
"""

FAKE_CTL = r"""#!/bin/bash
echo "ctl $*" >> "$FAKE_LOG"
case " $* " in
  *" health "*) [[ -e $FAKE_DIR/serving ]] && { echo SERVING; exit 0; }; exit 2 ;;
  *" status "*) s='{"state":"FINISHED"}'; echo "{\"slots\":[$s,$s,$s,$s]}" ;;
esac
"""


class SlurmRunTest(unittest.TestCase):
    """The script under stand-ins: nodes n1 n2 n3, the job of configs/job.pbtxt."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name
        fake_bin = os.path.join(self.dir, "path")
        for name, text in (("path/srun", FAKE_SRUN), ("path/scontrol", FAKE_SCONTROL),
                           ("bin/server/rebound_server", FAKE_SERVER),
                           ("bin/worker/rebound_worker", FAKE_WORKER),
                           ("bin/tools/reboundctl", FAKE_CTL),
                           ("etcd/etcd", FAKE_ETCD)):
            path = os.path.join(self.dir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
        self.log = os.path.join(self.dir, "log")
        self.run_dir = os.path.join(self.dir, "run")
        self.env = {
            "PATH": fake_bin + ":" + os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": self.dir,
            "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_SUBMIT_DIR": ROOT,
            "REBOUND_BIN": os.path.join(self.dir, "bin"),
            "REBOUND_RUN_DIR": self.run_dir,
            "REBOUND_DATA_DIR": os.path.join(self.dir, "data"),
            "FAKE_LOG": self.log, "FAKE_DIR": self.dir,
            "REBOUND_ETCD_BIN": os.path.join(self.dir, "etcd", "etcd"),
            "REBOUND_ETCD_DATA_DIR": os.path.join(self.dir, "etcd-data"),
        }

    def tearDown(self):
        self.tmp.cleanup()

    def lines(self):
        with open(self.log) as f:
            return f.read().splitlines()

    def start(self, **env):
        return subprocess.Popen(["bash", SBATCH], env={**self.env, **env},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def test_a_job_runs_to_the_end_through_a_server_crash_and_a_fenced_worker(self):
        script = self.start(FAKE_WORKER_S="10", FAKE_CRASH_ONCE="1", FAKE_FENCE_EVALUATOR_ONCE="1")
        output, _ = script.communicate(timeout=50)
        self.assertEqual(script.returncode, 0, output)
        lines = self.lines()
        # The server: on the first node, started again after its crash, stopped last.
        servers = [l for l in lines if l.startswith("server --")]
        self.assertEqual(servers, [f"server --config={self.run_dir}/server.pbtxt"] * 2)
        self.assertIn("server crash", lines)
        self.assertEqual(lines[-1], "server TERM")
        for l in lines:
            if l.startswith("srun"):
                nodes = re.search(r"--nodelist=(\S+)", l).group(1)
                self.assertEqual(nodes == "n1", l.endswith(":: rebound_server"), l)
        # The workers: one trainer per slot of configs/job.pbtxt, the spares, the evaluator,
        # which its task started again after it was fenced.
        workers = [l for l in lines if l.startswith("worker --")]
        roles = sorted(re.search(r"--role=(\w+)", l).group(1) for l in workers)
        self.assertEqual(roles, ["auto"] * 4 + ["evaluator"] * 2 + ["spare"] * 2)
        self.assertIn("evaluator fenced", lines)
        for l in workers:
            self.assertIn(f"--config={self.run_dir}/worker.pbtxt --server=n1:7070", l)
        # The generated configs: the repository's job and worker configs.
        server = parse_pbtxt(read(os.path.join(self.run_dir, "server.pbtxt")))
        self.assertEqual(one(server, "listen_address"), "0.0.0.0:7070")
        self.assertEqual(read(one(server, "job_file")), read("configs/job.pbtxt"))
        self.assertEqual(one(server, "durability.data_dir"), self.env["REBOUND_DATA_DIR"])
        worker = parse_pbtxt(read(os.path.join(self.run_dir, "worker.pbtxt")))
        shipped = parse_pbtxt(read("configs/worker.pbtxt"))
        self.assertEqual(one(worker, "peer_listen_address"), "0.0.0.0:0")
        self.assertEqual({k: v for k, v in worker.items() if k != "peer_listen_address"},
                         {k: v for k, v in shipped.items() if k != "peer_listen_address"})
        status = json.loads(read(os.path.join(self.run_dir, "status.json")))
        self.assertEqual(len(status["slots"]), 4)

    def test_a_signal_stops_the_workers_before_the_server(self):
        script = self.start(FAKE_WORKER_S="60")
        deadline = time.time() + 30
        while time.time() < deadline:
            if os.path.exists(self.log) and sum(
                    l.startswith("worker --") for l in self.lines()) == 7:
                break
            time.sleep(0.1)
        script.send_signal(signal.SIGTERM)
        output, _ = script.communicate(timeout=30)
        self.assertEqual(script.returncode, 143, output)
        lines = self.lines()
        self.assertEqual(lines.count("worker TERM"), 7, output)
        self.assertEqual(lines[-1], "server TERM")
        last_worker = max(i for i, l in enumerate(lines) if l == "worker TERM")
        self.assertLess(last_worker, lines.index("server TERM"))
        self.assertFalse([l for l in lines if l.startswith("etcd")], "one server needs no etcd")

    def srun_nodes(self, binary):
        """The --nodelist of every srun step that ran `binary`, in order."""
        return [re.search(r"--nodelist=(\S+)", l).group(1) for l in self.lines()
                if l.startswith("srun") and l.endswith(":: " + binary)]

    def member_config(self, i):
        return parse_pbtxt(read(os.path.join(self.run_dir, f"server-{i}.pbtxt")))

    def test_a_group_runs_etcd_and_a_member_per_node_and_restarts_a_member_that_dies(self):
        script = self.start(REBOUND_STANDBYS="1", FAKE_WORKER_S="10", FAKE_CRASH_ONCE="1")
        output, _ = script.communicate(timeout=60)
        self.assertEqual(script.returncode, 0, output)
        lines = self.lines()
        # etcd: one member on each of the first three nodes, one cluster. (The stand-in srun
        # starts its steps in the background: its lines come in any order.)
        self.assertEqual(sorted(self.srun_nodes("etcd")), ["n1", "n2", "n3"])
        etcd = sorted((dict(split_flags(l.split()[1:])) for l in lines if l.startswith("etcd --")),
                      key=lambda e: e["name"])
        self.assertEqual([e["name"] for e in etcd], ["etcd-0", "etcd-1", "etcd-2"])
        cluster = "etcd-0=http://n1:2380,etcd-1=http://n2:2380,etcd-2=http://n3:2380"
        for i, e in enumerate(etcd):
            self.assertEqual(e["initial-cluster"], cluster)
            self.assertEqual(e["advertise-client-urls"], f"http://n{i + 1}:2379")
            self.assertEqual(e["data-dir"], os.path.join(self.dir, "etcd-data", f"etcd-{i}"))
        # The members: server-0 on n1, server-1 on n2, the one that crashed started again on its
        # node with its config.
        servers = [l for l in lines if l.startswith("server --")]
        configs = [re.search(r"--config=(\S+)", l).group(1) for l in servers]
        self.assertEqual(sorted(configs[:2]), [f"{self.run_dir}/server-{i}.pbtxt" for i in (0, 1)])
        self.assertEqual(len(servers), 3, output)
        self.assertIn("server crash", lines)
        # (The first two start at once: their lines come in any order; the third is the restart.)
        crashed = int(re.search(r"/server-(\d+)\.pbtxt$", configs[2]).group(1))
        self.assertEqual(self.srun_nodes("rebound_server")[2], f"n{crashed + 1}")   # 4 s later
        self.assertIn(f"server-{crashed} exited (1): restart 1 of 3", output)
        for i in (0, 1):
            config = self.member_config(i)
            self.assertEqual(one(config, "listen_address"), "0.0.0.0:7070")
            self.assertEqual(one(config, "durability.data_dir"),
                             os.path.join(self.env["REBOUND_DATA_DIR"], f"server-{i}"))
            self.assertEqual(config["replication.etcd_endpoints"],
                             ["n1:2379", "n2:2379", "n3:2379"])
            self.assertEqual(one(config, "replication.standbys"), "1")
            self.assertEqual(one(config, "replication.name"), f"server-{i}")
            self.assertEqual(one(config, "replication.advertise_host"), f"n{i + 1}")
            self.assertEqual(one(config, "replication.peer_listen_address"), "0.0.0.0:7071")
            self.assertEqual(one(config, "replication.sync"), "true")
            self.assertEqual(read(one(config, "job_file")), read("configs/job.pbtxt"))
        # The workers: on the third node only, with every member's address and a short backoff.
        workers = [l for l in lines if l.startswith("worker --")]
        self.assertEqual(len(workers), 7)
        for l in workers:
            self.assertIn("--server=n1:7070,n2:7070 ", l)
        for l in lines:
            if l.startswith("srun") and "supervise-worker.sh" in l:
                self.assertIn("--nodelist=n3 ", l)
        worker = parse_pbtxt(read(os.path.join(self.run_dir, "worker.pbtxt")))
        self.assertEqual(one(worker, "backoff_max_ms"), "250")
        # Stopped in order: the members after the workers' end, etcd last.
        self.assertEqual(lines[-3:], ["etcd TERM"] * 3)
        self.assertEqual(lines.count("server TERM"), 2)
        self.assertLess(max(i for i, l in enumerate(lines) if l == "server TERM"),
                        lines.index("etcd TERM"))

    def test_a_group_on_an_etcd_of_ones_own_starts_no_etcd_and_stops_in_order(self):
        script = self.start(REBOUND_STANDBYS="2", FAKE_WORKER_S="60",
                            REBOUND_ETCD_ENDPOINTS="e1:2379,e2:2379")
        deadline = time.time() + 30
        while time.time() < deadline:
            if os.path.exists(self.log) and sum(
                    l.startswith("worker --") for l in self.lines()) == 7:
                break
            time.sleep(0.1)
        script.send_signal(signal.SIGTERM)
        output, _ = script.communicate(timeout=30)
        self.assertEqual(script.returncode, 143, output)
        lines = self.lines()
        self.assertFalse([l for l in lines if l.startswith("etcd")], output)
        self.assertEqual(sorted(self.srun_nodes("rebound_server")), ["n1", "n2", "n3"])
        for i in range(3):
            self.assertEqual(self.member_config(i)["replication.etcd_endpoints"],
                             ["e1:2379", "e2:2379"])
        # Every node holds a member: the workers share the first one's.
        for l in lines:
            if l.startswith("worker --"):
                self.assertIn("--server=n1:7070,n2:7070,n3:7070 ", l)
        self.assertEqual(lines.count("worker TERM"), 7, output)
        self.assertEqual(lines.count("server TERM"), 3, output)
        last_worker = max(i for i, l in enumerate(lines) if l == "worker TERM")
        self.assertLess(last_worker, lines.index("server TERM"))

    def without_sharding(self, fields):
        return {k: v for k, v in fields.items() if not k.startswith("sharding.")}

    def test_shard_groups_run_a_server_per_node_each_naming_every_group(self):
        script = self.start(REBOUND_SHARD_GROUPS="2", FAKE_WORKER_S="10", FAKE_CRASH_ONCE="1")
        output, _ = script.communicate(timeout=60)
        self.assertEqual(script.returncode, 0, output)
        lines = self.lines()
        self.assertFalse([l for l in lines if l.startswith("etcd")], "one server a group: no etcd")
        # g0-server on n1, g1-server on n2; the one that crashed started again on its node.
        servers = [l for l in lines if l.startswith("server --")]
        configs = [re.search(r"--config=(\S+)", l).group(1) for l in servers]
        self.assertEqual(sorted(configs[:2]),
                         [f"{self.run_dir}/g{g}-server.pbtxt" for g in (0, 1)])
        self.assertEqual(len(servers), 3, output)
        crashed = 0 if configs[2].endswith("/g0-server.pbtxt") else 1
        self.assertIn(f"g{crashed}-server exited (1): restart 1 of 3", output)
        self.assertEqual(self.srun_nodes("rebound_server")[2], f"n{crashed + 1}")
        self.assertEqual(sorted(self.srun_nodes("rebound_server")[:2]), ["n1", "n2"])
        # The job without a sharding block runs as a copy with sharding.groups 2.
        job = os.path.join(self.run_dir, "job.pbtxt")
        copied = parse_pbtxt(read(job))
        self.assertEqual(one(copied, "sharding.groups"), "2")
        self.assertEqual(self.without_sharding(copied), parse_pbtxt(read("configs/job.pbtxt")))
        for g in (0, 1):
            config = parse_pbtxt(read(os.path.join(self.run_dir, f"g{g}-server.pbtxt")))
            self.assertEqual(one(config, "shard.group"), str(g))
            self.assertEqual(config["shard.group_addresses"], ["n1:7070", "n2:7070"])
            self.assertEqual(one(config, "job_file"), job)
            self.assertEqual(one(config, "durability.data_dir"),
                             os.path.join(self.env["REBOUND_DATA_DIR"], f"g{g}-server"))
            self.assertFalse([k for k in config if k.startswith("replication.")])
        # Every group is waited for; the workers get group 0 only, on the third node.
        for address in ("n1:7070", "n2:7070"):
            self.assertIn(f"ctl --server={address} --timeout_ms=2000 health", lines)
        workers = [l for l in lines if l.startswith("worker --")]
        self.assertEqual(len(workers), 7)
        for l in workers:
            self.assertIn("--server=n1:7070 ", l)
        self.assertIn("ctl --server=n1:7070 shards", lines)
        self.assertTrue(os.path.exists(os.path.join(self.run_dir, "shards.txt")))
        self.assertEqual(lines.count("server TERM"), 2)
        last_worker = max(i for i, l in enumerate(lines) if l == "worker TERM" or
                          l.startswith("worker --"))
        self.assertLess(last_worker, lines.index("server TERM"))

    def test_replicated_shard_groups_take_a_node_per_member_and_their_own_etcd_keys(self):
        script = self.start(FAKE_NODES="n1 n2 n3 n4 n5", REBOUND_SHARD_GROUPS="2",
                            REBOUND_STANDBYS="1", FAKE_WORKER_S="3")
        output, _ = script.communicate(timeout=60)
        self.assertEqual(script.returncode, 0, output)
        lines = self.lines()
        self.assertEqual(sorted(self.srun_nodes("etcd")), ["n1", "n2", "n3"])
        self.assertEqual(sorted(self.srun_nodes("rebound_server")), ["n1", "n2", "n3", "n4"])
        names = ["g0-server-0", "g0-server-1", "g1-server-0", "g1-server-1"]
        for i, name in enumerate(names):
            config = parse_pbtxt(read(os.path.join(self.run_dir, f"{name}.pbtxt")))
            self.assertEqual(one(config, "replication.name"), name)
            self.assertEqual(one(config, "replication.group"), name[1])
            self.assertEqual(one(config, "replication.standbys"), "1")
            self.assertEqual(one(config, "replication.advertise_host"), f"n{i + 1}")
            self.assertEqual(one(config, "shard.group"), name[1])
            self.assertEqual(config["shard.group_addresses"],
                             ["n1:7070,n2:7070", "n3:7070,n4:7070"])
            self.assertEqual(one(config, "durability.data_dir"),
                             os.path.join(self.env["REBOUND_DATA_DIR"], name))
        for l in lines:
            if l.startswith("worker --"):
                self.assertIn("--server=n1:7070,n2:7070 ", l)
            if l.startswith("srun") and "supervise-worker.sh" in l:
                self.assertIn("--nodelist=n5 ", l)
        self.assertEqual(lines[-3:], ["etcd TERM"] * 3)
        self.assertEqual(lines.count("server TERM"), 4)

    def test_a_job_that_shards_itself_runs_as_is_and_a_count_that_disagrees_is_refused(self):
        job = os.path.join(self.dir, "sharded-job.pbtxt")
        with open(job, "w") as f:
            f.write(read("configs/job.pbtxt") + "\nsharding { groups: 2 }  # two groups\n")
        script = self.start(REBOUND_JOB=job, FAKE_WORKER_S="1")
        output, _ = script.communicate(timeout=60)
        self.assertEqual(script.returncode, 0, output)
        self.assertFalse(os.path.exists(os.path.join(self.run_dir, "job.pbtxt")))
        config = parse_pbtxt(read(os.path.join(self.run_dir, "g1-server.pbtxt")))
        self.assertEqual(one(config, "job_file"), job)
        self.assertEqual(one(config, "shard.group"), "1")

        os.remove(self.log)
        script = self.start(REBOUND_JOB=job, REBOUND_SHARD_GROUPS="3")
        output, _ = script.communicate(timeout=30)
        self.assertEqual(script.returncode, 1, output)
        self.assertIn("REBOUND_SHARD_GROUPS=3 disagrees with the job's sharding.groups 2", output)
        self.assertFalse(os.path.exists(self.log), "nothing started")

    def test_python_workers_run_the_script_with_the_flags_the_example_takes(self):
        # The interpreter is the stand-in worker (it logs "worker ARGS"); no rebound_worker.
        os.remove(os.path.join(self.env["REBOUND_BIN"], "worker", "rebound_worker"))
        python = os.path.join(self.dir, "bin", "worker", "python3")
        with open(python, "w") as f:
            f.write(FAKE_WORKER)
        os.chmod(python, 0o755)
        script = os.path.join(self.dir, "train.py")
        with open(script, "w") as f:
            f.write("# the user's script\n")
        run = self.start(REBOUND_PYTHON=f"{python} -u", REBOUND_PYTHON_SCRIPT=script,
                         FAKE_WORKER_S="3", FAKE_FENCE_EVALUATOR_ONCE="1")
        output, _ = run.communicate(timeout=60)
        self.assertEqual(run.returncode, 0, output)
        lines = self.lines()
        workers = [l.split()[1:] for l in lines if l.startswith("worker -u ")]
        # configs/torch_job.pbtxt: 4 trainers, then REBOUND_SPARES (2) spares, the evaluator
        # twice (fenced once: supervise-worker.sh restarts a Python worker too).
        self.assertEqual(len(workers), 8, output)
        for argv in workers:
            self.assertEqual(argv[:2], ["-u", script])
        sys.path.insert(0, os.path.join(ROOT, "python"))
        sys.path.insert(0, os.path.join(ROOT, "examples", "torch"))
        try:
            import fashion_mnist_cnn as example
        finally:
            del sys.path[:2]
        roles = sorted(str(example.run_kwargs(example.parse_args(argv[2:])).get("role"))
                       for argv in workers)
        self.assertEqual(roles, ["None"] * 4 + ["evaluator"] * 2 + ["spare"] * 2)
        for argv in workers:
            kwargs = example.run_kwargs(example.parse_args(argv[2:]))
            self.assertEqual(kwargs["server"], "n1:7070")
            self.assertEqual(kwargs["config"], f"{self.run_dir}/worker.pbtxt")
        # The server runs the torch job.
        server = parse_pbtxt(read(os.path.join(self.run_dir, "server.pbtxt")))
        self.assertEqual(one(server, "job_file"),
                         os.path.realpath(os.path.join(ROOT, "configs", "torch_job.pbtxt")))
        self.assertEqual(lines[-1], "server TERM")

    def test_python_workers_need_a_job_whose_model_the_workers_declare(self):
        script = os.path.join(self.dir, "train.py")
        with open(script, "w") as f:
            f.write("# the user's script\n")
        run = self.start(REBOUND_PYTHON_SCRIPT=script,
                         REBOUND_JOB=os.path.join(ROOT, "configs", "job.pbtxt"))
        output, _ = run.communicate(timeout=30)
        self.assertEqual(run.returncode, 1, output)
        self.assertIn("REBOUND_PYTHON_SCRIPT needs a job whose model the workers declare", output)
        self.assertFalse(os.path.exists(self.log), "nothing started")
        run = self.start(REBOUND_PYTHON_SCRIPT=os.path.join(self.dir, "missing.py"))
        output, _ = run.communicate(timeout=30)
        self.assertEqual(run.returncode, 1, output)
        self.assertIn("missing.py is not readable", output)

    def test_a_bad_or_too_large_shard_count_is_refused(self):
        for value in ("0", "65", "two"):
            script = self.start(REBOUND_SHARD_GROUPS=value)
            output, _ = script.communicate(timeout=30)
            self.assertEqual(script.returncode, 1, output)
            self.assertIn(f"REBOUND_SHARD_GROUPS must be a number in [1, 64], got '{value}'",
                          output)
        script = self.start(REBOUND_SHARD_GROUPS="2", REBOUND_STANDBYS="1")
        output, _ = script.communicate(timeout=30)
        self.assertEqual(script.returncode, 1, output)
        self.assertIn("REBOUND_SHARD_GROUPS=2 with REBOUND_STANDBYS=1 needs 4 nodes, one per "
                      "server; the allocation has 3", output)
        self.assertFalse(os.path.exists(self.log), "nothing started")

    def test_a_group_larger_than_the_allocation_is_refused(self):
        script = self.start(REBOUND_STANDBYS="3")
        output, _ = script.communicate(timeout=30)
        self.assertEqual(script.returncode, 1, output)
        self.assertIn("REBOUND_STANDBYS=3 needs 4 nodes, one per member; the allocation has 3",
                      output)
        self.assertFalse(os.path.exists(self.log), "nothing started")
        script = self.start(REBOUND_STANDBYS="1", REBOUND_ETCD_MEMBERS="2")
        output, _ = script.communicate(timeout=30)
        self.assertEqual(script.returncode, 1, output)
        self.assertIn("REBOUND_ETCD_MEMBERS must be odd, 1 to 9, got '2'", output)


if __name__ == "__main__":
    unittest.main(verbosity=2)
