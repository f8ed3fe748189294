"""The Python client against real processes: a coordinator and two worker
daemons on loopback (plaintext), and a coordinator with TLS and tokens.

Run by ctest (tests/client/CMakeLists.txt) with PYTHONPATH=<build>/python
and the binaries' paths in MUONMESH_COORDINATOR_BIN, MUONMESH_WORKER_BIN and
MUONMESH_MAKE_TEST_CERTS. Expectations come from the job files (steps,
ranks), the coordinator's documented answers and the C++ client's tests,
not from the client under test.
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import muonmesh

COORDINATOR = os.environ["MUONMESH_COORDINATOR_BIN"]
WORKER = os.environ["MUONMESH_WORKER_BIN"]
CTL = os.environ["MUONMESH_CTL_BIN"]
MAKE_CERTS = os.environ["MUONMESH_MAKE_TEST_CERTS"]
START = 30  # seconds a process may take to start


class Process:
    """A background process with its output in a log file."""

    def __init__(self, argv, log):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

    def text(self):
        with open(self.log, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_for(self, pattern, timeout=START):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = re.search(pattern, self.text())
            if found:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{self.log} never said {pattern!r}:\n{self.text()}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def start_coordinator(work, extra=()):
    coordinator = Process([COORDINATOR, "--listen", "127.0.0.1:0", "--data-dir",
                           os.path.join(work, "state"), "--lease-ttl", "3s",
                           "--collective-timeout", "20s", *extra],
                          os.path.join(work, "coordinator.log"))
    address = coordinator.wait_for(r"listening on (\S+)").group(1)
    return coordinator, address


def job(name, world=2, steps=4, out=None, **training):
    """A small MLP job as a dict (the job file's keys)."""
    spec = {
        "name": name, "world_size": world,
        "model": {"mlp": {"dims": [6, 16, 3]}}, "init": {"seed": 5},
        "data": {"teacher": {"seed": 21, "samples": 256}},
        "training": {"steps": steps, "global_batch_size": 24, **training},
    }
    if out:
        spec["output"] = {"dir": out, "export": os.path.join(out, "final.safetensors")}
    return spec


class PlaintextClusterTest(unittest.TestCase):
    """One coordinator and two workers for every test of the class."""

    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="muonmesh_py_")
        cls.coordinator, cls.address = start_coordinator(cls.work)
        cls.workers = []
        for wid in ("w0", "w1"):
            w = Process([WORKER, "--coordinator", cls.address, "--worker-id", wid,
                         "--memory-budget", "1GiB"], os.path.join(cls.work, f"{wid}.log"))
            w.wait_for("registered as")
            cls.workers.append(w)
        cls.client = muonmesh.Client(cls.address, timeout=20)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        for p in cls.workers + [cls.coordinator]:
            p.stop()
        shutil.rmtree(cls.work, ignore_errors=True)

    def logs(self):
        return "\n".join(f"--- {p.log}\n{p.text()}" for p in [self.coordinator] + self.workers)

    def test_a_job_is_submitted_watched_to_its_end_and_its_metrics_read(self):
        out = os.path.join(self.work, "runs", "first")
        job_id = self.client.submit(job("first", out=out))
        self.assertRegex(job_id, r"^j-\d+$")
        events = list(self.client.watch(job_id, timeout=120))
        last = events[-1]
        self.assertEqual(last["state_change"]["state"], "SUCCEEDED", self.logs())
        # Gapless indexes from 1; one step event a step, in order.
        self.assertEqual([e["index"] for e in events], list(range(1, len(events) + 1)))
        steps = [e["step"]["step"] for e in events if "step" in e]
        self.assertEqual(steps, [0, 1, 2, 3])
        got = self.client.get(job_id)
        self.assertEqual(got["state"], "SUCCEEDED")
        self.assertEqual(got["steps_done"], 4)
        self.assertEqual(got["steps_total"], 4)
        self.assertTrue(os.path.isfile(os.path.join(out, "final.safetensors")))

        rows = self.client.metrics(job_id, frame=False)
        self.assertEqual([r["step"] for r in rows], [0, 1, 2, 3])
        self.assertTrue(all(r["rank"] == 0 for r in rows))
        for r in rows:
            self.assertTrue(math.isfinite(r["loss"]) and r["loss"] > 0)
            self.assertGreater(r["step_seconds"], 0)
            for phase in muonmesh.PHASES:
                self.assertIn(phase, r)
            self.assertIsNone(r["val_loss"])  # an MLP has no validation
        # The loss the events carried is the records' loss.
        by_step = {e["step"]["step"]: e["step"]["loss"] for e in events if "step" in e}
        self.assertEqual(by_step, {r["step"]: r["loss"] for r in rows})
        every_rank = self.client.metrics(job_id, all_ranks=True, frame=False)
        self.assertEqual(sorted((r["step"], r["rank"]) for r in every_rank),
                         [(s, k) for s in range(4) for k in range(2)])
        part = self.client.metrics(job_id, first_step=1, last_step=2, frame=False)
        self.assertEqual([r["step"] for r in part], [1, 2])
        try:
            import pandas  # noqa: F401
        except ImportError:
            self.assertIsInstance(self.client.metrics(job_id), list)
        else:
            frame = self.client.metrics(job_id)
            self.assertEqual(list(frame["step"]), [0, 1, 2, 3])

        # A watch resumed from an index gives the rest, and ends the same.
        resumed = list(self.client.watch(job_id, from_index=3, timeout=30))
        self.assertEqual(resumed, events[2:])
        self.assertIn(job_id, [j["id"] for j in self.client.list()])
        self.assertIn(job_id, [j["id"] for j in self.client.list(states=["SUCCEEDED"])])
        self.assertNotIn(job_id, [j["id"] for j in self.client.list(states=["RUNNING"])])

    def test_a_request_id_makes_one_job_and_a_file_resolves_its_paths(self):
        folder = os.path.join(self.work, "files")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "job.yaml")
        with open(path, "w") as f:
            f.write("name: from-file\nworld_size: 1\nmodel: {mlp: {dims: [6, 16, 3]}}\n"
                    "init: {seed: 5}\ndata: {teacher: {seed: 21, samples: 256}}\n"
                    "training: {steps: 2, global_batch_size: 24}\n"
                    "output: {export: out/final.safetensors}\n")
        first = self.client.submit(path, request_id="py-request-1")
        again = self.client.submit(path, request_id="py-request-1")
        self.assertEqual(first, again)
        spec = self.client.list(name="from-file", full_spec=True)[0]["spec"]
        # As muonmeshctl submits it: output.dir defaults to <folder>/runs/<name>;
        # relative paths are taken against the file's folder.
        self.assertEqual(spec["output"]["dir"], os.path.join(folder, "runs", "from-file"))
        self.assertEqual(spec["output"]["export"], os.path.join(folder, "out/final.safetensors"))
        self.assertEqual(self.client.wait(first, timeout=120)["state"], "SUCCEEDED", self.logs())
        self.assertTrue(os.path.isfile(os.path.join(folder, "out", "final.safetensors")))

    def test_a_refused_job_raises_with_every_violation(self):
        bad = job("bad", world=0, steps=-1)
        with self.assertRaises(muonmesh.JobRejected) as caught:
            self.client.submit(bad)
        fields = [field for field, _ in caught.exception.violations]
        self.assertIn("spec.world_size", fields)
        self.assertIn("spec.training.steps", fields)
        self.assertEqual(caught.exception.code.name, "INVALID_ARGUMENT")
        self.assertNotIn("bad", [j["name"] for j in self.client.list()])  # nothing made
        with self.assertRaises(muonmesh.NotFound):
            self.client.get("j-999999")
        with self.assertRaises(muonmesh.JobFileError) as file_error:
            self.client.submit(os.path.join(self.work, "no-such-job.yaml"))
        self.assertIn("no-such-job.yaml", str(file_error.exception))

    def test_a_file_means_what_it_means_to_muonmeshctl(self):
        # The coordinator parses files for the client (Jobs.ParseJobFile), as
        # muonmeshctl does: `off` is the string "off" (PyYAML would read YAML
        # 1.1's false), a number written as a string is refused, and errors
        # carry FILE:LINE:COL and the proto field name.
        folder = os.path.join(self.work, "parser")
        os.makedirs(folder, exist_ok=True)
        base = ("name: {name}\nworld_size: {world}\nmodel: {{mlp: {{dims: [6, 16, 3]}}}}\n"
                "training: {{steps: 1, global_batch_size: 24}}\n")
        off = os.path.join(folder, "off.yaml")
        with open(off, "w") as f:
            f.write(base.format(name="off", world=1) + "optimizer: {muon_replica_split: off}\n")
        job_id = self.client.submit(off)
        self.assertEqual(self.client.get(job_id)["spec"]["optimizer"]["muon_replica_split"], "off")
        self.assertEqual(self.client.wait(job_id, timeout=120)["state"], "SUCCEEDED", self.logs())
        quoted = os.path.join(folder, "quoted.yaml")
        with open(quoted, "w") as f:
            f.write(base.format(name="quoted", world='"2"'))
        with self.assertRaises(muonmesh.JobFileError) as bad:
            self.client.submit(quoted)
        message = str(bad.exception)
        self.assertTrue(message.startswith(quoted + ":2:"), message)
        self.assertIn("world_size", message)
        self.assertNotIn("worldSize", message)
        ctl = subprocess.run([CTL, "validate", "--job", quoted], capture_output=True, text=True)
        self.assertEqual(ctl.returncode, 1)
        self.assertEqual(ctl.stderr.strip(), message)

    def test_a_cancelled_job_ends_its_watch_cancelled(self):
        # Its own output folder: a job never starts over an earlier run's
        # outputs (a rerun of this test in the same build tree).
        job_id = self.client.submit(job("long", world=1, steps=100000,
                                        out=os.path.join(self.work, "long")))
        for event in self.client.watch(job_id, timeout=60):
            if "step" in event:
                break  # it trains
        cancelled = self.client.cancel(job_id, reason="from python")
        self.assertEqual(cancelled["state"], "CANCELLED")
        self.assertIn("from python", cancelled["reason"])
        last = list(self.client.watch(job_id, timeout=60))[-1]
        self.assertEqual(last["state_change"]["state"], "CANCELLED")
        # Its worker is given back.
        end = time.monotonic() + 30
        while time.monotonic() < end:
            if all(w["state"] == "IDLE" for w in self.client.workers()):
                break
            time.sleep(0.1)
        self.assertEqual(sorted((w["info"]["worker_id"], w["state"]) for w in self.client.workers()),
                         [("w0", "IDLE"), ("w1", "IDLE")], self.logs())

    def wait_idle(self):
        end = time.monotonic() + 30
        while time.monotonic() < end:
            if all(w["state"] == "IDLE" for w in self.client.workers()):
                return
            time.sleep(0.1)
        self.fail("the workers did not come back idle\n" + self.logs())

    def test_a_cancel_with_a_checkpoint_is_resumed_without_losing_a_step(self):
        out = os.path.join(self.work, "resumable")
        job_id = self.client.submit(job("resumable", world=2, steps=100000, out=out))
        for event in self.client.watch(job_id, timeout=60):
            if event.get("step", {}).get("step", 0) >= 2:
                break
        cancelled = self.client.cancel(job_id, reason="to resume", checkpoint=True)
        self.assertEqual(cancelled["state"], "CANCELLED")
        self.assertIn("checkpoint step", cancelled["reason"])
        self.wait_idle()
        done = sorted(d for d in os.listdir(os.path.join(out, "checkpoints"))
                      if os.path.isfile(os.path.join(out, "checkpoints", d, "COMPLETE")))
        self.assertTrue(done, self.logs())
        checkpoint_step = int(done[-1].split("-")[1])
        self.assertGreaterEqual(checkpoint_step, 3)  # after the step seen above
        metrics = os.path.join(out, "metrics", "rank-0.jsonl")
        with open(metrics) as f:
            before = len(f.readlines())
        # A second job in the folder while the resume runs is refused,
        # naming the job that owns it.
        resumed = self.client.resume(job_id)
        self.assertEqual(self.client.get(resumed)["spec"]["init"]["checkpoint"], out)
        with self.assertRaises(muonmesh.MuonmeshError) as clash:
            self.client.submit(job("resumable", world=2, steps=100000, out=out))
        self.assertEqual(clash.exception.code.name, "FAILED_PRECONDITION")
        self.assertIn(resumed, str(clash.exception))
        # The resumed job appends to the folder's metrics, from the step the
        # checkpoint holds.
        end = time.monotonic() + 60
        lines = []
        while time.monotonic() < end and len(lines) <= before:
            time.sleep(0.1)
            with open(metrics) as f:
                lines = [line for line in f.readlines() if line.endswith("\n")]
        self.assertGreater(len(lines), before, self.logs())
        self.assertEqual(json.loads(lines[before])["step"], checkpoint_step, self.logs())
        self.client.cancel(resumed)
        self.wait_idle()

    def test_lost_workers_are_removed_and_a_live_one_is_refused(self):
        gone = []
        for wid in ("w-gone", "w-gone2"):
            p = Process([WORKER, "--coordinator", self.address, "--worker-id", wid,
                         "--memory-budget", "1GiB"], os.path.join(self.work, f"{wid}.log"))
            p.wait_for("registered as")
            gone.append(p)
        for p in gone:
            p.stop()  # SIGKILL: its lease (3 s) runs out
        states = {}
        end = time.monotonic() + 30
        while time.monotonic() < end and \
                (states.get("w-gone"), states.get("w-gone2")) != ("LOST", "LOST"):
            time.sleep(0.1)
            states = {w["info"]["worker_id"]: w["state"] for w in self.client.workers()}
        self.assertEqual((states.get("w-gone"), states.get("w-gone2")), ("LOST", "LOST"), states)
        with self.assertRaises(muonmesh.MuonmeshError) as live:
            self.client.remove_worker("w0")
        self.assertEqual(live.exception.code.name, "FAILED_PRECONDITION")
        self.assertIn("only a LOST worker is removed", str(live.exception))
        with self.assertRaises(muonmesh.NotFound):
            self.client.remove_worker("w-never")
        self.client.remove_worker("w-gone")
        self.assertEqual(self.client.remove_lost_workers(), ["w-gone2"])
        ids = [w["info"]["worker_id"] for w in self.client.workers()]
        self.assertEqual(sorted(ids), ["w0", "w1"])

    def test_validate_and_plan_answer_for_a_model_spec(self):
        model = {"name": "m", "units": [{"name": "u", "params": [
            {"name": "w", "shape": [64, 32], "optimizer": "muon"},
            {"name": "b", "shape": [32], "optimizer": "adamw"}]}]}
        self.assertEqual(self.client.validate(model, 4), [])
        violations = self.client.validate(model, 4, parallelism={"expert_model_parallel_size": 3})
        self.assertTrue(any("expert_model_parallel_size" in f for f, _ in violations), violations)
        plan = self.client.plan(model, 4)
        self.assertEqual(plan["plan"]["world_size"], 4)
        with self.assertRaises(muonmesh.JobRejected):
            self.client.plan(model, 4, parallelism={"expert_model_parallel_size": 3})

    def test_the_address_comes_from_the_environment(self):
        os.environ["MUONMESH_COORDINATOR"] = self.address
        try:
            with muonmesh.Client() as c:
                self.assertEqual(c.address, self.address)
                self.assertEqual(len(c.workers()), 2)
        finally:
            del os.environ["MUONMESH_COORDINATOR"]
        with self.assertRaises(ValueError) as caught:
            muonmesh.Client(self.address, token="a-token-without-any-tls")
        self.assertIn("TLS", str(caught.exception))


class TlsTokenTest(unittest.TestCase):
    """A coordinator with TLS and role tokens (no workers: a job waits)."""

    TOKENS = {"viewer": "viewer-token-5b1e0c9d4f", "submitter": "submitter-token-8a7f3e2c11"}

    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="muonmesh_py_tls_")
        certs = os.path.join(cls.work, "certs")
        subprocess.run(["/bin/bash", MAKE_CERTS, certs], check=True, capture_output=True)
        cls.ca = os.path.join(certs, "ca.pem")
        tokens = os.path.join(certs, "tokens")
        with open(tokens, "w") as f:
            f.write("".join(f"{role} {token}\n" for role, token in cls.TOKENS.items()))
        os.chmod(tokens, 0o600)
        cls.coordinator, cls.address = start_coordinator(
            cls.work, ["--tls-cert", os.path.join(certs, "server.pem"), "--tls-key",
                       os.path.join(certs, "server.key"), "--tokens-file", tokens])

    @classmethod
    def tearDownClass(cls):
        cls.coordinator.stop()
        shutil.rmtree(cls.work, ignore_errors=True)

    def test_tokens_travel_over_tls_and_roles_hold(self):
        token_file = os.path.join(self.work, "submitter.token")
        with open(token_file, "w") as f:
            f.write(self.TOKENS["submitter"] + "\n")
        with muonmesh.Client(self.address, tls=self.ca, token_file=token_file) as c:
            job_id = c.submit(job("waits", world=1, out=os.path.join(self.work, "waits")))
            self.assertEqual(c.get(job_id)["state"], "PENDING")
        with muonmesh.Client(self.address, tls=self.ca, token=self.TOKENS["viewer"]) as viewer:
            self.assertEqual(viewer.get(job_id)["name"], "waits")
            with self.assertRaises(muonmesh.AuthError) as denied:
                viewer.cancel(job_id)
            self.assertEqual(denied.exception.code.name, "PERMISSION_DENIED")
        with muonmesh.Client(self.address, tls=self.ca, token="not-a-real-token-3141592653") as c:
            with self.assertRaises(muonmesh.AuthError):
                c.get(job_id)
        with muonmesh.Client(self.address, tls=self.ca) as anonymous:
            with self.assertRaises(muonmesh.AuthError):
                anonymous.list()
        # Environment defaults, as muonmeshctl reads them.
        os.environ.update({"MUONMESH_COORDINATOR": self.address, "MUONMESH_TLS_CA": self.ca,
                           "MUONMESH_TOKEN_FILE": token_file})
        try:
            with muonmesh.Client() as c:
                self.assertEqual(c.cancel(job_id)["state"], "CANCELLED")
        finally:
            for name in ("MUONMESH_COORDINATOR", "MUONMESH_TLS_CA", "MUONMESH_TOKEN_FILE"):
                del os.environ[name]
        # Plaintext against a TLS port: unavailable, not a hang.
        with muonmesh.Client(self.address, timeout=5) as plain:
            with self.assertRaises(muonmesh.Unavailable):
                plain.list()


if __name__ == "__main__":
    unittest.main(verbosity=2, argv=sys.argv[:1])
