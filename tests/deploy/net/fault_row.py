#!/usr/bin/env python3
"""One row of the network fault bench (faults.sh) from what a run left.

  fault_row.py NAME FAULT_MS FAULT_STEP VICTIM EVENTS STATUS WORKERS METRICS REF_WEIGHTS WEIGHTS

EVENTS is the job's `muonmeshctl watch --json` (one event a line, stamped by
the coordinator), STATUS `status --json`, WORKERS `workers --json`, METRICS
the coordinator's /metrics text. Prints a few lines of detail, then the row
(it starts with '|'). Exits 1 when the job did not succeed or its weights
differ from the run without a fault, and, with CHECK=1 in the environment,
when the scenario's promise is broken: no restart and no step redone for a
cut coordinator link or lost frames, the cut-off worker (and only it) blamed
for a peer partition, and the attempt failed by the stall checks (a reason
naming it "cut off from its peers"), not by a collective timeout.
"""
import os
import json
import re
import sys


def main(argv):
    (name, fault_ms, fault_step, victim, events_file, status_file, workers_file,
     metrics_file, ref_weights, weights) = argv[1:11]
    fault_ms = int(fault_ms)
    events = [json.loads(line) for line in open(events_file) if line.startswith("{")]
    steps = [(e["unix_ms"], e["step"]["step"], e["step"]["attempt"])
             for e in events if "step" in e]
    changes = [e["state_change"] for e in events if "state_change" in e]
    status = json.load(open(status_file))
    job = status.get("job", status)
    state = job.get("state", "?")
    attempts = 1 + max([c.get("attempt", 0) for c in changes] + [s[2] for s in steps] + [0])

    # Steps recorded again: a step number the coordinator had already recorded.
    seen, redone = set(), 0
    for _, step, _ in steps:
        redone += step in seen
        seen.add(step)
    # The job's next step: the first of a later attempt when it restarted
    # (a step the old attempt finished as the fault struck is not one),
    # else the first recorded after the fault.
    after = [(ms, attempt) for ms, _, attempt in steps if ms > fault_ms] if fault_ms else []
    before = [attempt for ms, _, attempt in steps if ms <= fault_ms]
    later = [ms for ms, attempt in after if before and attempt > before[-1]]
    first = later[0] if later else (after[0][0] if after else None)
    next_step = "%.2f s" % ((first - fault_ms) / 1e3) if first else "-"

    count = total = 0.0
    for line in open(metrics_file):
        if line.startswith("muonmesh_job_recovery_seconds_count"):
            count = float(line.split()[-1])
        if line.startswith("muonmesh_job_recovery_seconds_sum"):
            total = float(line.split()[-1])
    recovery = "%d, %.2f s" % (count, total)

    workers = json.load(open(workers_file))["workers"]
    quarantined = [w["info"]["worker_id"] for w in workers
                   if int(w.get("quarantined_until_unix_ms", 0)) > 0]
    blamed = sorted({m for c in changes
                     for m in re.findall(r"worker (\S+) blamed", c.get("reason", ""))})
    blame = "blamed %s; quarantined %s" % (",".join(blamed) or "none",
                                           ",".join(quarantined) or "none")
    same = "-"
    if name != "none":
        try:
            same = "yes" if open(ref_weights, "rb").read() == open(weights, "rb").read() else "NO"
        except OSError as e:
            same = "missing (%s)" % e.strerror
    for c in changes:
        print("  %s (attempt %d): %s" % (c["state"], c.get("attempt", 0), c.get("reason", "")))
    print("  %s: %s after %d attempts; fault at step %s on %s" %
          (name, state, attempts, fault_step, victim or "-"))
    took = "%.1f s" % ((steps[-1][0] - steps[0][0]) / 1e3) if steps else "-"
    print("| %s | %d | %d | %s | %s | %s | %s | %s |" %
          (name, attempts, redone, next_step, recovery, took, blame, same))
    broken = []
    if state != "SUCCEEDED":
        broken.append("the job ended %s" % state)
    if same not in ("-", "yes"):
        broken.append("the weights differ from the run without the fault: %s" % same)
    if os.environ.get("CHECK") == "1":
        if name in ("coordinator-link", "loss") and (attempts, redone) != (1, 0):
            broken.append("%d attempts and %d steps redone, not 1 and 0" % (attempts, redone))
        if name.startswith("peer-partition") and blamed != [victim]:
            broken.append("blamed %s, not the cut-off %s" % (blamed, victim))
        if name == "peer-partition" and not any(
                "%s): cut off from its peers" % victim in c.get("reason", "") for c in changes):
            broken.append("the attempt did not fail as %s cut off from its peers "
                          "(the stall checks)" % victim)
        if name == "peer-partition-no-spare" and quarantined != [victim]:
            broken.append("quarantined %s, not the cut-off %s" % (quarantined, victim))
    for b in broken:
        print("FAIL: %s: %s" % (name, b))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
