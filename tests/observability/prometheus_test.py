"""deploy/prometheus against a real Prometheus (Debian's prometheus package).

1. promtool checks alerts.yml and prometheus.yml, and runs the rules' unit tests
   (alerts_test.yml: each alert fires when it should, with its labels, and not before).
2. Every metric the alert rules and the Grafana dashboard name is documented in docs/metrics.md.
3. A real rebound_server with two C++ trainers on loopback, and a real prometheus scraping the
   server every second with the shipped rules: the training metrics arrive through Prometheus'
   HTTP API, the rules load, and SIGKILLing a trainer fires ReboundWorkerFailed.

Usage (Bazel passes these): prometheus_test.py SERVER_BINARY WORKER_BINARY
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

ROOT = os.environ.get("TEST_SRCDIR")
ROOT = os.path.join(ROOT, "rebound") if ROOT else os.getcwd()
DEPLOY = os.path.join(ROOT, "deploy", "prometheus")
DOCS = os.path.join(ROOT, "docs", "metrics.md")
LIMIT_S = 90.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv, **kwargs):
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120, **kwargs)
    return done.returncode, done.stdout


def check_promtool():
    for argv in (["promtool", "check", "rules", "alerts.yml"],
                 ["promtool", "check", "config", "prometheus.yml"],
                 ["promtool", "test", "rules", "alerts_test.yml"]):
        code, out = run(argv, cwd=DEPLOY)
        assert code == 0, "%s exited %d:\n%s" % (" ".join(argv), code, out)
    code, out = run(["promtool", "check", "rules", "alerts.yml"], cwd=DEPLOY)
    found = re.search(r"SUCCESS: (\d+) rules found", out)
    assert found and int(found.group(1)) == 10, out


def metric_names(text):
    names = set()
    for name in re.findall(r"\b(rebound_[a-z_]+)", text):
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and name != "rebound_workers_count":
                name = name[: -len(suffix)]
        names.add(name)
    return names


def check_names_documented():
    documented = set(re.findall(r"`(rebound_[a-z_]+)`", open(DOCS).read()))
    assert "rebound_slot_step" in documented, "docs/metrics.md lists no families?"
    with open(os.path.join(DEPLOY, "alerts.yml")) as f:
        alerts = metric_names("\n".join(l for l in f if "expr" in l or l.startswith("          ")))
    dashboard = json.load(open(os.path.join(DEPLOY, "dashboard.json")))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10, "the dashboard has %d queries" % len(exprs)
    used = metric_names("\n".join(exprs))
    for name in sorted(alerts | used):
        assert name in documented, "%s (in deploy/prometheus) is not in docs/metrics.md" % name
    assert {"rebound_slot_step", "rebound_workers", "rebound_group_in_sync_members"} <= (
        alerts | used), sorted(alerts | used)
    return used


def query(port, expr):
    url = "http://127.0.0.1:%d/api/v1/query?%s" % (port, urllib.parse.urlencode({"query": expr}))
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


def get(port, path):
    with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=5) as r:
        return json.load(r)


def wait_for(what, predicate, logs):
    deadline = time.monotonic() + LIMIT_S
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except (OSError, ValueError) as e:  # not up yet
            last = e
        time.sleep(0.2)
    raise AssertionError("timed out waiting for %s (last: %r)\n%s" % (what, last, logs()))


def scrape_a_cluster(server_binary, worker_binary, dashboard_names):
    tmp = tempfile.mkdtemp(prefix="rebound-prom-")
    server_port, metrics_port, prom_port = free_port(), free_port(), free_port()
    with open(os.path.join(tmp, "server.pbtxt"), "w") as f:
        f.write('listen_address: "127.0.0.1:%d"\n' % server_port)
        f.write('metrics { bind_address: "127.0.0.1" port: %d }\n' % metrics_port)
        f.write("job {\n"
                '  job_id: "prom"\n'
                "  model { layers { width: 32 } layers { width: 10 activation: IDENTITY } }\n"
                "  topology { replicas: 2 }\n"
                "  data { batch_size: 32 micro_batches: 2 train_limit: 1000 test_limit: 100 }\n"
                "  easgd { sync_period: 20 }\n"
                "  fault_tolerance { heartbeat_interval_ms: 100 failure_timeout_ms: 1000 }\n"
                "  training { max_steps: 1000000 }\n"
                "}\n")
    with open(os.path.join(tmp, "worker.pbtxt"), "w") as f:
        f.write('server_address: "127.0.0.1:%d"\n' % server_port)
        f.write('peer_listen_address: "127.0.0.1:0"\n')
        f.write("backoff_initial_ms: 20\nbackoff_max_ms: 200\n")
        f.write("metrics { enabled: false }\n")
    with open(os.path.join(tmp, "prometheus.yml"), "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                "rule_files:\n  - %s\n" % os.path.join(DEPLOY, "alerts.yml") +
                "scrape_configs:\n  - job_name: rebound-server\n    static_configs:\n"
                "      - targets: ['127.0.0.1:%d']\n" % metrics_port)
    processes = []
    logs = {}

    def start(name, argv):
        log = open(os.path.join(tmp, name + ".log"), "w")
        logs[name] = log.name
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
        processes.append(p)
        return p

    def tails():
        out = []
        for name, path in logs.items():
            with open(path, errors="replace") as f:
                out.append("--- %s\n%s" % (name, "".join(f.readlines()[-15:])))
        return "\n".join(out)

    try:
        start("server", [server_binary, "--config", os.path.join(tmp, "server.pbtxt")])
        trainers = [start("t%d" % i, [worker_binary, "--config", os.path.join(tmp, "worker.pbtxt"),
                                      "--name", "t%d" % i, "--role", "trainer"])
                    for i in range(2)]
        start("prometheus", ["prometheus", "--config.file", os.path.join(tmp, "prometheus.yml"),
                             "--storage.tsdb.path", os.path.join(tmp, "tsdb"),
                             "--web.listen-address", "127.0.0.1:%d" % prom_port])

        # Training metrics, through Prometheus: both slots past step 0, the target up.
        wait_for("both slots' steps in Prometheus", lambda: len(
            [r for r in query(prom_port, 'rebound_slot_step{job="rebound-server"} > 0')]) == 2,
            tails)
        up = query(prom_port, 'up{job="rebound-server"}')
        assert len(up) == 1 and up[0]["value"][1] == "1", up
        rate = wait_for("a positive step rate", lambda: query(
            prom_port, 'rate(rebound_slot_step{job="rebound-server"}[5s]) > 0'), tails)
        assert len(rate) >= 1, rate
        # Every family the dashboard uses that a plain single-server job has is scraped.
        present = {r["metric"]["__name__"] for r in query(prom_port, '{job="rebound-server"}')}
        for name in ("rebound_slot_step", "rebound_center_version", "rebound_workers",
                     "rebound_slot_weight", "rebound_store_bytes", "rebound_slot_state"):
            assert name in dashboard_names and name in present, (name, sorted(present))

        # The shipped rules load, all healthy.
        rules = wait_for("the rules loaded", lambda: [
            g for g in get(prom_port, "/api/v1/rules")["data"]["groups"]
            if g["name"] == "rebound"], tails)
        assert len(rules[0]["rules"]) == 10, rules
        for rule in rules[0]["rules"]:
            assert rule["health"] in ("ok", "unknown"), rule

        # A trainer SIGKILLed: the server declares it FAILED, and the alert fires.
        trainers[0].send_signal(signal.SIGKILL)
        firing = wait_for("ReboundWorkerFailed firing", lambda: [
            a for a in get(prom_port, "/api/v1/alerts")["data"]["alerts"]
            if a["labels"]["alertname"] == "ReboundWorkerFailed" and a["state"] == "firing"],
            tails)
        assert firing[0]["labels"]["role"] == "TRAINER", firing
        assert firing[0]["labels"]["severity"] == "ticket", firing
    finally:
        for p in reversed(processes):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    started = time.monotonic()
    check_promtool()
    names = check_names_documented()
    scrape_a_cluster(os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]), names)
    print("prometheus_test: passed in %.1f s" % (time.monotonic() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
