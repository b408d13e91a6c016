#!/usr/bin/env python3
"""Fleet test: three gemma4 replicas behind HAProxy, under load, while replicas fail.

Three containers from the gemma4 image (gemma4-fleet-r0..r2) run on a private Docker
network with fixed addresses. HAProxy (the host's /usr/sbin/haproxy, run in the
foreground by this script) balances streamed completions over them, health-checks
`GET /ready` every 300 ms (down after 2 failures, up after 2 successes) and re-sends a
request that met a refused connection, an empty response or a 503 to another replica.
Client threads send streamed completions through it in a loop while one scenario runs:

  r  L7 retries: a replica kept in rotation (its health check disabled) is drained, then
     exits; requests pinned to it must still succeed on the others (503 and refused
     connections are retried), the request whose body arrives late included.
  a  `docker stop -t 30` of one replica (SIGTERM, drain): no request may fail, and the
     replica's in-flight streams must finish; then it is started again.
  b  `docker kill` of one replica: only streams running on it when it died may fail, and
     nothing started after the health checks' detection window may be sent to it.
  c  `docker network disconnect` of one replica for 10 s: the same, for the streams that
     hang on it (a client gives up after 8 s without data); after `docker network
     connect` with the same address it serves again.
  d  rolling restart of the three, one after the other: no request may fail.

Before that it checks the image: `--version` runs, the user is 65532, there is no shell,
the only file is a static binary, and the replicas' processes run as uid 65532.

A request succeeds only if the answer was 200 and the stream ended with `data: [DONE]`
after a last choice chunk whose finish_reason is "length". Prints a table of counts per
scenario, then one JSON line `{"scenarios": {...}, "ok": ...}`; exits 1 when an
expectation failed. Containers, network and HAProxy are removed in every case.

    python3 tests/fleet/fleet_test.py [--scenarios r,a,b,c,d] [--keep-going]
"""

import argparse
import collections
import http.client
import io
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LABEL = "gemma4-fleet-test"
BACKEND = "fleet"
REPLICAS = ["r0", "r1", "r2"]
PORT = 8000

# Health checks, as written into the HAProxy configuration.
CHECK_INTER_S = 0.3
CHECK_FALL = 2
CHECK_RISE = 2

SCENARIOS = {
    "r": "L7 retries",
    "a": "docker stop (drain)",
    "b": "docker kill",
    "c": "network disconnect",
    "d": "rolling restart",
    "e": "rolling restart under gemma4 bench serve",
}


class TimeLimit(Exception):
    pass


class Stop(Exception):
    """SIGTERM, handled like Ctrl-C."""


def now():
    return time.monotonic()


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- docker


def docker(*args, timeout=60, check=True):
    try:
        p = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"docker {' '.join(args)}: no answer in {timeout} s")
    if check and p.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def inspect(name, fmt):
    return docker("inspect", "-f", fmt, name).stdout.strip()


# ---------------------------------------------------------------------------- HTTP


def http_get(host, port, path, timeout=2.0):
    """(status, body) of a GET, or (None, error) when nothing answered."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        r = conn.getresponse()
        return r.status, r.read(4096).decode("utf-8", "replace")
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"
    except http.client.HTTPException as e:
        return None, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def completion_body(max_tokens):
    return json.dumps({
        "model": "tiny",
        "prompt": "Hello world",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }).encode()


_ids = itertools.count(1)


def new_id(prefix="q"):
    return f"{prefix}{next(_ids)}"


def stream_completion(host, port, max_tokens, idle_timeout, total_timeout, rid=None,
                      headers=None, late_body=False, on_first_chunk=None, live=None):
    """Sends one streamed completion and reads it to the end. Returns its record:
    id, start, end, status, served_by, ok, reason, chunks. While it runs, the record
    is in `live` (a dict by id), if given."""
    rid = rid or new_id()
    rec = {"id": rid, "start": now(), "end": None, "status": None, "served_by": None,
           "ok": False, "reason": None, "chunks": 0, "port": None}
    if live is not None:
        live[rid] = rec
    body = completion_body(max_tokens)
    hdrs = {"Content-Type": "application/json", "Connection": "close",
            "X-Fleet-Request": rid, "Content-Length": str(len(body))}
    hdrs.update(headers or {})
    conn = http.client.HTTPConnection(host, port, timeout=idle_timeout)
    try:
        conn.connect()
        # The client port names this request in HAProxy's session list.
        rec["port"] = conn.sock.getsockname()[1]
        if late_body:
            # Headers first, the body a moment later in a packet of its own.
            conn.putrequest("POST", "/v1/completions", skip_accept_encoding=True)
            for k, v in hdrs.items():
                conn.putheader(k, v)
            conn.endheaders()
            time.sleep(0.3)
            conn.send(body)
        else:
            conn.request("POST", "/v1/completions", body=body, headers=hdrs)
        resp = conn.getresponse()
        rec["status"] = resp.status
        rec["served_by"] = resp.getheader("X-Served-By")
        if resp.status != 200:
            text = resp.read(4096).decode("utf-8", "replace")
            code = None
            try:
                code = json.loads(text)["error"]["code"]
            except (ValueError, KeyError, TypeError):
                pass
            rec["reason"] = f"HTTP {resp.status}" + (f" {code}" if code else "")
            return rec
        done = False
        last_finish = None
        error = None
        while True:
            if now() - rec["start"] > total_timeout:
                rec["reason"] = f"timeout: over {total_timeout:.0f} s"
                return rec
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            rec["chunks"] += 1
            if rec["chunks"] == 1 and on_first_chunk:
                on_first_chunk()
            # Only chunks that end a choice or report an error need decoding.
            if b'"finish_reason":null' in payload and b'"error"' not in payload:
                last_finish = None
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                error = "undecodable chunk"
                continue
            if "error" in obj:
                err = obj["error"]
                error = err.get("code") or err.get("message") if isinstance(err, dict) else str(err)
                continue
            choices = obj.get("choices") or []
            if choices:
                last_finish = choices[-1].get("finish_reason")
        if error:
            rec["reason"] = f"stream error: {error}"
        elif not done:
            rec["reason"] = "stream ended without [DONE]"
        elif last_finish != "length":
            rec["reason"] = f"finish_reason {last_finish!r}"
        else:
            rec["ok"] = True
        return rec
    except TimeoutError:
        rec["reason"] = f"timeout: nothing for {idle_timeout:.0f} s"
        return rec
    except (OSError, http.client.HTTPException) as e:
        rec["reason"] = f"{type(e).__name__}: {e}"
        return rec
    finally:
        rec["end"] = now()
        conn.close()
        if live is not None:
            live.pop(rid, None)


# ---------------------------------------------------------------------------- HAProxy

HAPROXY_CFG = """\
# Written by tests/fleet/fleet_test.py for one run.
global
    log stdout format raw local0 info
    stats socket {sock} mode 600 level admin
    maxconn 2000

defaults
    mode http
    log global
    timeout connect 1s
    timeout client 120s
    # Streams last seconds; a replica that stops answering is found by the checks.
    timeout server 120s
    timeout check 2s
    timeout http-request 10s
    # L7 retries re-send the buffered request: wait for the whole body before
    # connecting, or a body that arrives after the headers makes it unretryable.
    option http-buffer-request

frontend fleet_in
    bind 127.0.0.1:{port}
    http-request capture req.hdr(X-Fleet-Request) len 64
    log-format "fleet-request id=%[capture.req.hdr(0)] srv=%s status=%ST retries=%rc term=%tsc"
    default_backend {backend}

backend {backend}
    balance leastconn
    option httpchk GET /ready
    http-check expect status 200
    # A draining replica answers 503 until the checks mark it down, a dead one
    # refuses connections: send the request to another replica (each retry
    # redispatches).
    retry-on conn-failure empty-response 503
    retries 3
    option redispatch 1
    # Test hook: X-Fleet-Pin: rN sends a request to rN first.
{pins}
    http-response set-header X-Served-By %s
    default-server inter {inter}ms fall {fall} rise {rise}
{servers}
"""

SERVER_EVENT = re.compile(r"Server " + BACKEND + r"/(r\d) is (UP|DOWN)")
REQUEST_LOG = re.compile(r"fleet-request id=(\S*) srv=(\S+) status=(-?\d+) retries=(\S+) term=(\S+)")


class HAProxy:
    def __init__(self, binary, workdir, ips):
        self.binary = binary
        self.dir = workdir
        self.sock = os.path.join(workdir, "haproxy.sock")
        self.cfg = os.path.join(workdir, "haproxy.cfg")
        self.logfile = os.path.join(workdir, "haproxy.log")
        self.port = None
        self.ips = ips
        self.proc = None
        self.lock = threading.Lock()
        self.requests = {}   # request id -> {srv, status, retries, term}
        self.sessions = {}   # client port -> server, from "show sess"
        self.events = []     # (time, server, "UP"|"DOWN")
        self.lines = collections.deque(maxlen=400)

    def write_config(self):
        pins = "\n".join(f"    use-server {r} if {{ req.hdr(X-Fleet-Pin) -m str {r} }}" for r in REPLICAS)
        servers = "\n".join(f"    server {r} {ip}:{PORT} check" for r, ip in zip(REPLICAS, self.ips))
        text = HAPROXY_CFG.format(sock=self.sock, port=self.port, backend=BACKEND, pins=pins,
                                  inter=int(CHECK_INTER_S * 1000), fall=CHECK_FALL,
                                  rise=CHECK_RISE, servers=servers)
        with open(self.cfg, "w") as f:
            f.write(text)
        p = subprocess.run([self.binary, "-c", "-f", self.cfg], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"haproxy rejects its configuration:\n{p.stdout}{p.stderr}")

    def start(self, deadline):
        for attempt in range(3):
            # The port is free now; should another program take it first, try again.
            self.port = free_port()
            self.write_config()
            self.proc = subprocess.Popen([self.binary, "-db", "-f", self.cfg], stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=die_with_parent)
            reader = threading.Thread(target=self._read, daemon=True)
            reader.start()
            while self.proc.poll() is None:
                try:
                    self.stat()
                    return
                except OSError:
                    pass
                deadline.check("haproxy's stats socket")
                time.sleep(0.1)
            reader.join(2)
        raise RuntimeError("haproxy exited: " + "\n".join(self.lines))

    def _read(self):
        with open(self.logfile, "w") as out:
            for raw in self.proc.stdout:
                t = now()
                line = raw.decode("utf-8", "replace").rstrip("\n")
                out.write(f"{t:.3f} {line}\n")
                out.flush()
                with self.lock:
                    self.lines.append(line)
                    m = REQUEST_LOG.search(line)
                    if m:
                        self.requests[m.group(1)] = {"srv": m.group(2), "status": int(m.group(3)),
                                                     "retries": m.group(4), "term": m.group(5)}
                        continue
                    m = SERVER_EVENT.search(line)
                    if m:
                        # The same change may be printed twice (warning and log line).
                        last = [e for e in self.events if e[1] == m.group(1)]
                        if not last or last[-1][2] != m.group(2) or t - last[-1][0] > 0.05:
                            self.events.append((t, m.group(1), m.group(2)))

    def command(self, cmd):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect(self.sock)
            s.sendall(cmd.encode() + b"\n")
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            return data.decode("utf-8", "replace")
        finally:
            s.close()

    def stat(self):
        """{server: {"status": ..., "scur": ...}} for the backend's servers."""
        text = self.command("show stat")
        lines = text.splitlines()
        header = lines[0].lstrip("# ").split(",")
        out = {}
        for line in lines[1:]:
            row = dict(zip(header, line.split(",")))
            if row.get("pxname") == BACKEND and row.get("svname") in REPLICAS:
                out[row["svname"]] = {"status": row["status"], "scur": int(row["scur"] or 0)}
        return out

    def snapshot_sessions(self):
        """Remembers which server each open client connection waits on."""
        with self.lock:
            self.sessions = {}
        for line in self.command("show sess").splitlines():
            src = re.search(r"src=127\.0\.0\.1:(\d+)", line)
            srv = re.search(r"srv=(\S+)", line)
            if src and srv:
                with self.lock:
                    self.sessions[int(src.group(1))] = srv.group(1)

    def session_server(self, port):
        with self.lock:
            return self.sessions.get(port)

    def request_log(self, rid):
        with self.lock:
            return self.requests.get(rid)

    def events_since(self, t0):
        with self.lock:
            return [e for e in self.events if e[0] >= t0]

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def die_with_parent():
    """In the child: SIGTERM when this script dies, even by SIGKILL (Linux)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---------------------------------------------------------------------------- load


class Load:
    """K client threads sending streamed completions through the balancer in a loop."""

    def __init__(self, port, clients, max_tokens, idle_timeout, total_timeout):
        self.port = port
        self.clients = clients
        self.max_tokens = max_tokens
        self.idle_timeout = idle_timeout
        self.total_timeout = total_timeout
        self.records = []
        self.live = {}  # requests under way, by id
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = []

    def start(self):
        for i in range(self.clients):
            t = threading.Thread(target=self._client, daemon=True, name=f"client{i}")
            t.start()
            self.threads.append(t)

    def _client(self):
        while not self.stopping.is_set():
            try:
                rec = stream_completion("127.0.0.1", self.port, self.max_tokens, self.idle_timeout,
                                        self.total_timeout, live=self.live)
            except Exception as e:  # noqa: BLE001 - a failed request, not a failed client
                rec = {"id": new_id("x"), "start": now(), "end": now(), "status": None,
                       "served_by": None, "ok": False, "reason": f"{type(e).__name__}: {e}", "chunks": 0}
            with self.lock:
                self.records.append(rec)
            if not rec["ok"]:
                time.sleep(0.05)

    def snapshot(self):
        with self.lock:
            return list(self.records)

    def streaming_on(self, r):
        """Requests whose stream from r is under way."""
        return sum(1 for x in list(self.live.values()) if x["served_by"] == r and x["chunks"] > 0)

    def stop(self):
        self.stopping.set()
        end = now() + self.total_timeout + 5
        for t in self.threads:
            t.join(max(0.0, end - now()))
        return self.snapshot()


# ---------------------------------------------------------------------------- fleet


class Deadline:
    def __init__(self, seconds):
        self.end = now() + seconds
        self.seconds = seconds

    def check(self, what):
        if now() > self.end:
            raise TimeLimit(f"time limit of {self.seconds:.0f} s reached while waiting for {what}")

    def left(self):
        return self.end - now()


class Fleet:
    def __init__(self, args, workdir, deadline):
        self.args = args
        self.deadline = deadline
        net = ipaddress.ip_network(args.subnet)
        hosts = list(itertools.islice(net.hosts(), 0, 20))
        self.subnet = str(net)
        self.gateway = str(hosts[0])
        self.ips = [str(hosts[9 + i]) for i in range(len(REPLICAS))]
        self.ip = dict(zip(REPLICAS, self.ips))
        self.network = args.network
        self.names = {r: f"gemma4-fleet-{r}" for r in REPLICAS}
        self.model_dir = str(Path(args.model_dir).resolve())
        self.haproxy = HAProxy(args.haproxy, workdir, self.ips)

    # -- life cycle

    def remove_leftovers(self):
        for r, name in self.names.items():
            p = docker("inspect", "-f", "{{index .Config.Labels \"" + LABEL + "\"}}", name, check=False)
            if p.returncode == 0:
                if p.stdout.strip() != "1":
                    raise RuntimeError(f"a container named {name} exists and is not this test's; remove it")
                docker("rm", "-f", name)
        p = docker("network", "inspect", "-f", "{{index .Labels \"" + LABEL + "\"}}", self.network, check=False)
        if p.returncode == 0:
            if p.stdout.strip() != "1":
                raise RuntimeError(f"a network named {self.network} exists and is not this test's; remove it")
            docker("network", "rm", self.network)

    def create(self):
        self.remove_leftovers()
        docker("network", "create", "--driver", "bridge", "--subnet", self.subnet,
               "--gateway", self.gateway, "--label", f"{LABEL}=1", self.network)
        for r in REPLICAS:
            docker("run", "-d", "--name", self.names[r], "--label", f"{LABEL}=1",
                   "--network", self.network, "--ip", self.ip[r],
                   "-e", f"GEMMA4_THREADS={self.args.threads}",
                   "-v", f"{self.model_dir}:/models:ro", self.args.image,
                   "serve", "--model", "/models", "--host", "0.0.0.0", "--port", str(PORT),
                   "--served-model-name", "tiny", "--drain-timeout", "20",
                   "--max-num-seqs", "4", "--max-queue", "64")
        for r in REPLICAS:
            self.wait_ready_direct(r)

    def destroy(self):
        try:
            self.haproxy.stop()
        except Exception as e:  # noqa: BLE001 - keep cleaning up
            log(f"stopping haproxy: {e}")
        for name in self.names.values():
            docker("rm", "-f", name, check=False, timeout=60)
        docker("network", "rm", self.network, check=False, timeout=60)

    # -- waiting

    def wait_ready_direct(self, r, timeout=60):
        end = now() + timeout
        last = None
        while now() < end:
            status, body = http_get(self.ip[r], PORT, "/ready")
            if status == 200:
                return
            last = (status, body)
            self.deadline.check(f"{r} to be ready")
            time.sleep(0.1)
        state = inspect(self.names[r], "{{.State.Status}}")
        raise RuntimeError(f"{r} ({self.ip[r]}:{PORT}) is not ready after {timeout} s: last answer {last}, "
                           f"container {state}. The host must reach the containers' addresses over the bridge.")

    def wait_status(self, r, want, timeout=30):
        """Waits until HAProxy's status for r is exactly `want` ("UP", "DOWN")."""
        end = now() + timeout
        while now() < end:
            st = self.haproxy.stat().get(r, {}).get("status")
            if st == want:
                return now()
            self.deadline.check(f"{r} to be {want} in haproxy")
            time.sleep(0.05)
        raise RuntimeError(f"haproxy does not report {r} {want} after {timeout} s "
                           f"(it says {self.haproxy.stat().get(r)})")

    def wait_all_up(self, timeout=30):
        for r in REPLICAS:
            self.wait_status(r, "UP", timeout)

    def wait_inflight(self, load, r, timeout=15):
        """Waits until a client reads a stream from r; False if none did."""
        end = now() + timeout
        while now() < end:
            if load.streaming_on(r) >= 1:
                return True
            self.deadline.check(f"a request in flight on {r}")
            time.sleep(0.05)
        return False

    def wait_served(self, load, r, after, timeout=30):
        """Waits until a request started after `after` has succeeded on r."""
        end = now() + timeout
        while now() < end:
            if any(x["ok"] and x["served_by"] == r and x["start"] >= after for x in load.snapshot()):
                return True
            self.deadline.check(f"{r} to serve again")
            time.sleep(0.1)
        return False

    def replica_of(self, rec):
        """The replica that answered, from X-Served-By or else HAProxy's log."""
        if rec["served_by"]:
            return rec["served_by"]
        entry = self.haproxy.request_log(rec["id"])
        if entry and entry["srv"] in REPLICAS:
            return entry["srv"]
        # A request that got no answer and is still open in HAProxy.
        srv = self.haproxy.session_server(rec.get("port"))
        if srv in REPLICAS:
            return srv
        return "?"

    def retried(self, rec):
        entry = self.haproxy.request_log(rec["id"])
        return bool(entry) and entry["retries"].lstrip("+") not in ("0", "")

    def restore(self):
        """After a failed scenario: every replica running, on the network and checked."""
        for r in REPLICAS:
            name = self.names[r]
            if inspect(name, "{{.State.Running}}") != "true":
                docker("start", name, check=False)
            if self.network not in inspect(name, "{{json .NetworkSettings.Networks}}"):
                docker("network", "connect", "--ip", self.ip[r], self.network, name, check=False)
            try:
                self.haproxy.command(f"enable health {BACKEND}/{r}")
                self.haproxy.command(f"shutdown sessions server {BACKEND}/{r}")
            except OSError:
                pass

    def exit_code(self, r):
        return int(inspect(self.names[r], "{{.State.ExitCode}}"))


# ---------------------------------------------------------------------------- results


class Result:
    def __init__(self, key, title):
        self.key = key
        self.title = title
        self.t0 = now()
        self.records = []
        self.checks = []
        self.notes = []
        self.error = None
        self.fleet = None

    def check(self, ok, what):
        self.checks.append((bool(ok), what))
        log(f"    {'ok  ' if ok else 'FAIL'} {what}")
        return ok

    def note(self, text):
        self.notes.append(text)
        log(f"    note: {text}")

    def rel(self, t):
        return f"{t - self.t0:+.2f}s"

    @property
    def ok(self):
        return self.error is None and all(ok for ok, _ in self.checks)

    def counts(self):
        recs = self.records
        served = collections.Counter(self.fleet.replica_of(x) for x in recs if x["ok"])
        failed = collections.Counter(self.fleet.replica_of(x) for x in recs if not x["ok"])
        reasons = collections.Counter(x["reason"] for x in recs if not x["ok"])
        durations = sorted(x["end"] - x["start"] for x in recs if x["ok"])
        return {
            "requests": len(recs),
            "succeeded": sum(1 for x in recs if x["ok"]),
            "failed": sum(1 for x in recs if not x["ok"]),
            "failed_by_replica": dict(sorted(failed.items())),
            "served_by_replica": dict(sorted(served.items())),
            "retried": sum(1 for x in recs if self.fleet.retried(x)),
            "failure_reasons": dict(reasons),
            "seconds_per_request": {
                "median": round(durations[len(durations) // 2], 2) if durations else None,
                "max": round(durations[-1], 2) if durations else None,
            },
        }

    def summary(self):
        out = {"title": self.title, **(self.counts() if self.key in SCENARIOS else {}),
               "checks": [{"check": what, "ok": ok} for ok, what in self.checks],
               "ok": self.ok}
        if self.error:
            out["error"] = self.error
        if self.notes:
            out["notes"] = self.notes
        return out


def no_late_requests(res, fleet, recs, r, since, until):
    """No request started in [since, until) was answered by r."""
    if until <= since:
        res.note(f"{r} was restarted before the detection window ended")
        return
    late = [x for x in recs if since <= x["start"] < until and fleet.replica_of(x) == r]
    res.check(not late, f"no request started between {res.rel(since)} and {res.rel(until)} "
                        f"went to {r} ({len(late)} did)")


def failures_only_on(res, fleet, recs, r, before):
    bad = [x for x in recs if not x["ok"] and (fleet.replica_of(x) != r or x["start"] >= before)]
    for x in bad[:5]:
        res.note(f"unexpected failure {x['id']} on {fleet.replica_of(x)} started {res.rel(x['start'])}: {x['reason']}")
    n = sum(1 for x in recs if not x["ok"])
    res.check(not bad, f"every failed request ({n}) ran on {r} and started before {res.rel(before)}")


def describe_down(res, fleet, r, t_action):
    for t, srv, state in fleet.haproxy.events_since(t_action):
        if srv == r and state == "DOWN":
            res.note(f"haproxy marked {r} DOWN {t - t_action:.2f} s after the action")
            return


# ---------------------------------------------------------------------------- scenarios


def start_load(fleet, args):
    load = Load(fleet.haproxy.port, args.clients, args.max_tokens, args.idle_timeout, args.total_timeout)
    load.start()
    return load


def finish_load(fleet, load, res):
    res.records = load.stop()
    time.sleep(0.5)  # HAProxy logs a request when it ends
    fleet.haproxy.snapshot_sessions()


def back_in_rotation(fleet, load, res, r, t_restart):
    t_up = fleet.wait_status(r, "UP")
    res.note(f"{r} UP in haproxy {t_up - t_restart:.2f} s after its restart")
    res.check(fleet.wait_served(load, r, t_up), f"{r} serves again after its restart")


def scenario_retries(fleet, args, res):
    r = "r0"
    hp = fleet.haproxy
    name = fleet.names[r]
    hp.command(f"disable health {BACKEND}/{r}")
    try:
        # A long stream straight to r0 keeps it draining for a while.
        first = threading.Event()
        long_rec = {}

        def long_stream():
            long_rec.update(stream_completion(fleet.ip[r], PORT, args.long_tokens, args.idle_timeout,
                                              args.total_timeout, rid=new_id("long"),
                                              on_first_chunk=first.set))
            first.set()

        lt = threading.Thread(target=long_stream, daemon=True)
        lt.start()
        first.wait(30)
        res.check(lt.is_alive(), f"a long stream runs straight on {r} ({long_rec.get('reason') or 'ok'})")
        stop_proc = subprocess.Popen(["docker", "stop", "-t", "30", name],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        t_stop = now()
        draining = None
        while now() - t_stop < 20:
            status, body = http_get(fleet.ip[r], PORT, "/ready")
            if status == 503 and "draining" in body:
                draining = body
                break
            time.sleep(0.02)
        res.check(draining, f"{r} /ready answers 503 draining after SIGTERM ({draining!r})")
        direct = stream_completion(fleet.ip[r], PORT, 8, args.idle_timeout, args.total_timeout)
        res.check(direct["reason"] == "HTTP 503 server_draining",
                  f"a new request straight to draining {r} gets 503 server_draining ({direct['reason']})")
        pinned = [None] * 5

        def pinned_request(i):
            pinned[i] = stream_completion("127.0.0.1", hp.port, 16, args.idle_timeout, args.total_timeout,
                                          headers={"X-Fleet-Pin": r}, late_body=(i == 4))

        senders = [threading.Thread(target=pinned_request, args=(i,), daemon=True) for i in range(5)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(args.total_timeout + 5)
        if None in pinned:
            raise RuntimeError("a request pinned to r0 did not finish")
        t_pinned = now()
        still_draining = lt.is_alive()
        res.check(still_draining, f"the long stream on {r} was still running after the pinned requests")
        time.sleep(0.3)
        res.check(all(x["ok"] and x["served_by"] in ("r1", "r2") and fleet.retried(x) for x in pinned),
                  "requests pinned to draining r0 (one with its body sent late) were retried and succeeded "
                  "on r1/r2: " + ", ".join(f"{x['served_by']}/{x['reason'] or 'ok'}/retries="
                                           f"{(hp.request_log(x['id']) or {}).get('retries')}" for x in pinned))
        try:
            _, err = stop_proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            stop_proc.kill()
            raise RuntimeError(f"docker stop {name} did not return in 60 s")
        if stop_proc.returncode != 0:
            raise RuntimeError(f"docker stop {name} failed: {err.decode(errors='replace').strip()}")
        lt.join(args.total_timeout)
        t_exit = now()
        res.note(f"{r} exited {t_exit - t_stop:.2f} s after SIGTERM")
        res.check(long_rec.get("ok") and long_rec.get("end", 0) > t_pinned,
                  f"the long stream on {r} ran to completion during the drain ({long_rec.get('reason') or 'ok'})")
        res.check(fleet.exit_code(r) == 0, f"{r} exited with status 0 (got {fleet.exit_code(r)})")
        after = [stream_completion("127.0.0.1", hp.port, 16, args.idle_timeout, args.total_timeout,
                                   headers={"X-Fleet-Pin": r}) for _ in range(3)]
        time.sleep(0.3)
        res.check(all(x["ok"] and x["served_by"] in ("r1", "r2") and fleet.retried(x) for x in after),
                  "requests pinned to stopped r0 (connection refused) were retried and succeeded on r1/r2")
        # The two requests straight to r0 are checks of their own, not counted.
        res.records = [*pinned, *after]
    finally:
        hp.command(f"enable health {BACKEND}/{r}")
    fleet.wait_status(r, "DOWN")
    t_restart = now()
    docker("start", name)
    t_up = fleet.wait_status(r, "UP")
    res.note(f"{r} UP in haproxy {t_up - t_restart:.2f} s after docker start")
    back = stream_completion("127.0.0.1", hp.port, 16, args.idle_timeout, args.total_timeout,
                             headers={"X-Fleet-Pin": r})
    res.check(back["ok"] and back["served_by"] == r, f"{r} serves again ({back['served_by']}, {back['reason'] or 'ok'})")
    res.records.append(back)


def scenario_stop(fleet, args, res):
    r = "r1"
    load = start_load(fleet, args)
    try:
        time.sleep(args.warmup)
        res.check(fleet.wait_inflight(load, r), f"{r} has streams in flight before the stop")
        t_act = now()
        docker("stop", "-t", "30", fleet.names[r], timeout=60)
        t_done = now()
        res.note(f"docker stop {r} took {t_done - t_act:.2f} s")
        describe_down(res, fleet, r, t_act)
        res.check(fleet.exit_code(r) == 0, f"{r} exited with status 0 after draining")
        fleet.wait_status(r, "DOWN")
        time.sleep(args.settle)
        t_restart = now()
        docker("start", fleet.names[r])
        back_in_rotation(fleet, load, res, r, t_restart)
        time.sleep(args.settle)
    finally:
        finish_load(fleet, load, res)
    recs = res.records
    drained = [x for x in recs if fleet.replica_of(x) == r and x["start"] < t_act < x["end"]]
    res.check(drained and all(x["ok"] for x in drained),
              f"the streams in flight on {r} at SIGTERM finished ({sum(x['ok'] for x in drained)}/{len(drained)})")
    res.check(all(x["ok"] for x in recs), f"no request failed ({sum(not x['ok'] for x in recs)} did)")
    no_late_requests(res, fleet, recs, r, t_act + args.window, t_restart)


def scenario_kill(fleet, args, res):
    r = "r2"
    load = start_load(fleet, args)
    try:
        time.sleep(args.warmup)
        res.check(fleet.wait_inflight(load, r), f"{r} has streams in flight before the kill")
        t_act = now()
        docker("kill", fleet.names[r])
        t_done = now()
        fleet.wait_status(r, "DOWN")
        describe_down(res, fleet, r, t_act)
        time.sleep(args.settle)
        t_restart = now()
        docker("start", fleet.names[r])
        back_in_rotation(fleet, load, res, r, t_restart)
        time.sleep(args.settle)
    finally:
        finish_load(fleet, load, res)
    recs = res.records
    failures_only_on(res, fleet, recs, r, t_done)
    no_late_requests(res, fleet, recs, r, t_done + args.window, t_restart)


def scenario_disconnect(fleet, args, res):
    r = "r0"
    load = start_load(fleet, args)
    try:
        time.sleep(args.warmup)
        res.check(fleet.wait_inflight(load, r), f"{r} has streams in flight before the disconnect")
        t_act = now()
        docker("network", "disconnect", fleet.network, fleet.names[r])
        t_done = now()
        fleet.wait_status(r, "DOWN")
        describe_down(res, fleet, r, t_act)
        time.sleep(max(0.0, args.disconnect_seconds - (now() - t_act)))
        t_restart = now()
        docker("network", "connect", "--ip", fleet.ip[r], fleet.network, fleet.names[r])
        back_in_rotation(fleet, load, res, r, t_restart)
        time.sleep(args.settle)
    finally:
        finish_load(fleet, load, res)
    # HAProxy still waits on r for the requests whose clients gave up (up to
    # "timeout server"); end those sessions so that they do not count in the next scenario.
    fleet.haproxy.command(f"shutdown sessions server {BACKEND}/{r}")
    recs = res.records
    hung = sum(1 for x in recs if not x["ok"] and (x["reason"] or "").startswith("timeout"))
    res.note(f"{hung} requests timed out while {r} was off the network")
    failures_only_on(res, fleet, recs, r, t_done)
    no_late_requests(res, fleet, recs, r, t_done + args.window, t_restart)


def scenario_rolling(fleet, args, res):
    load = start_load(fleet, args)
    marks = []
    try:
        time.sleep(args.warmup)
        for r in REPLICAS:
            res.check(fleet.wait_inflight(load, r), f"{r} has streams in flight before its stop")
            t_act = now()
            docker("stop", "-t", "30", fleet.names[r], timeout=60)
            res.note(f"docker stop {r} took {now() - t_act:.2f} s")
            res.check(fleet.exit_code(r) == 0, f"{r} exited with status 0 after draining")
            fleet.wait_status(r, "DOWN")
            t_restart = now()
            docker("start", fleet.names[r])
            back_in_rotation(fleet, load, res, r, t_restart)
            marks.append((r, t_act, t_restart))
        time.sleep(args.settle)
    finally:
        finish_load(fleet, load, res)
    recs = res.records
    for r, t_act, t_restart in marks:
        drained = [x for x in recs if fleet.replica_of(x) == r and x["start"] < t_act < x["end"]]
        res.check(drained and all(x["ok"] for x in drained),
                  f"the streams in flight on {r} at SIGTERM finished ({sum(x['ok'] for x in drained)}/{len(drained)})")
        no_late_requests(res, fleet, recs, r, t_act + args.window, t_restart)
    res.check(all(x["ok"] for x in recs), f"no request failed ({sum(not x['ok'] for x in recs)} did)")


def scenario_bench(fleet, args, res):
    """A rolling restart of all three while `gemma4 bench serve` sends its load
    through the balancer: every one of its requests must complete."""
    binary = os.environ.get("GEMMA4_BIN") or str(REPO / "target/release/gemma4")
    report = Path(tempfile.mkdtemp(prefix="gemma4-fleet-bench-")) / "report.json"
    cmd = [binary, "bench", "serve", "--url", f"http://127.0.0.1:{fleet.haproxy.port}", "--model", "tiny",
           "--concurrency", "6", "--num-prompts", str(args.bench_prompts), "--input-len", "16",
           "--output-len", str(args.max_tokens), "--warmup", "0", "--timeout", "120", "--no-progress",
           "--out", str(report)]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = ""
    try:
        time.sleep(args.warmup)
        for r in REPLICAS:
            t_act = now()
            docker("stop", "-t", "30", fleet.names[r], timeout=60)
            res.check(fleet.exit_code(r) == 0, f"{r} exited with status 0 after draining")
            fleet.wait_status(r, "DOWN")
            t_restart = now()
            docker("start", fleet.names[r])
            t_up = fleet.wait_status(r, "UP")
            res.note(f"{r} stopped at {res.rel(t_act)}, UP again {t_up - t_restart:.2f} s after its restart")
        res.check(bench.poll() is None, "gemma4 bench serve was still sending after the last restart")
        output, _ = bench.communicate(timeout=max(30.0, fleet.deadline.left()))
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    res.check(bench.returncode == 0, f"gemma4 bench serve exited 0 (got {bench.returncode}) {output[-400:]!r}")
    level = json.loads(report.read_text())["throughput"]["sweep"][0] if report.exists() else {}
    completed, errors = level.get("completed"), level.get("errors")
    res.note(f"gemma4 bench serve: {completed} of {args.bench_prompts} requests completed, {errors} errors, "
             f"{level.get('connection_retries')} connection retries, {level.get('output_tok_per_s')} output tok/s")
    res.check(completed == args.bench_prompts and not errors,
              f"every bench request completed ({completed} of {args.bench_prompts}, {errors} errors)")
    shutil.rmtree(report.parent, ignore_errors=True)


RUNNERS = {"r": scenario_retries, "a": scenario_stop, "b": scenario_kill, "c": scenario_disconnect,
           "d": scenario_rolling, "e": scenario_bench}


# ---------------------------------------------------------------------------- image checks


def elf_is_static(data):
    """True when an ELF executable asks for no program interpreter (no PT_INTERP)."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return False
    endian = "<" if data[5] == 1 else ">"
    e_phoff, = struct.unpack_from(endian + "Q", data, 0x20)
    e_phentsize, e_phnum = struct.unpack_from(endian + "HH", data, 0x36)
    for i in range(e_phnum):
        p_type, = struct.unpack_from(endian + "I", data, e_phoff + i * e_phentsize)
        if p_type == 3:  # PT_INTERP
            return False
    return True


def image_files(image):
    """Regular files and links of the image's layers (name -> bytes, first 64 KiB)."""
    proc = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
    files = {}
    with tarfile.open(fileobj=proc.stdout, mode="r|") as outer:
        for member in outer:
            if not member.name.endswith("layer.tar") and not member.name.startswith("blobs/"):
                continue
            data = outer.extractfile(member).read()
            try:
                inner = tarfile.open(fileobj=io.BytesIO(data))
            except tarfile.TarError:
                continue
            for m in inner.getmembers():
                if not m.isdir():
                    content = inner.extractfile(m).read(1 << 16) if m.isfile() else b""
                    files[m.name.lstrip("./")] = content
    proc.wait()
    return files


def check_image(args, res):
    info = json.loads(docker("image", "inspect", args.image).stdout)[0]
    cfg = info["Config"]
    res.check(cfg.get("User", "").split(":")[0] == "65532", f"the image's user is 65532 ({cfg.get('User')!r})")
    res.check(cfg.get("Entrypoint") == ["/gemma4"], f"the entrypoint is /gemma4 ({cfg.get('Entrypoint')})")
    p = docker("run", "--rm", args.image, "--version", check=False)
    res.check(p.returncode == 0 and p.stdout.startswith("gemma4"),
              f"docker run {args.image} --version prints {p.stdout.strip()!r}")
    p = docker("run", "--rm", "--entrypoint", "/bin/sh", args.image, "-c", "true", check=False)
    res.check(p.returncode != 0, "the image has no shell (/bin/sh cannot be run)")
    files = image_files(args.image)
    res.check(list(files) == ["gemma4"], f"the image's layers hold one file, gemma4 ({sorted(files)[:10]})")
    if "gemma4" in files:
        res.check(elf_is_static(files["gemma4"]), "/gemma4 is a static ELF binary (no program interpreter)")
    model = Path(args.model_dir)
    unreadable = [str(p) for p in [model, *model.iterdir()]
                  if not (p.stat().st_mode & 0o004) or (p.is_dir() and not p.stat().st_mode & 0o001)]
    res.check(not unreadable, f"the model files are readable by uid 65532 ({unreadable or 'all'})")


def check_replicas_uid(fleet, res):
    for r in REPLICAS:
        user = inspect(fleet.names[r], "{{.Config.User}}")
        pid = inspect(fleet.names[r], "{{.State.Pid}}")
        uid = None
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        uid = line.split()[1:]
        except OSError as e:
            uid = str(e)
        res.check(user.split(":")[0] == "65532" and uid and uid[0] == "65532" and len(set(uid)) == 1,
                  f"{r} runs as uid 65532 (Config.User {user!r}, process uids {uid})")


# ---------------------------------------------------------------------------- main


def table(results):
    rows = [("scenario", "requests", "ok", "failed", "failed by replica", "served by replica", "retried")]
    for res in results:
        if not res.records:
            continue
        c = res.counts()
        fmt = lambda d: " ".join(f"{k}={v}" for k, v in d.items()) or "-"
        rows.append((f"{res.key} {res.title}", str(c["requests"]), str(c["succeeded"]), str(c["failed"]),
                     fmt(c["failed_by_replica"]), fmt(c["served_by_replica"]), str(c["retried"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) if i in (0, 4, 5) else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))).rstrip())


def dump_logs(fleet):
    for r, name in fleet.names.items():
        p = docker("logs", "--tail", "15", name, check=False)
        log(f"--- last log lines of {name}:\n{(p.stdout + p.stderr).rstrip()}")
    log("--- last haproxy lines:\n" + "\n".join(list(fleet.haproxy.lines)[-25:]))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default=os.environ.get("GEMMA4_IMAGE", "gemma4:latest"))
    ap.add_argument("--subnet", default=os.environ.get("GEMMA4_FLEET_SUBNET", "10.213.7.0/24"),
                    help="the Docker network's subnet; replicas get its .10, .11, .12")
    ap.add_argument("--network", default="gemma4-fleet")
    ap.add_argument("--model-dir", default=str(REPO / "tests/fixtures/oracle/e-style"))
    ap.add_argument("--haproxy", default=shutil.which("haproxy") or "/usr/sbin/haproxy")
    ap.add_argument("--scenarios", default="r,a,b,c,d,e", help="comma-separated, from " + ",".join(SCENARIOS))
    ap.add_argument("--keep-going", action="store_true", help="run the next scenarios after a failed one")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--bench-prompts", type=int, default=240, help="requests of `gemma4 bench serve` in 'e'")
    ap.add_argument("--max-tokens", type=int, default=1000, help="tokens per load request")
    ap.add_argument("--long-tokens", type=int, default=3500, help="tokens of the stream kept running in 'r'")
    ap.add_argument("--threads", type=int, default=1, help="GEMMA4_THREADS of each replica")
    ap.add_argument("--idle-timeout", type=float, default=8.0, help="seconds a client waits for the next bytes")
    ap.add_argument("--total-timeout", type=float, default=60.0, help="seconds a request may last at most")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each action")
    ap.add_argument("--settle", type=float, default=1.5, help="seconds of load after each step")
    ap.add_argument("--disconnect-seconds", type=float, default=None,
                    help="how long 'c' keeps a replica off the network (default: idle timeout + 2 s, "
                         "so that its streams time out)")
    ap.add_argument("--detect-margin", type=float, default=1.0,
                    help="seconds added to fall x inter for the detection window")
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds the whole run may take")
    args = ap.parse_args()
    if args.disconnect_seconds is None:
        args.disconnect_seconds = args.idle_timeout + 2.0
    args.window = CHECK_FALL * CHECK_INTER_S + args.detect_margin
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenarios {unknown}; known: {','.join(SCENARIOS)}")
    return args


def main():
    args = parse_args()
    started = now()
    deadline = Deadline(args.time_limit)

    def on_term(signum, frame):
        raise Stop()

    signal.signal(signal.SIGTERM, on_term)
    workdir = tempfile.mkdtemp(prefix="gemma4-fleet-")
    fleet = Fleet(args, workdir, deadline)
    results = []
    interrupted = False
    setup = Result("image", "image and replicas")
    setup.fleet = fleet
    results.append(setup)
    try:
        log(f"== image {args.image}")
        check_image(args, setup)
        log(f"== fleet: network {fleet.network} {fleet.subnet}, replicas "
            + ", ".join(f"{r}={ip}" for r, ip in fleet.ip.items()))
        fleet.create()
        check_replicas_uid(fleet, setup)
        fleet.haproxy.start(deadline)
        log(f"== haproxy {args.haproxy} on 127.0.0.1:{fleet.haproxy.port} (config {fleet.haproxy.cfg})")
        fleet.wait_all_up()
        probe = stream_completion("127.0.0.1", fleet.haproxy.port, args.max_tokens, args.idle_timeout,
                                  args.total_timeout)
        setup.check(probe["ok"], f"a request through haproxy succeeds ({probe['served_by']}, "
                                 f"{probe['end'] - probe['start']:.2f} s alone, {probe['reason'] or 'ok'})")
        if not setup.ok:
            raise RuntimeError("the image or the fleet is not as expected")
        for key in args.scenarios:
            res = Result(key, SCENARIOS[key])
            res.fleet = fleet
            results.append(res)
            log(f"== scenario {key}: {res.title}")
            try:
                fleet.wait_all_up()
                RUNNERS[key](fleet, args, res)
                fleet.wait_all_up()
                res.check(True, "all three replicas UP in haproxy afterwards")
            except (TimeLimit, RuntimeError, OSError) as e:
                res.error = f"{type(e).__name__}: {e}"
                log(f"    FAIL {res.error}")
            if not res.ok:
                dump_logs(fleet)
                if not args.keep_going or (res.error or "").startswith("TimeLimit"):
                    break
                fleet.restore()
    except (KeyboardInterrupt, Stop):
        interrupted = True
        log("interrupted: cleaning up")
    except (TimeLimit, RuntimeError, OSError) as e:
        setup.error = f"{type(e).__name__}: {e}"
        log(f"FAIL {setup.error}")
        try:
            dump_logs(fleet)
        except Exception:  # noqa: BLE001
            pass
    finally:
        # A second Ctrl-C must not cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            fleet.destroy()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    ran = [res for res in results if res.key in SCENARIOS]
    ok = (not interrupted and all(res.ok for res in results)
          and [res.key for res in ran] == args.scenarios)
    print()
    table(results)
    print()
    for res in results:
        print(f"{res.key:5} {res.title:20} {'PASS' if res.ok else 'FAIL'}"
              + (f"  {res.error}" if res.error else ""))
        for good, what in res.checks:
            if not good:
                print(f"        failed: {what}")
    elapsed = now() - started
    print(f"run time {elapsed:.0f} s")
    print(json.dumps({"image": setup.summary(),
                      "scenarios": {res.key: res.summary() for res in ran},
                      "seconds": round(elapsed, 1), "interrupted": interrupted, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
